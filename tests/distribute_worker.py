"""Run by tests/test_distribute_config.py in a fresh process: make the strategy, all-reduce once, print what it saw.

    python tests/distribute_worker.py '<distribute overrides as JSON>' BATCH ['<overrides for a second strategy>']
    FAKE_WORKER_DIES=1 ...   # exit right after making the strategy (the others' all-reduce must then fail)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omegaconf import OmegaConf  # noqa: E402

from runner.config.schema import Config  # noqa: E402
from runner.platform import distribute  # noqa: E402


def config(overrides: str, batch: str):
    return OmegaConf.merge(OmegaConf.structured(Config), {"distribute": json.loads(overrides), "batch": int(batch)})


def main(overrides: str, batch: str, then: str | None = None) -> None:
    cfg = config(overrides, batch)
    strategy = distribute.make_strategy(cfg)
    import tensorflow as tf

    if os.environ.get("FAKE_WORKER_DIES"):
        os._exit(0)
    if os.environ.get("FAKE_WORKER_WAITS"):
        time.sleep(float(os.environ["FAKE_WORKER_WAITS"]))  # until the other worker is gone
    total = None
    if strategy is not None:  # every replica adds its id + 1 (ids run over all workers): the sum needs them all
        value = strategy.run(tf.function(
            lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32)))
        total = float(strategy.reduce(tf.distribute.ReduceOp.SUM, value, axis=None))
    task = distribute.task(cfg)
    print(json.dumps({**distribute.summary(strategy), "chief": distribute.is_chief(strategy),
                      "task_chief": task.is_chief if task else None, "sum": total}), flush=True)
    if then is not None:  # a second strategy in the same process, after TensorFlow initialized its devices
        try:
            again = distribute.make_strategy(config(then, batch))
            print(json.dumps({"replicas": distribute.replicas(again)}), flush=True)
        except distribute.RunnerError as err:
            print(json.dumps({"error": str(err)}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
