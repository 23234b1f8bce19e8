"""Interleaved timing: whole, recompute_grad and sectioned at the same partitions, one step of each in turn.

Every strategy has its own copy of the notebook ResNet (same seed) and Adam; steps alternate between strategies
round by round in one process, so CPU contention from other processes lands on all of them alike.

    python docs/bench/gap/interleaved.py --batch 2048 --rounds 6 --cuts 4,13
"""
import argparse
import statistics
import time

import keras
import numpy as np
import tensorflow as tf

from models import build_resnet
from sections import Engine, RecomputeGrad, WholeGraph

CUTS = {1: 1, 2: ["scale1"], 4: ["scale1", "scale2", "final_pool"], 13: 13}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--cuts", default="4,13")
    ap.add_argument("--only", default="whole,recompute_grad,sectioned,one_graph")
    ap.add_argument("--v1", default="", help="a folder holding engine v1 as package sections_v1 (git archive "
                    "e3ea5ef sections, renamed): adds sectioned_v1 jobs")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    batch = {"image": tf.constant(rng.random((args.batch, 28, 28, 1), dtype=np.float32)),
             "label": tf.constant(rng.integers(0, 10, args.batch), dtype=tf.int32)}
    kinds = {"whole": WholeGraph, "recompute_grad": RecomputeGrad, "sectioned": Engine,
             "one_graph": lambda *a, **k: Engine(*a, one_graph=True, **k)}
    jobs = []
    for cut in [int(c) for c in args.cuts.split(",")]:
        for name in args.only.split(","):
            if name == "whole" and jobs and jobs[0][0] == "whole":
                continue
            net = build_resnet(num_classes=10, input_shape=(28, 28, 1))
            eng = kinds[name](net, keras.optimizers.Adam(1e-3), sections=CUTS[cut] if name != "whole" else 1)
            jobs.append((name if name == "whole" else f"{name}_{cut}", eng))
        if args.v1:
            import sys
            sys.path.insert(0, args.v1)
            import sections_v1
            net = build_resnet(num_classes=10, input_shape=(28, 28, 1))
            net1 = sections_v1.Network([(b.name, b.layer, b.fields) if b.fields else (b.name, b.layer)
                                        for b in net.blocks], loss=net.loss, inputs=net.inputs,
                                       loss_fields=net.loss_fields)
            jobs.append((f"sectioned_v1_{cut}", sections_v1.Engine(net1, keras.optimizers.Adam(1e-3),
                                                                   sections=CUTS[cut])))
    times = {n: [] for n, _ in jobs}
    peaks = {n: [] for n, _ in jobs}
    for r in range(args.rounds):
        for name, eng in jobs:
            t = time.perf_counter()
            stats = eng.train_step(batch)
            times[name].append(time.perf_counter() - t)
            peaks[name].append(stats["step_peak_bytes"])
    w = statistics.median(times["whole"][1:])
    wp = max(peaks["whole"][1:])
    print(f"batch {args.batch}, rounds {args.rounds} (median of rounds 2..{args.rounds})")
    print("| job | median step s | min..max s | time / whole | peak MiB (max) | median-step peak MiB | peak / whole |")
    print("|---|---|---|---|---|---|---|")
    for name, _ in jobs:
        ts, ps = times[name][1:], peaks[name][1:]
        m = statistics.median(ts)
        print(f"| {name} | {m:.3f} | {min(ts):.2f}..{max(ts):.2f} | {m / w:.3f} | {max(ps) / 2**20:.0f} | "
              f"{statistics.median(ps) / 2**20:.0f} | {max(ps) / wp:.3f} |")
    print("per-step peaks MiB (rounds 2..):")
    for name, _ in jobs:
        print(f"  {name}: {[round(p / 2**20) for p in peaks[name][1:]]}")


if __name__ == "__main__":
    main()
