"""Does a trainer's step equal an ordinary whole-graph step? Measured, then everything is put back."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ._precision import compute_dtype, loss_scale, tolerance, unscale
from ._replicas import scale_for_replicas


def compare_with_whole(engine, batch, examples: int | None = 64, rtol: float | None = None) -> dict:
    """Compute one step's gradients and state updates with ``engine`` and with one plain whole-graph tape, from
    the same state, and compare them.

    Gradients match when ``|g - g_whole| <= rtol * |g_whole|`` (norms per variable: summation order differs
    between graphs, so single elements that cancel to near zero carry relative noise); state (batch-norm
    statistics, seed generators) must match elementwise to ``rtol``. Non-finite values are never a match.
    ``examples`` slices the batch so the whole-graph step fits in memory (``None``: all of it). Model and
    optimizer state are restored afterwards. Under a strategy the whole-graph step runs under it too (with
    per-replica batch norm, one device's step is a different computation). ``rtol=None``: the rounding the network's compute dtype allows
    (1e-4 in float32; more under a mixed policy: ``sections._precision.TOLERANCE``, and a near-zero gradient
    is compared at the scale of the whole gradient: ``_noise_floor``). With a
    ``LossScaleOptimizer`` both sides differentiate the scaled loss and unscale, as a step does.

    Returns ``{"exact", "gradient_rel_error", "state_max_abs_diff", "worst_variable"}``.
    """
    batch = dict(batch)
    engine.build(batch)
    rtol = tolerance(engine.network) if rtol is None else rtol
    if examples is not None:
        examples -= examples % engine.replicas.count  # the replicas share it equally
        batch = tf.nest.map_structure(lambda t: t[:examples], batch)
    network = engine.network
    variables = network.variables + list(engine.optimizer.variables)
    saved = [v.numpy() for v in variables]

    def restore():
        for v, value in zip(variables, saved):
            v.assign(value)

    _, ours = engine.gradients(batch)
    our_state = [v.numpy() for v in network.non_trainable_variables]
    restore()
    theirs = unscale(_whole_gradients(network, batch, engine.replicas, _scaler(engine.optimizer)), engine.optimizer)
    their_state = [v.numpy() for v in network.non_trainable_variables]
    restore()

    exact, worst_rel, worst_name = True, 0.0, ""
    dense = [None if g is None else np.asarray(tf.convert_to_tensor(g), np.float64)  # sparse gradients densified
             for g in theirs]
    floor = _noise_floor(dense) if compute_dtype(network) != "float32" else lambda size: 0.0
    for v, a, b in zip(network.trainable_variables, ours, dense):
        if (a is None) != (b is None):
            exact, worst_rel, worst_name = False, float("inf"), v.path
            continue
        if a is None:
            continue
        a = np.asarray(tf.convert_to_tensor(a), np.float64)
        rel = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor(b.size), 1e-30))
        if not np.isfinite(rel) or not np.all(np.isfinite(a)) or not np.all(np.isfinite(b)):
            rel = float("inf")
        if rel > worst_rel or not worst_name:
            worst_rel, worst_name = rel, v.path
    exact = exact and worst_rel <= rtol
    state_diff = 0.0
    for v, a, b in zip(network.non_trainable_variables, our_state, their_state):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size:
            state_diff = max(state_diff, float(np.max(np.abs(a - b))))
        if not np.allclose(a, b, rtol=rtol, atol=1e-6) or not np.all(np.isfinite(a)):
            exact, worst_name = False, v.path
            state_diff = float("inf") if not np.all(np.isfinite(a)) else state_diff
    return {"exact": bool(exact), "gradient_rel_error": worst_rel, "state_max_abs_diff": state_diff,
            "worst_variable": worst_name}


def _noise_floor(grads):
    """Under a mixed policy, a variable's error is measured against at least its share of the whole gradient's
    norm (``|g| * sqrt(size / total size)``): a gradient that cancels to near zero (a bias before batch norm)
    holds only rounding noise, which a narrow type makes as large as the gradient itself."""
    present = [g for g in grads if g is not None]
    total = float(np.sqrt(sum(np.sum(g * g) for g in present)))
    count = max(1, sum(g.size for g in present))
    return lambda size: total * float(np.sqrt(size / count))


def _scaler(optimizer):
    """What a step differentiates: the loss times the optimizer's loss scale, if it has one."""
    scale = loss_scale(optimizer)

    def scaled(loss):
        return loss if scale is None else loss * tf.cast(scale, loss.dtype)

    return scaled


def _whole_gradients(network, batch, replicas, scale_loss):
    """One tape over the whole network; under a strategy, on each replica's share (loss over the replicas, as
    the engine's), the replicas' gradients summed."""

    def grads(batch):
        with tf.GradientTape() as tape:
            loss = scale_loss(scale_for_replicas(network.loss(network.forward(batch, training=True), batch)))
        return tape.gradient(loss, network.trainable_variables)

    return [replicas.sum(g) for g in tf.function(replicas.wrap(grads))(replicas.split(batch))]
