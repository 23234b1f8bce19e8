"""Mixed precision: the loss scale of a ``keras.optimizers.LossScaleOptimizer`` and the rounding each compute
dtype allows when two graphs of the same step are compared."""

from __future__ import annotations

import tensorflow as tf

# Relative error (per-variable gradient norm) allowed between two graphs of one step, by compute dtype. Graphs
# that differ in kernels or fusions round differently, and a sum of n terms rounded in the compute dtype carries
# up to about sqrt(n) units of roundoff u (2**-24 float32; 2**-11 float16; 2**-8 bfloat16, ~3 significant
# digits). float32 keeps its historical 1e-4; the mixed ones allow sqrt(1024) u: 2**-6 and 2**-3. Measured,
# sectioned (4) vs whole-graph on the notebook ResNet, 64 examples, 3 seeds: up to 7.8e-3 (float16) and 2.5e-2
# (bfloat16), while each differs from float32 by 0.17-0.23 and 0.64 (docs/notes/precision.md).
TOLERANCE = {"float32": 1e-4, "float16": 2.0**-6, "bfloat16": 2.0**-3}
# One unit of rounding (the spacing of numbers just above 1) in each compute dtype.
ROUNDING = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


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
    """The narrowest compute dtype among the network's layers (``float32`` unless a mixed policy built them);
    a block that is not a Keras layer (``Network.from_keras``'s segments) is looked into through ``layers``."""
    dtypes, stack = set(), list(network.layers)
    while stack:
        layer = stack.pop()
        if hasattr(layer, "compute_dtype"):
            dtypes.add(str(layer.compute_dtype))
        else:
            stack.extend(getattr(layer, "layers", ()))
    for name in ("float16", "bfloat16"):
        if name in dtypes:
            return name
    return "float32"


def tolerance(network) -> float:
    return TOLERANCE.get(compute_dtype(network), TOLERANCE["float32"])
