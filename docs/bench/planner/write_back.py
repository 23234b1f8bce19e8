"""How a dry step's write-back of the state changes the training steps after it (BENCHMARKS.md, "Dry steps that
leave the state where it was").

    .venv/bin/python docs/bench/planner/write_back.py                       # this code's write-back
    .venv/bin/python docs/bench/planner/write_back.py --way slices          # the old 1 MiB slice assignments
    .venv/bin/python docs/bench/planner/write_back.py --way none            # no write-back (state left changed)
    .venv/bin/python docs/bench/planner/write_back.py --way whole           # a plain assignment of a converted copy
    .venv/bin/python docs/bench/planner/write_back.py --dry 0               # no dry step before the steps

keras.applications ResNet50V2 (64 px, batch 64, random weights) with its least-memory plan (the planner's, no dry
step run to choose it), in a child process on TensorFlow's BFC allocator (limit 4000 MiB, oneDNN off): ``--dry``
dry steps, then three training steps; each dry step's and step's peak and the bytes in use after it (MiB).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _ways():
    import numpy as np
    import tensorflow as tf

    import sections.step.executor as executor

    def slices(variables, saved):  # the write-back before the nineteenth session
        for v, value in zip(variables, saved):
            target = v.value if isinstance(getattr(v, "value", None), tf.Variable) else v
            rows = max(1, 2**20 // max(1, value[0].nbytes)) if value.ndim else 0
            if not value.ndim or value.nbytes <= 2**20:
                v.assign(tf.convert_to_tensor(value, v.dtype))
                continue
            for a in range(0, value.shape[0], rows):
                target[a:a + rows].assign(tf.convert_to_tensor(np.ascontiguousarray(value[a:a + rows]), v.dtype))

    def whole(variables, saved):
        for v, value in zip(variables, saved):
            v.assign(tf.convert_to_tensor(value, v.dtype))

    return {"this": executor.write_back, "slices": slices, "whole": whole, "none": lambda variables, saved: None}


def child(args) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from sections.allocator import configure

    configure()
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    import sections.step.executor as executor
    from models.keras_app import build_keras_app
    from sections import Engine
    from sections.step.calibrate import Calibrator
    from sections.step.engine import _as_tensors

    executor.write_back = _ways()[args.way]
    mib = 2**20
    in_use = lambda: tf.config.experimental.get_memory_info("CPU:0")["current"] / mib  # noqa: E731
    batch = {"image": tf.random.uniform((64, 64, 64, 3)), "label": tf.range(64) % 10}
    keras.utils.set_random_seed(0)
    planner = Engine(build_keras_app("ResNet50V2", num_classes=10, input_shape=[64, 64, 3]),
                     keras.optimizers.Adam(1e-3), sections="auto")
    Calibrator.calibrate = lambda self, batch: None  # the planner's least-memory plan, not dry-run
    planner.build(batch)
    schedule = planner.calibrator._least_plan().schedule
    del planner
    gc.collect()
    keras.utils.set_random_seed(0)
    net = build_keras_app("ResNet50V2", num_classes=10, input_shape=[64, 64, 3])
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections=schedule)
    engine.build(batch)
    planned = engine.replicas.split(dict(_as_tensors(net, batch)))
    for _ in range(args.dry):
        peak = engine.dry_step(planned).peak / mib
        gc.collect()
        print(json.dumps({"dry": round(peak, 1), "in_use": round(in_use(), 1)}), flush=True)
    for _ in range(3):
        peak = engine.train_step(batch)["step_peak_bytes"] / mib
        gc.collect()
        print(json.dumps({"step": round(peak, 1), "in_use": round(in_use(), 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--way", choices=["this", "slices", "whole", "none"], default="this")
    parser.add_argument("--dry", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "4000",
           "TF_ENABLE_ONEDNN_OPTS": "0"}
    proc = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True,
                          text=True, cwd=ROOT)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not rows:
        sys.exit(f"the child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    print(f"write-back: {args.way}, {args.dry} dry steps")
    print("dry steps (MiB):", [r["dry"] for r in rows if "dry" in r])
    print("training steps (MiB):", [r["step"] for r in rows if "step" in r])
    print("in use after each (MiB):", [r["in_use"] for r in rows])


if __name__ == "__main__":
    main()
