"""The planner against whole-graph training, interleaved step by step in one process.

``whole`` runs first to measure its peak; then one ``sections="auto"`` engine per budget (a fraction of that
peak; each probes its blocks at the real batch and plans); then every engine steps in turn, round by round,
so CPU contention from other processes lands on all of them alike. Where nothing fits, the planner's one-line
answer is printed; ``smallest`` adds a job at the smallest budget that fits (the smallest reachable peak).

    python docs/bench/planner/interleaved.py --batch 2048 --rounds 6 --budgets 0.25,0.30,0.45,0.60,0.90
"""
import argparse
import math
import re
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from models import build_resnet
from sections import Engine, WholeGraph

MiB = 2**20


def resnet():
    return build_resnet(num_classes=10, input_shape=(28, 28, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--budgets", default="0.25,0.30,0.45,0.60,0.90")
    ap.add_argument("--no-smallest", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batch = {"image": tf.constant(rng.random((args.batch, 28, 28, 1), dtype=np.float32)),
             "label": tf.constant(rng.integers(0, 10, args.batch), dtype=tf.int32)}
    whole = WholeGraph(resnet(), keras.optimizers.Adam(1e-3))
    whole_peak = max(whole.train_step(batch)["step_peak_bytes"] for _ in range(2))
    print(f"batch {args.batch}: whole peak {whole_peak / MiB:.0f} MiB (largest of 2 steps)")
    jobs, notes, smallest = [("whole", whole, None)], [], None

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
            print(f"| {label} | - | 1 | [1] | - | - | {top / MiB:.0f} | 1.000 | - | {m:.3f} | 1.000 |")
            continue
        replanned = f"{eng.plan.predicted_peak / MiB:.0f}" if eng.replans else "(none)"
        print(f"| {label} | {budget / whole_peak:.3f} | {len(eng.sections)} | {eng.schedule and eng.plan.forward_runs} | "
              f"{first[label] / MiB:.0f} | {replanned} | {top / MiB:.0f} | {top / whole_peak:.3f} | "
              f"{'yes' if top <= budget else 'NO'} | {m:.3f} | {m / w:.3f} |")
    print("\nper-step peaks MiB:")
    for label, *_ in jobs:
        print(f"  {label}: {[round(p / MiB) for p in peaks[label]]}")
    for label, eng, _ in jobs:
        if eng.replans:
            print(f"  {label} re-plan: {eng.replans[0]}")


if __name__ == "__main__":
    main()
