"""The machine: strategies and clusters, threads, quiet TensorFlow, job isolation, folder locks, the dtype policy,
memory, atomic files.
"""
