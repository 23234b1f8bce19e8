"""Each ResNet block's probe figures at a batch (what the planner reads), the plan for a budget, and 3 steps.

The per-block figures quoted in BENCHMARKS.md (a scale0 block: 384 MiB kept by its compiled backward plus 294
MiB transient, 994 MiB kept by a tape for `store`, at batch 2048) come from this script:

    PYTHONPATH=. python docs/bench/planner/profile_blocks.py --batch 2048 --budget 1264MiB
"""
import argparse
import time

import keras
import numpy as np

from models import build_resnet
from sections import Engine

MiB = 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--budget", default="1264MiB")
    ap.add_argument("--probe-batch", type=int, default=None, help="default: the real batch")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(args.batch, 28, 28, 1)).astype("float32"),
             "label": rng.integers(0, 10, args.batch).astype("int32")}
    engine = Engine(build_resnet(num_classes=10, input_shape=(28, 28, 1)), keras.optimizers.Adam(1e-3),
                    sections="auto", memory_budget=args.budget, probe_batch=args.probe_batch)
    t = time.perf_counter()
    engine.build(batch)
    print(f"build (probe and plan) {time.perf_counter() - t:.1f} s")
    print("| block | output MiB | kept MiB | transient MiB | stored (tape) MiB | forward s |\n|---|---|---|---|---|---|")
    for p in engine.profiles:
        print(f"| {p.name} | {p.output_bytes / MiB:.1f} | {p.kept_bytes / MiB:.1f} | {p.transient_bytes / MiB:.1f} | "
              f"{p.stored_bytes / MiB:.1f} | {p.forward_seconds:.3f} |")
    print(engine.plan.summary())
    for i in range(3):
        stats = engine.train_step(batch)
        print(f"step {i}: peak {stats['step_peak_bytes'] / MiB:.0f} MiB, per section "
              f"{[round(b / MiB) for b in stats['peak_bytes']]}")
    for line in engine.replans:
        print(line)


if __name__ == "__main__":
    main()
