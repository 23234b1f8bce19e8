"""The planner against whole-graph training, interleaved step by step in one process.

``whole`` runs first to measure its peak; then one ``sections="auto"`` engine per budget (a fraction of that
peak; each probes its blocks at the real batch and plans); then every engine steps in turn, round by round,
so CPU contention from other processes lands on all of them alike. Where nothing fits, the planner's one-line
answer is printed; ``smallest`` adds a job at the smallest budget that fits (the smallest reachable peak).
``--cuts`` adds ``tf.recompute_grad`` and the sectioned engine at fixed partitions; ``--out`` writes one
``metrics.json`` per job, for ``python -m runner.report DIR`` (its table and the frontier with the planner's
points).

    python docs/bench/planner/interleaved.py --batch 2048 --rounds 6 --budgets 0.25,0.30,0.45,0.60,0.90 \
        --cuts 4,13 --out outputs/bench/planner_2048
"""
import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from models import build_resnet
from sections import Engine, RecomputeGrad, WholeGraph

MiB = 2**20
CUTS = {2: ["scale1"], 4: ["scale1", "scale2", "final_pool"], 13: 13}


def resnet():
    return build_resnet(num_classes=10, input_shape=(28, 28, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--budgets", default="0.25,0.30,0.45,0.60,0.90")
    ap.add_argument("--no-smallest", action="store_true")
    ap.add_argument("--cuts", default="", help="fixed partitions to add, e.g. 4,13 (of 2, 4, 13)")
    ap.add_argument("--out", default="", help="a folder for one metrics.json per job")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batch = {"image": tf.constant(rng.random((args.batch, 28, 28, 1), dtype=np.float32)),
             "label": tf.constant(rng.integers(0, 10, args.batch), dtype=tf.int32)}
    whole = WholeGraph(resnet(), keras.optimizers.Adam(1e-3))
    whole_peak = max(whole.train_step(batch)["step_peak_bytes"] for _ in range(2))
    print(f"batch {args.batch}: whole peak {whole_peak / MiB:.0f} MiB (largest of 2 steps)")
    jobs, notes, smallest = [("whole", whole, None)], [], None
    for cut in [int(c) for c in args.cuts.split(",") if c]:
        for name, cls in (("recompute_grad", RecomputeGrad), ("sectioned", Engine)):
            jobs.append((f"{name} {cut}", cls(resnet(), keras.optimizers.Adam(1e-3), sections=CUTS[cut]), None))

    def add(label, budget):
        t = time.perf_counter()
        try:
            eng = Engine(resnet(), keras.optimizers.Adam(1e-3), sections="auto", memory_budget=int(budget))
            eng.build(batch)
        except ValueError as err:
            notes.append(f"{label}: {err}")
            return re.findall(r"\((\d+) bytes\)", str(err))[-1]
        notes.append(f"{label}: {eng.plan.summary()} (probe and plan {time.perf_counter() - t:.0f} s)")
        jobs.append((label, eng, int(budget)))
        return None

    for frac in [float(f) for f in args.budgets.split(",")]:
        reach = add(f"auto {frac:.2f}", frac * whole_peak)
        if reach is not None:
            smallest = int(reach)
    if smallest is not None and not args.no_smallest:
        # 3% above the smallest budget that fits: each engine probes anew, and probes differ by a few MiB
        add(f"auto smallest ({smallest / whole_peak:.3f} reachable)", math.ceil(1.03 * smallest / 0.9))
    times = {label: [] for label, *_ in jobs}
    peaks = {label: [] for label, *_ in jobs}
    first = {}
    for r in range(args.rounds):
        for label, eng, _ in jobs:
            if r == 0 and eng.plan is not None:
                first[label] = eng.plan.predicted_peak
            t = time.perf_counter()
            stats = eng.train_step(batch)
            times[label].append(time.perf_counter() - t)
            peaks[label].append(stats["step_peak_bytes"])
    for note in notes:
        print(note)
    w = statistics.median(times["whole"][1:])
    print(f"\nrounds {args.rounds}; times: median of rounds 2..{args.rounds}; peaks: every round")
    print("| job | budget / whole | sections | forward runs | first prediction MiB | after re-plan MiB | "
          "largest peak MiB | peak / whole | within budget | median step s | time / whole |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, eng, budget in jobs:
        ts, ps = times[label][1:], peaks[label]
        m, top = statistics.median(ts), max(ps)
        if budget is None:
            print(f"| {label} | - | {len(eng.sections)} | - | - | - | {top / MiB:.0f} | {top / whole_peak:.3f} | - | "
                  f"{m:.3f} | {m / w:.3f} |")
            continue
        replanned = f"{eng.plan.predicted_peak / MiB:.0f}" if eng.replans else "(none)"
        print(f"| {label} | {budget / whole_peak:.3f} | {len(eng.sections)} | {eng.plan.forward_runs} | "
              f"{first[label] / MiB:.0f} | {replanned} | {top / MiB:.0f} | {top / whole_peak:.3f} | "
              f"{'yes' if top <= budget else 'NO'} | {m:.3f} | {m / w:.3f} |")
    print("\nper-step peaks MiB:")
    for label, *_ in jobs:
        print(f"  {label}: {[round(p / MiB) for p in peaks[label]]}")
    for label, eng, _ in jobs:
        if getattr(eng, "replans", None):
            print(f"  {label} re-plan: {eng.replans[0]}")
    if args.out:
        for i, (label, eng, budget) in enumerate(jobs):
            write_metrics(Path(args.out) / str(i), eng, budget, args.batch, statistics.median(times[label][1:]),
                          max(peaks[label]))


def write_metrics(folder: Path, eng, budget, batch: int, seconds: float, peak: int) -> None:
    """What ``runner.report`` reads from a run's metrics.json."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"strategy": eng.strategy, "batch": batch, "median_step_seconds": seconds, "step_peak_bytes": peak,
              "num_sections": len(eng.sections), "section_blocks": [s.stop - s.start for s in eng.sections],
              "policies": [s.policy for s in eng.sections], "memory_budget_bytes": budget,
              "predicted_peak_bytes": eng.plan.predicted_peak if eng.plan is not None else None}
    (folder / "metrics.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
