"""Where a step runs: one device, or every replica of a ``tf.distribute`` strategy.

The engine's cycle is the same Python loop either way. Under a strategy each compiled section function is
one ``strategy.run`` inside a ``tf.function`` (one multi-device function, no per-replica Python threads at
run time), borders and kept tensors are per-replica values that never leave their device, and the
optimizer is applied once, in replica context, where Keras sums the gradients over replicas in one
all-reduce before its update.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from .. import rules
from . import keras_internals as internals


class DistributeError(ValueError):
    """A strategy, model or batch the distributed step cannot run with."""


class Replicas:
    """A step's replicas. ``strategy=None``: one device and every method is the identity."""

    def __init__(self, strategy=None):
        if strategy is not None and not isinstance(strategy, tf.distribute.Strategy):
            raise DistributeError(f"distribute must be a tf.distribute.Strategy or None; got "
                                  f"{type(strategy).__name__}.")
        self.strategy = strategy
        self.count = strategy.num_replicas_in_sync if strategy is not None else 1

    @property
    def distributed(self) -> bool:
        return self.strategy is not None

    def scope(self):
        return self.strategy.scope() if self.distributed else contextlib.nullcontext()

    def devices(self) -> list[str]:
        """This process's replica devices, short names (``GPU:0``); ``[]`` on one device (the default one)."""
        if not self.distributed:
            return []
        return [tf.DeviceSpec.from_string(d).to_string().split("device:")[-1]
                for d in self.strategy.extended.worker_devices]

    def check_owned(self, variables, optimizer) -> None:
        """Variables and the optimizer must belong to the strategy (made under ``strategy.scope()``)."""
        if not self.distributed:
            return
        outside = [v.path if hasattr(v, "path") else v.name for v in variables
                   if not isinstance(getattr(v, "value", v), tf.distribute.DistributedValues)]
        if outside:
            raise DistributeError(
                f"{len(outside)} variable(s) were created outside the strategy's scope (first: {outside[0]}); "
                f"create the network's layers (and the optimizer) under `with strategy.scope():`.")
        owner = internals.optimizer_strategy(optimizer, self.strategy)
        if owner is not self.strategy:
            raise DistributeError(f"the optimizer {type(optimizer).__name__} was created outside the strategy's "
                                  f"scope; create it under `with strategy.scope():`.")

    # ------------------------------------------------------------------ batches
    def split(self, batch: dict) -> dict:
        """Each replica takes its slice of the global batch (replica r: rows ``r*n .. (r+1)*n``), so the
        examples of a step do not depend on how many devices or workers train it."""
        if not self.distributed:
            return batch
        size = local_size(batch, self)
        try:
            rules.check_batch_divides(size, self.count)
        except rules.RuleError as err:
            raise DistributeError(str(err)) from None
        n = size // self.count

        def slice_for(ctx):
            r = ctx.replica_id_in_sync_group
            return tf.nest.map_structure(lambda t: t[r * n:(r + 1) * n], batch)

        return self.strategy.experimental_distribute_values_from_function(slice_for)

    def first_slice(self, batch: dict) -> dict:
        """Replica 0's share of a global batch (what each replica's functions are traced and planned for)."""
        if not self.distributed:
            return batch
        n = local_size(batch, self) // self.count
        return tf.nest.map_structure(lambda t: t[:n], batch)

    # ------------------------------------------------------------------ running
    def wrap(self, fn):
        """``fn`` run on every replica (inside the ``tf.function`` that compiles it)."""
        if not self.distributed:
            return fn
        strategy = self.strategy

        def on_replicas(*args):
            return strategy.run(fn, args)

        on_replicas.__name__ = getattr(fn, "__name__", "on_replicas")
        return on_replicas

    def local(self, value):
        """This process's first replica's component of a per-replica value (the value itself on one device)."""
        if isinstance(value, tf.distribute.DistributedValues):
            return self.strategy.experimental_local_results(value)[0]
        return value

    def mean(self, value) -> float:
        """A per-replica scalar averaged over all replicas (replica means of equal shares: the global mean)."""
        if self.distributed:
            value = self.strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=None)
        return float(value)

    def max(self, value) -> float:
        if self.distributed:
            value = self.strategy.reduce(tf.distribute.ReduceOp.MAX, value, axis=None)
        return float(value)

    def sum(self, value):
        """A per-replica tensor summed over all replicas (a gradient of the 1/replicas-scaled loss: the
        global batch's gradient)."""
        if not self.distributed or value is None:
            return value
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None)

    def components(self, value) -> list:
        """This process's per-replica components of a tensor, a per-replica value or a (mirrored) variable."""
        if not self.distributed:
            return [value]
        value = getattr(value, "value", value) if not isinstance(value, tf.distribute.DistributedValues) else value
        return list(self.strategy.experimental_local_results(value))

    def pack(self, parts: list):
        """The per-replica value whose components (this process's replicas, in order) are ``parts``."""
        if not self.distributed or any(p is None for p in parts):
            return parts[0] if not self.distributed else None
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: parts[ctx.replica_id_in_sync_group % len(parts)])

    def add(self, fn, a, b):
        """``fn(a, b)`` on each replica's components."""
        return self.strategy.run(fn, (a, b)) if self.distributed else fn(a, b)


def local_size(batch, replicas: Replicas) -> int:
    """The leading dimension of a (possibly per-replica) batch's first tensor."""
    leaf = tf.nest.flatten(batch)[0]
    return int(replicas.local(leaf).shape[0])


def scale_for_replicas(loss):
    """The loss each replica differentiates: its local mean over the number of replicas in sync, so Keras's
    sum of gradients over replicas is the global batch's gradient (as Keras scales losses under
    ``tf.distribute``)."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    return loss if replicas == 1 else loss * tf.cast(1.0 / replicas, loss.dtype)
