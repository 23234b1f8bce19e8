"""Impossible sizes refused before anything is allocated: a batch whose examples alone exceed the machine's memory."""

from __future__ import annotations

import math
import os
from pathlib import Path

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


def activation_bytes(network, spec) -> int | None:
    """Bytes of the blocks' outputs for one example (what a step keeps for its backward, at least), from an
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
        total, h = 0, small[network.inputs]
        with keras.StatelessScope(state_mapping=mapping):
            for block in network.blocks:
                h = block(h, small, training=True)
                total += sum(int(t.shape.num_elements() or 0) * tf.as_dtype(t.dtype).size
                             for t in tf.nest.flatten(h) if hasattr(t, "shape"))
        return total
    except Exception:  # noqa: BLE001 - an estimate: the run's own build reports what is wrong with the network
        return None


def machine_memory() -> int | None:
    """Physical memory, or the container's (cgroup) limit when lower; None when neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            found.append(int(text))
    return min(found) if found else None


def check_batch_fits(batch: int, spec, activations: int | None = None, memory: int | None = None) -> None:
    """ConfigError when `batch` examples of `spec` (plus `activations` bytes per example, the blocks' outputs)
    need more than the machine's memory. A lower bound: what a block holds inside comes on top."""
    memory = memory if memory is not None else machine_memory()
    inputs = example_bytes(spec)
    per = inputs + (activations or 0)
    if memory is None or per == 0 or batch * per <= memory:
        return
    what = (f"{human_bytes(per)} each: {human_bytes(inputs)} of input, {human_bytes(activations)} of block outputs"
            if activations else f"{human_bytes(per)} each")
    raise ConfigError("batch", batch, f"a step needs at least {human_bytes(batch * per)} ({what}), more than this "
                      f"machine's {human_bytes(memory)} of memory; allowed: at most {memory // per} here")
