"""All-finite state: one compiled check over the network's float variables each step, naming the first bad one."""

from __future__ import annotations

import tensorflow as tf


class FiniteCheck:
    """`first_bad()`: the path of the first float variable holding NaN or Inf, else None.

    The all-finite test is one graph over every variable (a read of the weights, cheap next to a step); the
    name is looked up variable by variable only when it fails."""

    def __init__(self, variables):
        self.variables = [v for v in variables if tf.as_dtype(v.dtype).is_floating]
        self._all_finite = tf.function(self._check) if self.variables else None

    def _check(self):
        return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in self.variables]))

    def first_bad(self) -> str | None:
        if self._all_finite is None or bool(self._all_finite()):
            return None
        for v in self.variables:
            if not bool(tf.reduce_all(tf.math.is_finite(v))):
                return getattr(v, "path", None) or v.name
        return None
