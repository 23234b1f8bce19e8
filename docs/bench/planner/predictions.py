"""The planner's predicted step peak against the measured one, per model and budget (issue 22, item 3).

For each model: `whole` measures the whole-graph step's peak; then `sections="auto"` at each budget (a fraction of
that peak) reports its predicted peak, the largest measured step peak over the steps, and whether it stayed within
the budget; a budget nothing fits reports the advised smallest budget, which is then tried. Each job runs in its
own process (an engine's optimizer slots and caches would otherwise count in the next job's peaks).

    PYTHONPATH=. python docs/bench/planner/predictions.py --models resnet:512,ResNet50:96:32 --budgets 0.3,0.5,0.7
"""
import argparse
import json
import os
import subprocess
import sys
import time

MiB = 2**20


def build(spec: str):
    """``resnet:<batch>``, ``gpt:<batch>`` or ``<keras.applications name>:<size>:<batch>``."""
    import keras
    import numpy as np
    import tensorflow as tf

    parts = spec.split(":")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if parts[0] == "resnet":
        from models import build_resnet

        b = int(parts[1])
        net = build_resnet(num_classes=10, input_shape=(28, 28, 1))
        batch = {"image": rng.normal(size=(b, 28, 28, 1)), "label": rng.integers(0, 10, b)}
    elif parts[0] == "gpt":
        from models.gpt import build_gpt

        b, t, vocab = int(parts[1]), 128, 64
        net = build_gpt(vocab_size=vocab, seq_len=t)
        batch = {"tokens": rng.integers(0, vocab, (b, t)), "targets": rng.integers(0, vocab, (b, t))}
    else:
        from models.keras_app import build_keras_app

        size, b = int(parts[1]), int(parts[2])
        net = build_keras_app(parts[0], 10, [size, size, 3])
        batch = {"image": rng.uniform(-1, 1, size=(b, size, size, 3)), "label": rng.integers(0, 10, b)}
    batch = {k: tf.constant(v.astype("float32" if v.dtype.kind == "f" else "int32")) for k, v in batch.items()}
    return net, batch


def job(spec: str, budget, steps: int) -> dict:
    from sections import allocator

    allocator.configure()
    import keras
    import tensorflow as tf

    if os.environ.get("INTER_OP_THREADS"):
        tf.config.threading.set_inter_op_parallelism_threads(int(os.environ["INTER_OP_THREADS"]))

    from sections import Engine, WholeGraph

    net, batch = build(spec)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    out = {"model": spec, "budget": budget}
    t0 = time.perf_counter()
    try:
        engine = (WholeGraph(net, optimizer) if budget is None
                  else Engine(net, optimizer, sections="auto", memory_budget=int(budget)))
        engine.build(batch)
    except ValueError as err:
        out.update(refused=str(err), advised=getattr(err, "advised", None))
        return out
    out["build_s"] = time.perf_counter() - t0
    if engine.plan is not None:
        out.update(predicted=engine.plan.predicted_peak, sections=engine.plan.schedule.num_sections,
                   runs=list(engine.plan.forward_runs), measured_spans=len(engine.section_probe.measured),
                   spread=engine.section_probe.largest_spread())
    peaks, times = [], []
    for _ in range(steps):
        t = time.perf_counter()
        stats = engine.train_step(batch)
        times.append(time.perf_counter() - t)
        peaks.append(stats["step_peak_bytes"])
    out.update(peaks=peaks, seconds=sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else times[0],
               replans=list(getattr(engine, "replans", [])))
    return out


def run_job(spec, budget, steps):
    cmd = [sys.executable, __file__, "--job", spec, "--budget", str(budget), "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    for line in proc.stdout.splitlines():
        if line.startswith("JOB "):
            return json.loads(line[4:])
    return {"model": spec, "budget": budget, "error": proc.stderr[-2000:]}


def row(r, whole_peak):
    mib = lambda b: f"{b / MiB:.0f}"
    budget = f"{mib(r['budget'])} ({r['budget'] / whole_peak:.2f})"
    if "refused" in r:
        return f"| {r['model']} | {budget} | refused, advised {mib(r['advised'])} MiB | | | |"
    if "error" in r:
        return f"| {r['model']} | {budget} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} | | | |"
    peak = max(r["peaks"])
    return (f"| {r['model']} | {budget} | {mib(r['predicted'])} | {mib(peak)} ({r['peaks'] and min(r['peaks']) / MiB:.0f}"
            f"-{peak / MiB:.0f}) | {r['predicted'] / peak:.3f} | {'yes' if peak <= r['budget'] else '**NO**'} "
            f"| {r['sections']} sections, runs {r['runs']}, {r['measured_spans']} spans measured, spread "
            f"{r['spread'] / MiB:.1f} MiB, {r['seconds']:.2f} s/step; steps {[round(p / MiB) for p in r['peaks']]}"
            + "".join(f"; {note}" for note in r["replans"]) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet:512")
    ap.add_argument("--budgets", default="0.3,0.5,0.7", help="fractions of whole's measured peak")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--whole-mib", type=float, default=None,
                    help="whole's peak measured before (one model only): skips the whole job")
    ap.add_argument("--job")
    ap.add_argument("--budget")
    args = ap.parse_args()
    if args.job:
        budget = None if args.budget == "None" else int(float(args.budget))
        print("JOB " + json.dumps(job(args.job, budget, args.steps)), flush=True)
        return
    print("| model | budget MiB (of whole) | predicted MiB | measured MiB (range over steps) | predicted / measured "
          "| within budget | plan |\n|---|---|---|---|---|---|---|", flush=True)
    for spec in args.models.split(","):
        whole = (run_job(spec, None, args.steps) if args.whole_mib is None
                 else {"peaks": [int(args.whole_mib * MiB)], "seconds": float("nan")})
        if "peaks" not in whole:
            print(f"| {spec} | whole failed: {whole} |")
            continue
        wp = max(whole["peaks"])
        print(f"| {spec} | whole | | {wp / MiB:.0f} | | | {whole['seconds']:.2f} s/step |", flush=True)
        for frac in [float(f) for f in args.budgets.split(",")]:
            r = run_job(spec, int(frac * wp), args.steps)
            print(row(r, wp), flush=True)
            if r.get("advised"):
                r2 = run_job(spec, r["advised"], args.steps)
                print(row(r2, wp) + " (the advised budget)", flush=True)


if __name__ == "__main__":
    main()
