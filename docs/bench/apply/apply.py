"""Where the optimizer applies the gradients: once after the backward (``at_end``) against section by section in
it (``in_backward``), at a fixed partition, each job in its own process (a job's weights and caches would count in
the next one's peaks). Prints each job's step peaks and median step time (steps 2..), and ratios to ``at_end``.

    PYTHONPATH=. python docs/bench/apply/apply.py --model gpt --sections 4 --repeats 2
    PYTHONPATH=. python docs/bench/apply/apply.py --model ResNet50 --batch 256 --sections 4
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MiB = 2**20


def build(args):
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if args.model == "gpt":  # weights far above activations: 8 layers of width 512, an untied 8192-token vocabulary
        from models.gpt import build_gpt

        net = build_gpt(vocab_size=8192, seq_len=128, d_model=512, num_layers=8, num_heads=8)
        batch = {"tokens": rng.integers(0, 8192, (args.batch, 128)),
                 "targets": rng.integers(0, 8192, (args.batch, 128))}
        opt = keras.optimizers.Adam(1e-4)
    else:
        from models.keras_app import build_keras_app

        net = build_keras_app(args.model, 10, [96, 96, 3])
        batch = {"image": rng.uniform(-1, 1, (args.batch, 96, 96, 3)), "label": rng.integers(0, 10, args.batch)}
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
    batch = {k: tf.constant(v.astype("float32" if v.dtype.kind == "f" else "int32")) for k, v in batch.items()}
    return net, opt, batch


def job(args) -> dict:
    from sections import allocator

    allocator.configure()
    from sections import Engine

    net, opt, batch = build(args)
    engine = Engine(net, opt, sections=args.sections, lean=args.lean, apply=args.job)
    peaks, times = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        stats = engine.train_step(batch)
        times.append(time.perf_counter() - t)
        peaks.append(stats["step_peak_bytes"])
    weights = sum(int(v.numpy().nbytes) for v in net.trainable_variables)
    return {"apply": args.job, "reason": engine.apply_reason, "peaks": peaks, "seconds": statistics.median(times[1:]),
            "weights": weights}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--sections", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--lean", default="recompute")
    ap.add_argument("--job")
    args = ap.parse_args()
    if args.lean in ("true", "false"):
        args.lean = args.lean == "true"
    if args.job:
        print("JOB " + json.dumps(job(args)), flush=True)
        return
    env = dict(os.environ, TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    rows = {"at_end": [], "in_backward": []}
    for _ in range(args.repeats):  # interleaved: the machine's load drifts
        for mode in rows:
            out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--job", mode], env=env,
                                 capture_output=True, text=True)
            line = next((x for x in out.stdout.splitlines() if x.startswith("JOB ")), None)
            if line is None:
                sys.exit(out.stderr[-2000:])
            rows[mode].append(json.loads(line[4:]))
    print(f"{args.model} batch {args.batch}, {args.sections} sections, lean={args.lean}, one inter-op thread; "
          f"trainable weights {rows['at_end'][0]['weights'] / MiB:.0f} MiB")
    print("| apply | run | step peaks MiB | largest | median s/step |")
    print("|---|---|---|---|---|")
    for mode, runs in rows.items():
        for i, r in enumerate(runs):
            print(f"| {mode} | {i + 1} | {', '.join(f'{p / MiB:.0f}' for p in r['peaks'])} | "
                  f"{max(r['peaks']) / MiB:.0f} | {r['seconds']:.3f} |")
    peak = {m: statistics.median(max(r["peaks"]) for r in runs) for m, runs in rows.items()}
    secs = {m: statistics.median(r["seconds"] for r in runs) for m, runs in rows.items()}
    print(f"in_backward / at_end: largest step peak {peak['in_backward'] / peak['at_end']:.3f} "
          f"({(peak['at_end'] - peak['in_backward']) / MiB:.0f} MiB less), "
          f"time {secs['in_backward'] / secs['at_end']:.3f}; in_backward's reason: {rows['in_backward'][0]['reason']}")


if __name__ == "__main__":
    main()
