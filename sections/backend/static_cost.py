"""Each block's costs counted from its traced forward and backward at the real batch (``liveness``): the bytes its
output border holds, what its forward leaves its backward, what its backward needs beside that, and its forward
work in floating-point operations. Tracing runs nothing: the figures are the same in every process and cost no
device memory; kernels' work buffers, which no shape says, are measured per distinct op where the caller passes a
``workspace.Workspaces``. What they leave out (the allocator) is fitted from measurements by
``sections.schedule.search``."""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from .lean import lean_scope
from .liveness import graph_memory, read_after
from .profile import BlockProfile, _first_component, specs_at
from .structure import float_leaves, nbytes

GFLOP = 1e9  # forward work is counted in these units (the planner weighs re-runs by it)


def forward_flops(ops) -> float:
    """Floating-point operations of ``ops`` from their static shapes: convolutions and matrix products by their
    multiply-adds, every other op one per output element."""
    total = 0.0
    for op in ops:
        if not op.outputs:
            continue
        out = op.outputs[0]
        if not out.shape.is_fully_defined() or not out.dtype.is_floating:
            continue
        n = out.shape.num_elements()
        if op.type in ("Conv2D", "Conv3D", "DepthwiseConv2dNative") and len(op.inputs) > 1 \
                and op.inputs[1].shape.is_fully_defined():
            kernel = op.inputs[1].shape.as_list()
            per_out = math.prod(kernel[:-1]) if op.type != "DepthwiseConv2dNative" else math.prod(kernel[:2])
            total += 2.0 * n * per_out
        elif op.type in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3") \
                and op.inputs[0].shape.is_fully_defined():
            shape = op.inputs[0].shape.as_list()
            transposed = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
            total += 2.0 * n * (shape[-2] if transposed else shape[-1])
        elif op.type == "Einsum" and op.inputs[0].shape.is_fully_defined():
            inner = max(1, op.inputs[0].shape.num_elements() // max(1, n))
            total += 2.0 * n * max(1, inner)
        else:
            total += n
    return total


def section_step(blocks, split: list, borders: list):
    """Consecutive blocks' training run as a section's (``h``, the batch, a snapshot of the blocks' state, and the
    gradient arriving at the output, or None for a unit gradient made inside): the forward from the snapshot, then
    the backward. Each trace appends the index of its first backward op to ``split`` and its border tensors' names
    to ``borders``. Also the state variables, for the snapshot's specs."""
    state = [v for block in blocks for v in block.layer.non_trainable_variables]
    variables = [_first_component(v) for block in blocks for v in block.layer.trainable_variables]

    def train(h, batch, snapshot, upstream=None):
        with tf.GradientTape() as tape:
            xs = float_leaves(h)
            tape.watch(xs)
            with keras.StatelessScope(state_mapping=list(zip(state, snapshot))):
                out = h
                for block in blocks:
                    out = block(out, batch, training=True)
        split.append(len(tf.compat.v1.get_default_graph().get_operations()))
        ys = float_leaves(out)
        borders.append(([x.name for x in xs], [y.name for y in ys]))
        if ys and (xs or variables):
            grads = [tf.ones_like(y) for y in ys] if upstream is None else list(upstream)
            return tape.gradient(ys, xs + variables, output_gradients=grads)
        return []

    return train, state


def _trace(blocks, h_specs, batch_specs, lean, out_specs=None):
    """Consecutive blocks' forward and backward traced at the specs' batch, as one section's training run: the
    graph, the index of its first backward op, and the names of its input and output border tensors.
    ``out_specs``: the output border's specs, whose gradient then arrives as an input, as it does in the engine,
    where the caller holds it through the whole backward (no kernel can write into it); None (the loss's block):
    a unit gradient made inside."""
    split, borders = [], []
    train, state = section_step(blocks, split, borders)
    snapshot = [tf.TensorSpec(v.shape, v.dtype) for v in state]
    upstream = None if out_specs is None else float_leaves(out_specs)
    with lean_scope(lean):
        graph = tf.function(train).get_concrete_function(h_specs, batch_specs, snapshot, upstream).graph
    return graph, split[0], borders[0]


def batch_specs(small: dict, real: int) -> dict:
    """The batch's TensorSpecs at the real batch size, from a slice of it."""
    return {k: tf.TensorSpec([real] + list(v.shape[1:]), v.dtype) for k, v in small.items()}


def static_blocks(network, borders, lean, work=None) -> list[BlockProfile]:
    """Every block's ``BlockProfile`` counted from its trace at the real batch (``borders``: the network's border
    specs at the real batch and a slice of the batch). ``forward_seconds`` holds forward work in ``GFLOP``
    units (the planner compares re-runs by it; no clock is read). ``work``: kernels' measured work buffers per op
    (``workspace.Workspaces``; None: not counted)."""
    real = borders.real_batch
    fields = batch_specs(borders.probe_slice, real)
    profiles = []
    output_read = 0  # of the previous block's output border, what its own backward reads (counted in its kept)
    for j, block in enumerate(network.blocks):
        h = borders.specs_before(j)
        last = j == len(network.blocks) - 1
        # The upstream gradient is an input (the caller's, which the planner counts as held): not in the peak.
        graph, split, (inputs, outputs) = _trace([block], h, fields, lean, None if last else borders.output_specs[j])
        memory = graph_memory(graph, split, work)
        out = nbytes(borders.output_specs[j])
        peak = memory.peak
        kept = min(memory.kept, peak)
        # Inside a section, the border before this block is an activation like any other: held through the
        # backward where this block's backward reads it and the block before did not already keep it. When the
        # block starts a section that border is the section's input, held by the caller (``entry_bytes``).
        entry = max(read_after(graph, inputs, split) - output_read, 0) if j else 0
        output_read = read_after(graph, outputs, split)
        flops = forward_flops(graph.get_operations()[:split]) / GFLOP
        profiles.append(BlockProfile(name=block.name, output_bytes=out, kept_bytes=kept + entry,
                                     transient_bytes=max(peak - kept, 0), forward_seconds=flops,
                                     stored_bytes=kept + entry, entry_bytes=entry))
    return profiles


def count_span(network, borders, s: int, t: int, lean, work=None) -> int:
    """The activation bytes of blocks ``s .. t-1`` run as one section, counted from that section's own trace at the
    real batch (what the planner's ``_Chain`` composes from the blocks' figures): the most its forward and backward
    hold beside its input border and its output's gradient, kernels' work buffers included where ``work`` measures
    them. Lean gradients that reach across blocks (a batch norm re-making its input from the convolution before it)
    are seen only here."""
    out_specs = None if t == len(network.blocks) else borders.output_specs[t - 1]
    graph, split, _ = _trace(network.blocks[s:t], borders.specs_before(s),
                             batch_specs(borders.probe_slice, borders.real_batch), lean, out_specs)
    return graph_memory(graph, split, work).peak


def input_specs_at(borders, block: int):
    """Block ``block``'s input specs at the real batch."""
    return specs_at(borders.specs_before(block), borders.real_batch)
