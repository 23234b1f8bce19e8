"""Mixed precision: the loss scale of a ``keras.optimizers.LossScaleOptimizer`` and the rounding each compute
dtype allows when two graphs of the same step are compared."""

from __future__ import annotations

import tensorflow as tf

# Relative error (per-variable gradient norm) allowed between two graphs of one step in a compute dtype.
# Graphs that differ in op order or fusion round differently: in float32 that is ~1e-6 (unit roundoff 6e-8);
# bfloat16 keeps 8 significand bits (unit roundoff 2**-9 = 2e-3, ~3 significant digits) and float16 11 bits
# (2**-12 = 2.4e-4); the backward through a deep net rounds at every op, so its gradients carry a few
# dozen units of roundoff (measured: docs/notes/precision.md).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}


def loss_scale(optimizer):
    """The dynamic loss scale of a loss-scale optimizer (built), else None."""
    if hasattr(optimizer, "dynamic_scale") and getattr(optimizer, "built", False):
        return optimizer.dynamic_scale
    return None


def unscale(gradients: list, optimizer) -> list:
    """Gradients of the scaled loss divided by the loss scale, as the optimizer's ``apply_gradients`` does."""
    scale = loss_scale(optimizer)
    if scale is None:
        return list(gradients)
    return [None if g is None else _divide(g, scale) for g in gradients]


def _divide(g, scale):
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(scale, g.values.dtype), g.indices, g.dense_shape)
    return g / tf.cast(scale, g.dtype)


def compute_dtype(network) -> str:
    """The narrowest compute dtype among the network's layers (``float32`` unless a mixed policy built them)."""
    dtypes = {getattr(layer, "compute_dtype", "float32") for layer in network.layers}
    for name in ("float16", "bfloat16"):
        if name in dtypes:
            return name
    return "float32"


def tolerance(network) -> float:
    return TOLERANCE.get(compute_dtype(network), TOLERANCE["float32"])
