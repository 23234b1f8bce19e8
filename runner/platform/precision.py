"""`train.precision`: the Keras dtype policy a run's model is built under, and mixed_float16's loss scaling.

`float32` changes nothing. `mixed_bfloat16` and `mixed_float16` keep variables in float32 and compute in the
narrow type, so activations (and the borders between sections) take half the bytes. `mixed_float16` also wraps
the optimizer in `keras.optimizers.LossScaleOptimizer` (dynamic scale, non-finite steps skipped), whose scale
is optimizer state and is saved with it in checkpoints. No TensorFlow at import: `runner.config.checks` reads the names.
"""

from __future__ import annotations

from contextlib import contextmanager

PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")


def set_precision(precision: str) -> None:
    """Make `precision` Keras's global dtype policy: layers built from now on compute in it.

    Call after `keras.backend.clear_session()` (which resets the policy to float32) and before the model is built."""
    import keras

    keras.config.set_dtype_policy(precision)


def wrap_optimizer(optimizer, precision: str):
    """`mixed_float16`: the optimizer inside a `LossScaleOptimizer` (unless it already is one); else unchanged."""
    import keras

    if precision == "mixed_float16" and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


@contextmanager
def keeping_dtype_policy():
    """Put Keras's global dtype policy back as it was when the block ends (a sweep runs several jobs in one
    process; the next job, or the caller of `runner.app.run`, must not inherit this one's policy)."""
    import keras

    before = keras.config.dtype_policy()
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)
