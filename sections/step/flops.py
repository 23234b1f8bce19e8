"""Forward and backward FLOPs of each section, from TensorFlow's own cost analysis of its compiled code."""

from __future__ import annotations

import tensorflow as tf

from ..backend.profile import specs_at
from ..backend.structure import float_leaves
from .section_functions import Borders, Compiled


def _graph_flops(graph) -> int:
    opts = tf.compat.v1.profiler.ProfileOptionBuilder(
        tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()).with_empty_output().build()
    return int(tf.compat.v1.profiler.profile(graph=graph, options=opts).total_float_ops)


def section_flops(compiled: Compiled, borders: Borders) -> list[dict]:
    """``[{"forward": int, "backward": int}]`` per section at the real batch: each section's compiled forward and
    re-run backward (or fused last section) traced on the probe slice with static shapes and counted by
    ``tf.compat.v1.profiler`` (FLOPs scale linearly with the batch). ``backward`` excludes the re-run forward."""
    small, real = borders.probe_slice, borders.real_batch
    pb = int(tf.nest.flatten(small)[0].shape[0])  # every field sliced alike
    last = len(compiled.sections) - 1
    rows = []
    for sec, fns, fields in zip(compiled.sections, compiled.functions, compiled.fields):
        h = specs_at(sec.input_specs, pb)
        view = {k: tf.TensorSpec(small[k].shape, small[k].dtype) for k in fields}
        forward = _graph_flops(tf.function(fns.first_body).get_concrete_function(h, view).graph)
        if sec.index == last:
            total = _graph_flops(tf.function(fns.fused_body).get_concrete_function(h, view).graph)
        else:
            out = specs_at(borders.output_specs[sec.stop - 1], pb)
            upstream = [tf.TensorSpec(t.shape, t.dtype) for t in float_leaves(out)]
            snapshot = [tf.TensorSpec(v.shape, v.dtype) for v in sec.state_variables]
            fn = tf.function(lambda h, b, u, s: fns.rerun_backward_body(h, b, u, s, None))
            total = _graph_flops(fn.get_concrete_function(h, view, upstream, snapshot).graph)
        rows.append({"forward": forward * real // pb, "backward": max(0, total - forward) * real // pb})
    return rows
