"""Does a trainer's step equal an ordinary whole-graph step? Measured, then everything is put back.

Two graphs of the same step round differently (kernels, fusions, summation order), and some models amplify
rounding enormously: keras.applications ResNet50 at initialisation changes its float32 gradient by 1.6% when
every input is moved by one part in 10**7, and its own eager and compiled steps differ by 1.9%; in float64 a
sectioned step of it equals the whole one to 4e-14. A fixed tolerance therefore either calls such steps
inexact or lets real errors through on well-conditioned models. The check measures the whole step's own
sensitivity to rounding (its gradient again after moving every weight by one unit of rounding) and compares the
trainer's distance against the larger of that and the dtype's tolerance.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..backend.device import OutOfMemory
from ..backend.precision import ROUNDING, compute_dtype, loss_scale, tolerance, unscale
from ..backend.replicas import scale_for_replicas
from ..step import accumulate

# A trainer's error may reach this multiple of the whole step's own rounding sensitivity: the sensitivity is
# measured with one random perturbation of rounding size, a trainer's graph rounds differently at many ops.
SENSITIVITY_FACTOR = 3.0


def compare_with_whole(engine, batch, examples: int | None = 64, rtol: float | None = None) -> dict:
    """Compute one step's gradients and state updates with ``engine`` and with one plain whole-graph tape, from
    the same state, and compare them.

    Gradients are compared as one vector (all variables concatenated): ``|g - g_whole| / |g_whole|`` must be at
    most the tolerance, which is the larger of ``rtol`` (default: the rounding the network's compute dtype
    allows, ``sections.backend.precision.TOLERANCE``) and ``SENSITIVITY_FACTOR`` times the whole step's own
    sensitivity (the relative change of its gradient when every weight moves by one unit of rounding).
    ``worst_variable`` names the variable with the largest error relative to its own norm, counting a
    variable's norm as at least its share of the whole gradient's (a bias before batch norm, whose true
    gradient is zero, holds only rounding noise). State (batch-norm statistics, seed generators) must match
    elementwise. Non-finite values are never a match. ``examples`` slices the batch so the whole-graph step
    fits in memory (``None``: all of it); where the device has no memory for either step, ``OutOfMemory`` is
    raised with the state restored. Model and optimizer state are restored afterwards. Under a strategy
    the whole-graph step runs under it too. With a ``LossScaleOptimizer`` both sides differentiate the scaled
    loss and unscale, as a step does.

    A ``MicroBatched`` trainer (gradient accumulation) is compared like with like: the examples are cut into as
    many micro-batches as its steps cut a batch into (at most half as many as there are examples), its summed
    gradients are compared with the whole-graph step's over the same micro-batches, summed by the same shares in
    float64, and the state after them (batch-norm statistics update once per micro-batch on both sides). The
    report then also has ``micro_batches`` and ``one_step_rel_error``: the distance of the summed gradients from
    one whole-graph step over all the examples (within rounding only for a model without batch statistics).

    Returns ``{"exact", "gradient_rel_error", "tolerance", "sensitivity", "state_max_abs_diff",
    "worst_variable"}``.
    """
    batch = dict(batch)
    engine.build(batch)
    micro = getattr(engine, "micro_batch", None)
    runs = accumulate.count(_rows(batch), micro) if micro else 1
    dtype = compute_dtype(engine.network)
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

    sizes = accumulate.micro_sizes(_rows(batch), -(-_rows(batch) // min(runs, max(1, _rows(batch) // 2))))
    try:
        _, ours = engine.gradients(batch, sizes) if micro else engine.gradients(batch)
        ours = _dense(ours)
        our_state = [v.numpy() for v in network.non_trainable_variables]
        restore()
        one_step = _whole_gradients(network, engine.replicas, _scaler(engine.optimizer))

        def whole(batch):  # over the same micro-batches, summed by their shares (one call without micro-batches)
            if not micro:
                return _dense(unscale(one_step(batch), engine.optimizer))
            parts = accumulate.split(batch, sizes)
            summed = None
            for part, share in zip(parts, accumulate.weights(sizes)):
                grads = _dense(unscale(one_step(part), engine.optimizer))
                summed = [None if g is None else share * g if s is None else s + share * g
                          for s, g in zip(summed or [None] * len(grads), grads)]
            return summed

        theirs = whole(batch)
        their_state = [v.numpy() for v in network.non_trainable_variables]
        restore()
        _perturb(network.trainable_variables, ROUNDING.get(dtype, ROUNDING["float32"]))
        nudged = whole(batch)
        restore()
        single = _dense(unscale(one_step(batch), engine.optimizer)) if micro else None
        restore()
    except tf.errors.ResourceExhaustedError as err:  # the whole step (or the trainer's) at this many examples
        failed = OutOfMemory.from_error(err, engine.meter, engine.device_memory)
        del err
        restore()
        engine.read_counters()
        raise failed from None

    missing = [v.path for v, a, b in zip(network.trainable_variables, ours, theirs) if (a is None) != (b is None)]
    error = float("inf") if missing else _distance(ours, theirs)
    sensitivity = _distance(nudged, theirs)
    allowed = max(rtol, SENSITIVITY_FACTOR * sensitivity) if np.isfinite(sensitivity) else rtol
    worst_name = missing[0] if missing else _worst(network.trainable_variables, ours, theirs)
    exact = bool(np.isfinite(error) and error <= allowed)
    state_diff = 0.0
    for v, a, b in zip(network.non_trainable_variables, our_state, their_state):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size:
            state_diff = max(state_diff, float(np.max(np.abs(a - b))))
        if not np.allclose(a, b, rtol=max(rtol, 1e-4), atol=1e-6) or not np.all(np.isfinite(a)):
            exact, worst_name = False, v.path
            state_diff = float("inf") if not np.all(np.isfinite(a)) else state_diff
    report = {"exact": exact, "gradient_rel_error": error, "tolerance": float(allowed),
              "sensitivity": sensitivity, "state_max_abs_diff": state_diff, "worst_variable": worst_name}
    if micro:
        report.update(micro_batches=len(sizes), one_step_rel_error=float("inf") if missing else
                      _distance(ours, single))
    return report


def _rows(batch) -> int:
    return int(tf.nest.flatten(next(iter(batch.values())))[0].shape[0])


def _dense(grads) -> list:
    """float64 arrays (sparse gradients densified), ``None`` kept."""
    return [None if g is None else np.asarray(tf.convert_to_tensor(g), np.float64) for g in grads]


def _distance(a: list, b: list) -> float:
    """``|a - b| / |b|`` over every present gradient as one vector; inf when anything is not finite."""
    pairs = [(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    if not all(np.all(np.isfinite(x)) and np.all(np.isfinite(y)) for x, y in pairs):
        return float("inf")
    diff = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in pairs))
    norm = np.sqrt(sum(np.sum(y * y) for _, y in pairs))
    return float(diff / max(norm, 1e-30))


def _worst(variables, ours, theirs) -> str:
    """The variable with the largest error against its norm, or its share of the whole gradient's norm if that
    is larger (a gradient that cancels to near zero holds only rounding noise)."""
    present = [g for g in theirs if g is not None]
    total = float(np.sqrt(sum(np.sum(g * g) for g in present)))
    count = max(1, sum(g.size for g in present))
    worst, name = -1.0, ""
    for v, a, b in zip(variables, ours, theirs):
        if a is None or b is None:
            continue
        floor = max(float(np.linalg.norm(b)), total * float(np.sqrt(b.size / count)), 1e-30)
        rel = float(np.linalg.norm(a - b)) / floor
        rel = rel if np.isfinite(rel) else float("inf")
        if rel > worst:
            worst, name = rel, v.path
    return name


def _perturb(variables, unit: float, seed: int = 0) -> None:
    """Move every floating-point weight by one unit of rounding, up or down at random."""
    rng = np.random.default_rng(seed)
    for v in variables:
        value = v.numpy()
        if np.issubdtype(value.dtype, np.floating):
            sign = rng.choice(np.array([-1.0, 1.0], value.dtype), size=value.shape)
            v.assign(value * (1 + unit * sign))


def _scaler(optimizer):
    """What a step differentiates: the loss times the optimizer's loss scale, if it has one."""
    scale = loss_scale(optimizer)

    def scaled(loss):
        return loss if scale is None else loss * tf.cast(scale, loss.dtype)

    return scaled


def _whole_gradients(network, replicas, scale_loss):
    """One tape over the whole network, compiled once; under a strategy, on each replica's share (loss over the
    replicas, as the engine's), the replicas' gradients summed."""

    def grads(batch):
        with tf.GradientTape() as tape:
            loss = scale_loss(scale_for_replicas(network.loss(network.forward(batch, training=True), batch)))
        return tape.gradient(loss, network.trainable_variables)

    compiled = tf.function(replicas.wrap(grads))
    return lambda batch: [replicas.sum(g) for g in compiled(replicas.split(batch))]
