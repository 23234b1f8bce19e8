"""What a plan's measured peak holds beyond what its tensors asked for, process by process: the allocator's slack.

    .venv/bin/python docs/bench/planner/slack.py --model resnet --device 341 --processes 3
    .venv/bin/python docs/bench/planner/slack.py --model mobilenetv2 --device 461 --processes 2 --steps 2

Each process (``TF_CPU_BFC_MEM_LIMIT_IN_MB=--device``, oneDNN off, as the runner sets under a limit) plans
``sections="auto"`` with no budget for the zoo's model and batch, then trains ``--steps`` steps, each under
TensorFlow's profiler. From the profile's allocator trace (``runner.record.peak``) each step prints the allocator
statistics' peak, the bytes the live tensors asked for at that moment (``requested``), and the slack: what their
chunks hold beyond it (a BFC allocator hands a request the whole free chunk it picked where that chunk is under
twice the request), with the places holding the most slack. Nothing is asserted (BENCHMARKS.md, "The same plan's
peak by process: the allocator's slack").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
MiB = 2**20


def worker(model: str, steps: int) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parents[2]))
    import zoo

    net, batch = zoo.image_model(model)
    import keras
    import tensorflow as tf

    from runner.record import peak
    from sections import Engine

    engine = Engine(net, keras.optimizers.Adam(1e-3), sections="auto")
    engine.build(batch)
    out = {"sections": engine.plan.schedule.num_sections,
           "dry": [(d["predicted"], d["measured"], d["ran_out"]) for d in engine.dry_runs], "steps": []}
    folder = Path(tempfile.mkdtemp(prefix="slack_"))
    try:
        for i in range(steps):
            where = folder / f"step{i}"
            tf.profiler.experimental.start(str(where))
            try:
                reading = engine.train_step(batch)
            finally:
                tf.profiler.experimental.stop()
            found = peak.read(where)
            held = [h for h in found.held if h.requested]
            top = sorted(held, key=lambda h: h.requested - h.nbytes)[:3]
            out["steps"].append({
                "statistics": reading["step_peak_bytes"], "trace": found.peak, "before": found.before,
                "requested": sum(h.requested for h in held), "slack": found.slack(),
                "most": [(h.place, h.nbytes, h.requested) for h in top]})
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out), flush=True)


def line(n: int, r: dict) -> str:
    dry = ", ".join(f"{p / MiB:.1f}->{'out' if o else f'{m / MiB:.1f}'}" for p, m, o in r["dry"])
    rows = [f"process {n}: {r['sections']} sections; dry steps predicted->measured MiB [{dry}]"]
    for i, s in enumerate(r["steps"]):
        most = ", ".join(f"{p} {b / MiB:.1f} for {q / MiB:.1f}" for p, b, q in s["most"])
        rows.append(f"  step {i + 1}: peak {s['statistics'] / MiB:.1f} MiB = before the step {s['before'] / MiB:.1f}"
                    f" + requested {s['requested'] / MiB:.1f} + slack {s['slack'] / MiB:.1f} "
                    f"({s['slack'] / max(1, s['requested']):.0%} of requested); most slack: {most}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet", help="a zoo image model (zoo.py's ZOO)")
    parser.add_argument("--device", type=int, default=341, help="the emulated device's MiB")
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args.model, args.steps)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(args.device))
    print(f"{args.model} on {args.device} MiB, {args.processes} processes", flush=True)
    for n in range(1, args.processes + 1):
        proc = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, capture_output=True,
                              text=True)
        found = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        print(line(n, json.loads(found[-1])) if found else f"process {n} failed: {proc.stderr[-600:]}", flush=True)


if __name__ == "__main__":
    main()
