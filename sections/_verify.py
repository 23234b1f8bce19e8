"""Does an engine's step equal one ordinary whole-graph step? Measured, then everything is put back."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ._peers import PeerStep


def compare_with_whole(engine, batch, examples: int | None = 64, rtol: float = 1e-4, atol: float = 1e-5) -> dict:
    """Run one engine step and one whole-graph step from the same state and compare every variable.

    ``examples`` slices the batch so the whole-graph step fits in memory (``None`` uses it all). Model and
    optimizer state are restored afterwards, so training continues as if nothing had happened.

    Returns ``{"exact": bool, "max_abs_diff": float, "worst_variable": str}``.
    """
    batch = dict(batch)
    engine.build(batch)
    if examples is not None:
        batch = tf.nest.map_structure(lambda t: t[:examples], batch)
    variables = engine.network.variables + list(engine.optimizer.variables)
    saved = [v.numpy() for v in variables]

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)

    engine.train_step(batch)
    ours = [v.numpy() for v in engine.network.variables]
    restore()
    counters = [tf.Variable(0, dtype=tf.int64, trainable=False) for _ in engine.sections]
    PeerStep(engine.network, engine.optimizer, engine.sections, counters, "whole", engine.jit_compile)(batch)
    theirs = [v.numpy() for v in engine.network.variables]
    restore()

    exact, worst, worst_name = True, 0.0, ""
    for v, a, b in zip(engine.network.variables, ours, theirs):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        if diff > worst:
            worst, worst_name = diff, v.path
        if not np.allclose(a, b, rtol=rtol, atol=atol):
            exact = False
    return {"exact": exact, "max_abs_diff": worst, "worst_variable": worst_name}
