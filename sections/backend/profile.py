"""What the planner reads of each block without running a step: its costs' record (``BlockProfile``, counted from
traces by ``backend.static_cost``), border shapes and specs from one forward of a small slice, and each block's
gradient bytes."""

from __future__ import annotations

from dataclasses import dataclass

import keras
import tensorflow as tf

from .structure import nbytes


@dataclass(frozen=True)
class BlockProfile:
    """One block's costs, at the real batch."""

    name: str
    output_bytes: int       # its output border
    kept_bytes: int         # activations its compiled backward needs (a chain of blocks accumulates these)
    transient_bytes: int    # gradient buffers alive only while its own backward runs
    forward_seconds: float  # one compiled forward (the re-run cost)
    stored_bytes: int = 0   # what a tape keeps from its compiled forward until its backward (policy "store")
    entry_bytes: int = 0    # of kept_bytes and stored_bytes, its input border's (held by the caller when it
                            # starts a section)


_NOT_ACTIVATIONS = {"Const", "ReadVariableOp", "Identity", "Placeholder", "VarHandleOp", "NoOp", "Shape",
                    "AssignVariableOp", "AssignAddVariableOp", "StatelessRandomGetKeyCounter"}


def shape_costs(network, small, real: int, input_specs, output_specs) -> list[int]:
    """Activation bytes of each block counted from the tensor shapes of its traced forward (every float
    tensor an op produces), at the real batch. Nothing runs, so this is the same on every run and machine."""
    pb = int(tf.nest.flatten(small[network.inputs])[0].shape[0])
    costs = []
    for block, specs in zip(network.blocks, [input_specs, *output_specs[:-1]]):
        specs = specs_at(specs, pb)
        fn = tf.function(lambda x, b=block: b(x, small, training=True))
        total = 0
        for op in fn.get_concrete_function(specs).graph.get_operations():
            if op.type in _NOT_ACTIVATIONS:
                continue
            for t in op.outputs:
                if t.dtype.is_floating and t.shape.is_fully_defined():
                    total += t.shape.num_elements() * t.dtype.size
        costs.append(total * real // pb)
    return costs


def specs_at(structure, batch: int):
    """``structure``'s TensorSpecs with ``batch`` as their first dimension."""
    return tf.nest.map_structure(lambda t: tf.TensorSpec([batch] + t.shape.as_list()[1:], t.dtype), structure)


def gradient_bytes(network) -> list[int]:
    """Bytes of the gradients each block's backward produces (a variable shared by blocks counts once, at its
    last block: the first gradient the backward makes)."""
    seen, out = set(), []
    for block in reversed(network.blocks):
        total = 0
        for v in block.layer.trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                total += nbytes(v)
        out.append(total)
    return out[::-1]


def _first_component(variable):
    """Under a strategy (the probe runs in cross-replica context, reading the first replica's copies), the
    first replica's copy of a mirrored variable: the one a gradient reaches."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return variable


SPEC_BATCH = 64  # examples the shape and spec probes trace with (nothing they read depends on the batch size)


def probe_slice(network, batch, probe_batch: int = SPEC_BATCH) -> tuple[dict, int]:
    """The first ``probe_batch`` examples of a batch, and the real batch size."""
    real = int(tf.nest.flatten(batch[network.inputs])[0].shape[0])
    pb = max(1, min(probe_batch, real))
    return tf.nest.map_structure(lambda t: t[:pb], dict(batch)), real


def output_specs(network, small, real: int) -> tuple[list, object]:
    """Each block's output TensorSpecs at the real batch, from one eager forward of the probe slice
    (state untouched); and the network input's."""
    mapping = [(v, tf.identity(v.value)) for v in network.non_trainable_variables]
    h, specs = small[network.inputs], []
    with keras.StatelessScope(state_mapping=mapping):
        for block in network.blocks:
            h = block(h, small, training=True)
            specs.append(specs_at(h, real))
    return specs, specs_at(small[network.inputs], real)
