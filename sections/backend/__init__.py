"""TensorFlow mechanics the trainers stand on: nested structures, memory meters, shape-relaxed functions, replicas,
loss scaling, per-block probes.
"""
