"""Lean gradients (``Engine(lean=True)``) against Keras's own (``lean=False``), interleaved step by step.

One process holds ``whole`` (a plain GradientTape step) and, at each partition, the sectioned engine with lean
gradients off and on; every engine steps in turn, round by round, so CPU contention lands on all alike. Printed
per job: the step's peak (largest of all rounds), the largest section's backward peak, and the median step time
(rounds 2..), each also as a ratio to ``whole`` and lean on to lean off. Peaks are the job's own: what the step
added to the memory resident before it (other jobs' weights and optimizer slots), plus its own weights and slots.
``--model resnet``: the notebook ResNet (28x28x1); ``--model ResNet50`` (or any keras.applications name): built
for 96x96x3, ``weights=None``, cut by ``from_keras``. ``--budgets`` adds ``sections="auto"`` at fractions of
whole's peak, lean off and on.

    PYTHONPATH=. python docs/bench/lean/lean.py --model resnet --batch 1024 --cuts 4,13 --rounds 4
    PYTHONPATH=. python docs/bench/lean/lean.py --model ResNet50 --batch 48 --cuts 4,13 --rounds 4
"""
import argparse
import statistics
import time

import sections.allocator

sections.allocator.configure()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from models import build_resnet  # noqa: E402
from models.keras_app import build_keras_app  # noqa: E402
from sections import Engine, WholeGraph  # noqa: E402
from sections.backend.lean import gradient_traces  # noqa: E402

MiB = 2**20
RESNET_CUTS = {2: ["scale1"], 4: ["scale1", "scale2", "final_pool"]}


def network(model: str):
    keras.utils.set_random_seed(0)
    if model == "resnet":
        return build_resnet(num_classes=10, input_shape=(28, 28, 1))
    return build_keras_app(model, num_classes=10, input_shape=(96, 96, 3))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cuts", default="4,13", help="section counts (ints) to compare lean off/on at")
    ap.add_argument("--budgets", default="", help="fractions of whole's peak for sections=auto, e.g. 0.45")
    ap.add_argument("--precision", default="float32", help="a Keras dtype policy, e.g. mixed_bfloat16")
    args = ap.parse_args()
    keras.config.set_dtype_policy(args.precision)
    rng = np.random.default_rng(0)
    shape = (28, 28, 1) if args.model == "resnet" else (96, 96, 3)
    batch = {"image": tf.constant(rng.random((args.batch, *shape), dtype=np.float32)),
             "label": tf.constant(rng.integers(0, 10, args.batch), dtype=tf.int32)}
    whole = WholeGraph(network(args.model), keras.optimizers.Adam(1e-3))
    whole_peak = max(whole.train_step(batch)["step_peak_bytes"] for _ in range(2))  # alone in the process yet
    print(f"{args.model} batch {args.batch} {args.precision}: whole peak {whole_peak / MiB:.0f} MiB (largest of its "
          f"first 2 steps; budgets are fractions of it)")
    jobs = [("whole", whole)]
    for cut in [int(c) for c in args.cuts.split(",") if c]:
        where = RESNET_CUTS.get(cut, cut) if args.model == "resnet" else cut
        for lean in (False, True):
            jobs.append((f"sections={cut} lean={'on' if lean else 'off'}",
                         Engine(network(args.model), keras.optimizers.Adam(1e-3), sections=where, lean=lean)))
    for frac in [float(f) for f in args.budgets.split(",") if f]:
        for lean in (False, True):
            label = f"auto {frac:.2f} lean={'on' if lean else 'off'}"
            eng = Engine(network(args.model), keras.optimizers.Adam(1e-3), sections="auto",
                         memory_budget=int(frac * whole_peak), lean=lean)
            try:
                eng.build(batch)
            except ValueError as err:
                print(f"{label}: {err}")
                continue
            print(f"{label}: {eng.plan.summary()}")
            jobs.append((label, eng))
    meter = whole.meter

    def state_bytes(eng) -> int:
        variables = list(eng.network.variables) + list(eng.optimizer.variables)
        return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)

    before = gradient_traces()
    times = {label: [] for label, _ in jobs}
    peaks = {label: [] for label, _ in jobs}
    backward = {label: [] for label, _ in jobs}
    for _ in range(args.rounds):
        for label, eng in jobs:
            # Peaks are the allocator's, process-wide: every job's weights and optimizer slots are resident. A
            # job's own figure: what the step added to what was resident before it, plus its own state.
            resident = meter.current() - state_bytes(eng)
            t = time.perf_counter()
            stats = eng.train_step(batch)
            times[label].append(time.perf_counter() - t)
            peaks[label].append(stats["step_peak_bytes"] - resident)
            sec = [p - resident for p in stats["peak_bytes"] if p is not None]
            backward[label].append(max(sec[:-1] or sec) if sec else 0)
    traced = {k: v - before[k] for k, v in gradient_traces().items()}
    print(f"lean gradients traced during the rounds (first steps): {traced}")
    w = statistics.median(times["whole"][1:])
    whole_own = max(peaks["whole"])
    print(f"\nrounds {args.rounds}; time: median of rounds 2..{args.rounds}; peaks: largest over rounds")
    print("| job | step peak MiB | peak / whole | largest non-last section backward MiB | median step s | "
          "fastest step s | time / whole (median) | lean on / off: peak, section backward, median time, fastest |")
    print("|---|---|---|---|---|---|---|---|")
    for label, eng in jobs:
        top, sec, m = max(peaks[label]), max(backward[label]), statistics.median(times[label][1:])
        fast = min(times[label][1:])
        ratio = ""
        if "lean=on" in label:
            off = label.replace("lean=on", "lean=off")
            if off in times:
                ratio = (f"{top / max(peaks[off]):.3f}, {sec / max(backward[off]):.3f}, "
                         f"{m / statistics.median(times[off][1:]):.3f}, {fast / min(times[off][1:]):.3f}")
        sec_text = "-" if label == "whole" else f"{sec / MiB:.0f}"
        print(f"| {label} | {top / MiB:.0f} | {top / whole_own:.3f} | {sec_text} | {m:.3f} | {fast:.3f} | "
              f"{m / w:.3f} | {ratio} |")
    print("\nper-step peaks MiB:")
    for label, _ in jobs:
        print(f"  {label}: {[round(p / MiB) for p in peaks[label]]}; section backward "
              f"{[round(p / MiB) for p in backward[label]]}")


if __name__ == "__main__":
    main()
