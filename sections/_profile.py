"""A short probe of each block at a small batch: border shapes and activation memory, scaled to the real batch."""

from __future__ import annotations

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
    activation_bytes: int  # measured training memory of the block alone, scaled to the real batch
    measured: bool         # False when the allocator keeps no statistics (estimate = 2x output bytes)


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
            meter.reset()
            base = meter.current()
            with tf.GradientTape() as tape:
                xs = float_leaves(h)
                tape.watch(xs)
                out = block(h, small, training=True)
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
                activation_bytes=int(used * scale) if measured else 2 * out_bytes,
                measured=measured,
            ))
            h = out
            del tape
    return profiles, _real_specs(batch[network.inputs], real)
