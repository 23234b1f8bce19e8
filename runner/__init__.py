"""The declarative runner: `python -m runner key=value ...` composes a Hydra config, trains, logs, checkpoints.

Importing this package is cheap; TensorFlow loads only when a run starts.
"""
