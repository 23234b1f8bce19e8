"""A short probe of each block at a small batch: border shapes and activation memory, scaled to the real batch."""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras
import tensorflow as tf

from ._memory import MemoryMeter
from ._structure import batch_size, float_leaves, nbytes


@dataclass
class BlockProfile:
    name: str
    output_specs: object  # nested TensorSpecs at the real batch
    output_bytes: int      # at the real batch
    kept_bytes: int        # held by the tape after the block's forward (what a chain of blocks accumulates)
    transient_bytes: int   # extra memory while its gradient runs (buffers freed before the next block)
    measured: bool         # False when the allocator keeps no statistics (estimates from output bytes)
    forward_seconds: float  # one forward at the probe batch, scaled to the real batch (the re-run cost)

    @property
    def activation_bytes(self) -> int:
        return self.kept_bytes + self.transient_bytes


def section_activation_bytes(profiles) -> int:
    """Training memory of consecutive blocks run as one section: all kept bytes plus the largest transient."""
    if not profiles:
        return 0
    return sum(p.kept_bytes for p in profiles) + max(p.transient_bytes for p in profiles)


def _real_specs(structure, batch: int):
    return tf.nest.map_structure(lambda t: tf.TensorSpec([batch] + t.shape.as_list()[1:], t.dtype), structure)


def profile_blocks(network, batch, meter: MemoryMeter, probe_batch: int = 32) -> tuple[list[BlockProfile], object]:
    """Run each block once forward and backward on the first ``probe_batch`` examples, state untouched.

    Returns the profiles and the TensorSpecs of the network input at the real batch.
    """
    real = batch_size(batch[network.inputs])
    pb = max(1, min(probe_batch, real))
    scale = real / pb
    small = tf.nest.map_structure(lambda t: t[:pb], dict(batch))
    state = network.non_trainable_variables
    mapping = [(v, tf.identity(v.value)) for v in state]
    profiles = []
    h = small[network.inputs]
    with keras.StatelessScope(state_mapping=mapping):
        for block in network.blocks:
            block(h, small, training=True)  # warm-up: first eager call pays kernel setup
            t0 = time.perf_counter()
            block(h, small, training=True)
            seconds = (time.perf_counter() - t0) * scale
            meter.reset()
            base = meter.current()
            with tf.GradientTape() as tape:
                xs = float_leaves(h)
                tape.watch(xs)
                out = block(h, small, training=True)
            kept = meter.current() - base
            ys = float_leaves(out)
            variables = list(block.layer.trainable_variables)
            if ys and (xs or variables):
                tape.gradient(ys, xs + variables, output_gradients=[tf.ones_like(y) for y in ys])
            used = meter.peak() - base
            out_bytes = nbytes(_real_specs(out, real))
            measured = meter.available and used > 0
            profiles.append(BlockProfile(
                name=block.name,
                output_specs=_real_specs(out, real),
                output_bytes=out_bytes,
                kept_bytes=int(kept * scale) if measured else out_bytes,
                transient_bytes=int(max(used - kept, 0) * scale) if measured else out_bytes,
                measured=measured,
                forward_seconds=seconds,
            ))
            h = out
            del tape
    return profiles, _real_specs(batch[network.inputs], real)
