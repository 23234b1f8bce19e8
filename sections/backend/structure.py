"""Helpers for the nested tensor structures that cross section borders."""

from __future__ import annotations

import tensorflow as tf


def float_leaves(structure) -> list[tf.Tensor]:
    """The floating-point tensors of a nested structure, in ``tf.nest`` order (these carry gradients)."""
    return [t for t in tf.nest.flatten(structure) if _is_float(t)]


def nbytes(structure) -> int:
    """Bytes held by the tensors (or TensorSpecs) of a nested structure; unknown dims count as 0."""
    total = 0
    for t in tf.nest.flatten(structure):
        shape = tf.TensorShape(t.shape)
        if shape.rank is None or None in shape.as_list():
            continue
        total += shape.num_elements() * tf.as_dtype(t.dtype).size
    return total


def _is_float(t) -> bool:
    if isinstance(t, tf.distribute.DistributedValues):  # a per-replica value: its components share a dtype
        t = t.values[0]
    return tf.as_dtype(t.dtype).is_floating
