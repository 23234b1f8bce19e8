"""``tf.function`` traced with an unknown batch dimension.

With a static batch size, Grappler's constant folding turns the broadcasts in batch-norm gradients
into constants as large as an activation and keeps them alive with the function. Measured on a ResNet
at batch 1024: about 64 MiB per batch-norm layer per compiled backward, for as long as the engine
lives. A trace whose batch dimension is unknown has nothing to fold, so nothing stays behind.
"""

from __future__ import annotations

import tensorflow as tf

from . import tf_internals as internals


def _relax(value, batch: int):
    if isinstance(value, tf.distribute.DistributedValues):
        # A per-replica value: each replica's component relaxed alike (its spec class takes component specs).
        return internals.type_spec_class(value)(*(_relax(v, batch) for v in value.values))
    if isinstance(value, tf.IndexedSlices):
        # Sparse gradients: how many rows they carry varies from batch to batch.
        values = tf.TensorShape(value.values.shape).as_list()
        return tf.IndexedSlicesSpec(
            shape=tf.TensorShape([None] + values[1:]), dtype=value.dtype, indices_dtype=value.indices.dtype,
            dense_shape_dtype=None if value.dense_shape is None else value.dense_shape.dtype,
            indices_shape=tf.TensorShape([None]))
    if isinstance(value, (tf.Tensor, tf.Variable)) or hasattr(value, "shape") and hasattr(value, "dtype"):
        shape = tf.TensorShape(value.shape).as_list()
        if shape and shape[0] == batch:
            shape[0] = None
        return tf.TensorSpec(shape, tf.as_dtype(value.dtype))
    return value


def _key(specs) -> tuple:
    flat = tf.nest.flatten(specs)
    return (str(tf.nest.map_structure(lambda _: 0, specs)),
            tuple((tuple(s.shape.as_list()), s.dtype.name) if isinstance(s, tf.TensorSpec) else repr(s)
                  for s in flat))


class RelaxedFunction:
    """Calls ``fn`` compiled once per signature with the leading batch dimension unknown.

    ``batch_args`` are the positions of the arguments whose tensors are batch-major (others, such as
    variable snapshots, keep their static shapes).
    """

    def __init__(self, fn, jit_compile: bool = False, batch_args: tuple[int, ...] = (0, 1)):
        self.function = tf.function(fn, jit_compile=jit_compile)
        self.batch_args = batch_args
        self._traced: set = set()

    def __call__(self, batch_size: int, *args):
        specs = tuple(
            tf.nest.map_structure(lambda v: _relax(v, batch_size), a) if i in self.batch_args
            else tf.nest.map_structure(lambda v: _relax(v, -1), a)
            for i, a in enumerate(args)
        )
        key = _key(specs)
        if key not in self._traced:
            self.function.get_concrete_function(*specs)
            self._traced.add(key)
        with internals.unpruned_calls():
            return self.function(*args)

    def tracing_count(self) -> int:
        return self.function.experimental_get_tracing_count()
