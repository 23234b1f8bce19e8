"""What the runner needs of TensorFlow that TensorFlow names only privately: public names for
``sections/backend/tf_internals.py``'s touch points (each with the releases it was written for, and what it does
where a release lacks it). Loads no TensorFlow itself: each function imports it when called."""

from .backend.tf_internals import (checkpoint_state_parses, disable_op_determinism, runtime_started,
                                   write_checkpoint_state)

__all__ = ["checkpoint_state_parses", "disable_op_determinism", "runtime_started", "write_checkpoint_state"]
