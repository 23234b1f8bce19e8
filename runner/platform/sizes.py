"""Impossible sizes refused before anything is allocated: a batch whose examples alone exceed the machine's memory."""

from __future__ import annotations

import math

from runner.errors import ConfigError
from sections.rules import human_bytes


def example_bytes(spec) -> int:
    """Bytes of one example of a batched `tf.data` element spec (a dict of TensorSpecs with a batch dimension);
    an unknown dimension (variable length) counts as 1, so this is a lower bound."""
    import tensorflow as tf

    total = 0
    for s in tf.nest.flatten(spec):
        dims = [d if d is not None else 1 for d in s.shape.as_list()[1:]]
        total += math.prod(dims) * s.dtype.size
    return total


def activation_bytes(network, spec, whole: bool = True) -> int | None:
    """Bytes of the blocks' outputs for one example (what a whole-graph step keeps for its backward, at least;
    ``whole=False``: the largest block's input and output, what any sectioned step holds at once), from an
    eager forward of a one-example batch of zeros in a stateless scope (no state moves, no random draws kept);
    None if the network cannot be probed that way, or the data has variable lengths. Builds the network's variables (call it where the engine
    would: in the strategy's scope)."""
    import keras
    import tensorflow as tf

    if any(None in s.shape.as_list()[1:] for s in tf.nest.flatten(spec)):
        return None  # variable lengths: a made-up length could build a layer with the wrong shape
    try:
        small = tf.nest.map_structure(lambda s: tf.zeros([1, *s.shape[1:]], s.dtype), spec)
        network.build(small)
        mapping = [(v, tf.identity(v.value)) for v in network.non_trainable_variables]
        sizes, h = [], small[network.inputs]
        with keras.StatelessScope(state_mapping=mapping):
            for block in network.blocks:
                h = block(h, small, training=True)
                sizes.append(sum(int(t.shape.num_elements() or 0) * tf.as_dtype(t.dtype).size
                                 for t in tf.nest.flatten(h) if hasattr(t, "shape")))
        if whole:
            return sum(sizes)
        return max((a + b for a, b in zip([0, *sizes], sizes)), default=0)
    except Exception as err:  # noqa: BLE001 - an estimate: the run's own build reports what is wrong with the network
        from sections import VariablesDoNotFit

        if isinstance(err, VariablesDoNotFit):  # the variables half made: no later build could report it
            raise
        return None


def machine_memory() -> int | None:
    """The memory a CPU step can use: the CPU allocator's hard limit where one is set (TF_CPU_BFC_MEM_LIMIT_IN_MB),
    else physical memory or the container's (cgroup) limit when lower; None when none can be read."""
    from sections.allocator import cpu_limit, machine_memory as physical

    return cpu_limit() or physical()[0]


def check_batch_fits(batch: int, spec, activations: int | None = None, memory: int | None = None,
                     outputs: str = "block outputs") -> None:
    """ConfigError when `batch` examples of `spec` (plus `activations` bytes per example, the blocks' outputs)
    need more than the machine's memory. A lower bound: what a block holds inside comes on top."""
    memory = memory if memory is not None else machine_memory()
    inputs = example_bytes(spec)
    per = inputs + (activations or 0)
    if memory is None or per == 0 or batch * per <= memory:
        return
    what = (f"{human_bytes(per)} each: {human_bytes(inputs)} of input, {human_bytes(activations)} of {outputs}"
            if activations else f"{human_bytes(per)} each")
    raise ConfigError("batch", batch, f"a step needs at least {human_bytes(batch * per)} ({what}), more than this "
                      f"machine's {human_bytes(memory)} of memory; allowed: at most {memory // per} here")
