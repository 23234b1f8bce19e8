"""TensorFlow's inter-op thread pool: set once per process, before its runtime starts."""

from __future__ import annotations

from runner.errors import ConfigError


def set_inter_op_threads(value: int | None) -> None:
    """Run independent ops on ``value`` threads (None: TensorFlow's default, one per core).

    With one thread the executor runs a compiled function's ready ops in one order every step, so a step's
    peak memory repeats within a process (which order a process settles on can differ); with more, which of
    two ready ops runs first varies, and a backward's peak can move by one activation between identical steps
    (BENCHMARKS.md). Convolutions and matmuls still use every core (the intra-op pool).
    """
    if value is None:
        return
    import tensorflow as tf

    current = tf.config.threading.get_inter_op_parallelism_threads()
    if current == value:
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(value)
    except RuntimeError:
        raise ConfigError("train.inter_op_threads", value,
                          f"TensorFlow already started in this process with "
                          f"{current if current else 'its default'} inter-op thread(s), and a process sets it once: "
                          f"give every job of a sweep the same value, or run each job in its own process "
                          f"(hydra/launcher=joblib or submitit_local)") from None
