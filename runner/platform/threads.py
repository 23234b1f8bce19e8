"""TensorFlow's inter-op thread pool: set once per process, before its runtime starts."""

from __future__ import annotations

from runner.errors import ConfigError

# Trained as users run them: tf.recompute_grad's re-run is not gated on the gradient arriving, and on one thread the
# executor may run it early (13 sections of the notebook ResNet at batch 2048: 0.72 of whole's peak against 0.41).
BASELINES = ("sections.WholeGraph", "sections.RecomputeGrad")


def resolve_inter_op_threads(value, engine_target: str) -> int | None:
    """``auto``: 1 for the sectioned engine, TensorFlow's default (None) for the baselines; else ``value``."""
    if value != "auto":
        return value
    return None if engine_target in BASELINES else 1


def set_inter_op_threads(value, engine_target: str = "") -> int:
    """Run independent ops on ``value`` threads (None: TensorFlow's default, one per core; ``auto``:
    ``resolve_inter_op_threads``); returns the count in effect (0: TensorFlow's default).

    With one thread the executor runs a compiled function's ready ops in one order every step, so a step's
    peak memory repeats within a process (which order a process settles on can differ); with more, which of
    two ready ops runs first varies, and a backward's peak can move by one activation between identical steps
    (BENCHMARKS.md). Convolutions and matmuls still use every core (the intra-op pool). A process sets it once:
    a different number later raises, except under ``auto``, which keeps what the process already runs.
    """
    import tensorflow as tf

    auto = value == "auto"
    value = resolve_inter_op_threads(value, engine_target)
    current = tf.config.threading.get_inter_op_parallelism_threads()
    if value is None or current == value:
        return current
    try:
        tf.config.threading.set_inter_op_parallelism_threads(value)
    except RuntimeError:
        if auto:
            return current
        raise ConfigError("train.inter_op_threads", value,
                          f"TensorFlow already started in this process with "
                          f"{current if current else 'its default'} inter-op thread(s), and a process sets it once: "
                          f"give every job of a sweep the same value, or run each job in its own process "
                          f"(hydra/launcher=joblib or submitit_local)") from None
    return value
