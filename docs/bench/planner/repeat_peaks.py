"""One plan's step peak over many steps: does the first step (what a dry step measures) read what later steps hold?

    .venv/bin/python docs/bench/planner/repeat_peaks.py --sections 4 --steps 60
    .venv/bin/python docs/bench/planner/repeat_peaks.py --sections 4 --steps 60 --load 2   # two busy processes beside

A keras.applications model (random weights, synthetic data) trained by the ``Engine`` with a fixed plan, in a
child process on TensorFlow's BFC allocator (oneDNN off, one inter-op thread: as the runner runs under a device
limit); each step's peak (MiB) and each section's are printed, then the first step against the later ones.
``--load K`` runs K busy-looping processes for the child's whole life (a machine shared with other work).
``--gc-between`` collects Python's garbage before each step with the collector otherwise off (rules Python's
collector out as the source of a change). ``--dry N`` runs N dry steps of the plan first (as planning measures
a plan) and prints their readings beside the steps'. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def child(args) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from sections.allocator import configure

    configure()
    import gc

    import keras
    import numpy as np
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    if args.intra:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra)
    import sections

    keras.utils.set_random_seed(0)
    size = args.size
    model = getattr(keras.applications, args.model)(input_shape=(size, size, 3), weights=None, classes=10,
                                                    **({"alpha": args.alpha} if args.alpha else {}))
    xent = keras.losses.SparseCategoricalCrossentropy()
    network = sections.from_keras(model, loss=lambda out, b: xent(b["label"], out), inputs="image",
                                  loss_fields=["label"])
    engine = sections.Engine(network, keras.optimizers.Adam(1e-3), sections=args.sections, lean=not args.no_lean)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(args.batch, size, size, 3)).astype("float32"),
             "label": rng.integers(0, 10, args.batch).astype("int32")}
    if args.dry:
        from sections.step.engine import _as_tensors  # what planning hands its dry steps

        engine.build(batch)
        planned = engine.replicas.split(dict(_as_tensors(network, batch)))
    if args.executor:  # for the rest of the process: every dry step and step below
        tf.experimental.function_executor_type(args.executor).__enter__()
    for k in range(args.dry):
        dry = engine.dry_step(planned)
        print(json.dumps({"dry": k + 1, "peak": dry.peak / 2**20, "spread": dry.spread / 2**20}), flush=True)
    if args.gc_between:
        gc.disable()
    for step in range(args.steps):
        if args.gc_between:
            gc.collect()
        stats = engine.train_step(batch)
        print(json.dumps({"step": step + 1, "peak": stats["step_peak_bytes"] / 2**20,
                          "sections": [p / 2**20 for p in stats["peak_bytes"]]}), flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="MobileNetV2")
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--sections", type=int, default=4)
    parser.add_argument("--no-lean", action="store_true")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--load", type=int, default=0)
    parser.add_argument("--gc-between", action="store_true")
    parser.add_argument("--intra", type=int, default=0, help="intra-op threads (0: TensorFlow's default)")
    parser.add_argument("--dry", type=int, default=0, help="dry steps (as planning runs them) before training")
    parser.add_argument("--executor", default="", help="TensorFlow's executor for function calls (e.g. "
                        "SINGLE_THREADED_EXECUTOR; default: TensorFlow's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.child:
        return child(args)
    env = {**os.environ, "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8000",
           "TF_ENABLE_ONEDNN_OPTS": "0"}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, capture_output=True,
                              text=True, cwd=ROOT)
    finally:
        for p in busy:
            p.kill()
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    drys = [r for r in rows if "dry" in r]
    rows = [r for r in rows if "step" in r]
    if proc.returncode or not rows:
        sys.exit(f"the child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    peaks = [r["peak"] for r in rows]
    print(f"{args.model} alpha {args.alpha} {args.size}px batch {args.batch}, sections={args.sections}"
          f"{' lean off' if args.no_lean else ''}, load {args.load}{', gc between steps' if args.gc_between else ''}"
          f"{f', {args.intra} intra-op threads' if args.intra else ''}")
    if drys:
        print("dry steps (MiB, each the larger of its kept runs ± spread):",
              " ".join(f"{r['peak']:.1f}±{r['spread']:.1f}" for r in drys))
    print("step peaks (MiB):", " ".join(f"{p:.1f}" for p in peaks))
    later = peaks[1:]
    print(f"first step {peaks[0]:.1f} MiB; later steps: min {min(later):.1f}, median {statistics.median(later):.1f},"
          f" max {max(later):.1f} ({max(later) / peaks[0]:.3f}x the first); distinct readings (0.1 MiB): {len({round(p, 1) for p in peaks})}")


if __name__ == "__main__":
    main()
