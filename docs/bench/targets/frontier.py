"""Issue 22's targets: peak and time against whole-graph training, one process per job.

``--model``: ``resnet`` (the notebook ResNet, 28x28x1, Adam), ``resnet_split`` (the same with
``split_blocks=True``: the planner may cut inside residual blocks), or a keras.applications name (96x96x3,
``weights=None``, SGD with momentum). Jobs: ``whole`` (a plain compiled GradientTape step), ``recompute_grad`` at 2/4/13 sections,
``remat`` (the whole step over layers made inside ``keras.RematScope(mode=...)``, ``--remat`` modes), the sectioned engine
at fixed partitions, and ``sections="auto"`` at fractions of whole's measured peak with lean gradients off and
on. Each job builds its model in a fresh process (so no job's weights or caches count in another's peak), runs
``--steps`` steps and reports the largest step peak (allocator statistics) and the median step time of steps
2.. . The physical floor of any exact step is printed with whole: weights + gradients + optimizer slots + the
largest single operation's backward working set (its float inputs twice: input and input gradient; its outputs
once: the output's gradient), counted from the traced forward's shapes at the real batch. ``--out`` writes one
``metrics.json`` per job for ``python -m runner.report DIR`` (table and frontier plot).

    PYTHONPATH=. python docs/bench/targets/frontier.py --model resnet --batch 2048 --budgets 0.25,0.30,0.45 \
        --cuts 2,4,13 --out outputs/bench/targets_resnet
    PYTHONPATH=. python docs/bench/targets/frontier.py --model ResNet50 --batch 256 --budgets 0.25,0.30,0.45 \
        --cuts 4,13 --probe-batch 64
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MiB = 2**20
MODES = {"off": False, "on": True, "recompute": "recompute"}  # --lean and --lean-fixed values: Engine(lean=...)
RESNET_CUTS = {1: 1, 2: ["scale1"], 4: ["scale1", "scale2", "final_pool"], 13: 13}
_WEIGHT_OPS = {"ReadVariableOp", "Const", "VarHandleOp", "Placeholder", "Shape"}


def build(model: str, batch: int, remat: str | None = None):
    """The network, its optimizer and one batch; ``remat``: a ``keras.RematScope`` mode its layers are made in."""
    import contextlib

    import keras

    keras.utils.set_random_seed(0)
    scope = keras.RematScope(mode=remat) if remat else contextlib.nullcontext()
    with scope:
        return _build(model, batch)


def _build(model: str, batch: int):
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    if model in ("resnet", "resnet_split"):
        from models import build_resnet

        net = build_resnet(num_classes=10, input_shape=(28, 28, 1), split_blocks=model == "resnet_split")
        shape, opt = (28, 28, 1), keras.optimizers.Adam(1e-3)
    else:
        from models.keras_app import build_keras_app

        net, shape = build_keras_app(model, 10, [96, 96, 3]), (96, 96, 3)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
    data = {"image": tf.constant(rng.uniform(-1, 1, (batch, *shape)).astype("float32")),
            "label": tf.constant(rng.integers(0, 10, batch).astype("int32"))}
    return net, opt, data


def largest_working_set(net, data) -> tuple[int, str]:
    """The largest single operation's backward working set at the real batch, from the blocks' traced forwards."""
    import tensorflow as tf

    from sections.backend.profile import specs_at, probe_slice

    small, real = probe_slice(net, data, 8)
    h, best = small[net.inputs], (0, "")
    for block in net.blocks:
        spec = specs_at(h, real)
        graph = tf.function(lambda x, b=block: b(x, small, training=True)).get_concrete_function(spec).graph
        for op in graph.get_operations():
            if op.type in _WEIGHT_OPS:
                continue
            size = lambda ts: sum(t.shape.num_elements() * t.dtype.size for t in ts
                                  if t.dtype.is_floating and t.shape.is_fully_defined())
            ins = [t for t in op.inputs if t.op.type not in _WEIGHT_OPS]
            work = 2 * size(ins) + size(op.outputs)
            if work > best[0]:
                best = (work, f"{block.name}: {op.type}")
        h = block(h, small, training=True)
    return best[0], best[1]  # traced at the real batch


def _reason(err: Exception) -> str:
    """The line of a traced function's error that says what failed (Keras wraps it in traceback and arguments)."""
    lines = [l.replace("\x1b[1m", "").replace("\x1b[0m", "").strip() for l in str(err).splitlines()]
    said = [l for l in lines if l and not l.startswith(("File ", "in user code", "Arguments received", "•"))]
    text = " ".join(said[-2:])
    return text if text.startswith(type(err).__name__) else f"{type(err).__name__}: {text}"


def job(args, kind: str, arg) -> dict:
    from sections import allocator

    allocator.configure()
    from sections import Engine, RecomputeGrad, WholeGraph
    from sections.backend.structure import nbytes

    net, opt, data = build(args.model, args.batch, remat=arg if kind == "remat" else None)
    cuts = (RESNET_CUTS[int(arg)] if args.model.startswith("resnet") and kind in ("recompute_grad", "sectioned")
            else int(arg) if kind in ("recompute_grad", "sectioned") else None)
    out = {"job": kind, "arg": arg}
    t0 = time.perf_counter()
    try:
        if kind in ("whole", "remat"):
            trainer = WholeGraph(net, opt)
        elif kind == "recompute_grad":
            trainer = RecomputeGrad(net, opt, sections=cuts)
        elif kind == "sectioned":
            trainer = Engine(net, opt, sections=cuts, lean=MODES[args.lean_fixed], apply=args.apply)
        else:
            budget, lean = arg
            trainer = Engine(net, opt, sections="auto", memory_budget=int(budget), lean=MODES[lean],
                             probe_batch=args.probe_batch, apply=args.apply)
        trainer.build(data)
    except ValueError as err:
        if kind == "remat":
            raise
        return dict(out, refused=str(err).splitlines()[0], advised=getattr(err, "advised", None))
    out["build_s"] = time.perf_counter() - t0
    peaks, times = [], []
    for _ in range(args.steps):
        t = time.perf_counter()
        stats = trainer.train_step(data)
        times.append(time.perf_counter() - t)
        peaks.append(stats["step_peak_bytes"])
    out.update(peaks=peaks, seconds=statistics.median(times[1:]), sections=len(trainer.sections),
               section_blocks=[s.stop - s.start for s in trainer.sections],
               policies=[s.policy for s in trainer.sections], strategy=trainer.strategy)
    plan = getattr(trainer, "plan", None)
    if plan is not None:
        out.update(predicted=plan.predicted_peak, runs=list(plan.forward_runs), extra=plan.extra_bytes,
                   replans=list(trainer.replans))
    if kind == "whole":
        fixed = 2 * sum(nbytes(v) for v in net.trainable_variables) + sum(nbytes(v) for v in opt.variables)
        fixed += sum(nbytes(v) for v in net.non_trainable_variables)
        work, where = largest_working_set(net, data)
        out.update(floor=fixed + work, floor_fixed=fixed, floor_work=work, floor_where=where)
    return out


def run(args, kind, arg, default_threads: bool = False) -> dict:
    """One job in a fresh process; with ``--inter-op N`` its TensorFlow runs N inter-op threads, unless
    ``default_threads`` (the baseline: TensorFlow's own thread pools, as users run)."""
    cmd = [sys.executable, __file__, "--job", json.dumps([kind, arg])] + args.passthrough
    env = dict(os.environ)
    if args.inter_op and not default_threads:
        env["TF_NUM_INTEROP_THREADS"] = str(args.inter_op)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("JOB "):
            return json.loads(line[4:])
    return {"job": kind, "arg": arg, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}


def label(r) -> str:
    if r["job"] == "auto":
        budget, lean = r["arg"]
        return f"auto {r['frac']:.2f} lean {lean}"
    if r["job"] == "whole":
        return "whole" if r["arg"] is None else f"whole, {r['arg']} {r['inter_op']}"
    return f"{r['job']} {r['arg']}" + (
        f" lean {r['lean_fixed']}" if r["job"] == "sectioned" else "")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budgets", default="0.25,0.30,0.45")
    ap.add_argument("--lean", default="off,on", help="lean settings for the auto jobs: off, on, recompute")
    ap.add_argument("--cuts", default="2,4,13")
    ap.add_argument("--lean-fixed", nargs="?", const="on", default="off",
                    help="lean for the fixed-partition engine jobs: off (absent), on (the flag alone), recompute")
    ap.add_argument("--kinds", default="recompute_grad,sectioned", help="fixed-partition jobs run at each --cuts")
    ap.add_argument("--remat", default="", help="keras.RematScope modes, each a job: full, activations, larger_than")
    ap.add_argument("--probe-batch", type=int, default=None)
    ap.add_argument("--apply", default="auto", help="the engine jobs' apply: auto, in_backward, at_end")
    ap.add_argument("--out", default="")
    ap.add_argument("--baselines-inter-op", action="store_true",
                    help="run tf.recompute_grad and RematScope jobs with --inter-op too (default: TensorFlow's threads, "
                         "as users run them; one thread lets tf.recompute_grad re-run early)")
    ap.add_argument("--inter-op", type=int, default=0,
                    help="TF_NUM_INTEROP_THREADS for the engine jobs (and the baselines with --baselines-inter-op); whole runs "
                         "on TensorFlow's threads, and again with it, as a row")
    ap.add_argument("--job")
    args = ap.parse_args()
    args.passthrough = [a for a in sys.argv[1:] if a != "--job"]
    if args.job:
        kind, arg = json.loads(args.job)
        try:
            result = job(args, kind, arg)
        except Exception as err:  # keras.RematScope modes that TensorFlow's graph mode cannot run
            if kind != "remat":
                raise
            result = {"job": kind, "arg": arg, "error": _reason(err)}
        print("JOB " + json.dumps(result), flush=True)
        return
    whole = run(args, "whole", None, default_threads=True)
    if "peaks" not in whole:
        sys.exit(f"whole failed: {whole}")
    wp, wt = max(whole["peaks"]), whole["seconds"]
    print(f"{args.model} batch {args.batch}: whole {wp / MiB:.0f} MiB, {wt:.2f} s/step; floor of any exact step "
          f"{whole['floor'] / MiB:.0f} MiB ({whole['floor'] / wp:.3f} of whole) = fixed {whole['floor_fixed'] / MiB:.0f} "
          f"+ largest working set {whole['floor_work'] / MiB:.0f} ({whole['floor_where']}); load {os.getloadavg()}"
          + (f"; engine jobs below with TF_NUM_INTEROP_THREADS={args.inter_op}"
             + ("" if args.baselines_inter_op else ", baselines with TensorFlow's threads") if args.inter_op else ""),
          flush=True)
    print("| job | sections | forward runs | predicted MiB | peak MiB (steps) | peak / whole | peak / floor | "
          "within budget | median s | time / whole |\n|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = [whole]
    specs = [("whole", "inter-op")] if args.inter_op else []
    specs += [(k, c) for c in args.cuts.split(",") if c for k in args.kinds.split(",") if k]
    specs += [("remat", m) for m in args.remat.split(",") if m]
    specs += [("auto", [int(float(f) * wp), lean]) for f in args.budgets.split(",") if f
              for lean in args.lean.split(",")]
    for kind, arg in [("whole", None)] + specs:
        baseline = kind in ("recompute_grad", "remat") and not args.baselines_inter_op
        r = whole if (kind, arg) == ("whole", None) else run(args, kind, arg, default_threads=baseline)
        if kind == "auto":
            r["frac"] = arg[0] / wp
        r["lean_fixed"], r["inter_op"] = args.lean_fixed, args.inter_op
        if r is not whole:
            results.append(r)
        name = label(r)
        if "refused" in r or "error" in r:
            print(f"| {name} | {r.get('refused') or r.get('error')} |", flush=True)
            continue
        top = max(r["peaks"])
        within = "-" if kind != "auto" else ("yes" if top <= arg[0] else "**NO**")
        pred = f"{r['predicted'] / MiB:.0f}" if r.get("predicted") else "-"
        print(f"| {name} | {r['sections']} | {r.get('runs', '-')} | {pred} | {top / MiB:.0f} "
              f"({', '.join(f'{p / MiB:.0f}' for p in r['peaks'])}) | {top / wp:.3f} | {top / whole['floor']:.2f} | "
              f"{within} | {r['seconds']:.2f} | {r['seconds'] / wt:.3f} |", flush=True)
    print(f"load after: {os.getloadavg()}")
    for r in results:
        for note in r.get("replans", []):
            print(f"  {label(r)}: {note}")
    if args.out:
        for i, r in enumerate(results):
            if "peaks" not in r:
                continue
            folder = Path(args.out) / str(i)
            folder.mkdir(parents=True, exist_ok=True)
            budget = r["arg"][0] if r["job"] == "auto" else None
            (folder / "metrics.json").write_text(json.dumps({
                "strategy": r["strategy"], "batch": args.batch, "median_step_seconds": r["seconds"],
                "step_peak_bytes": max(r["peaks"]), "num_sections": r["sections"],
                "section_blocks": r["section_blocks"], "policies": r["policies"], "memory_budget_bytes": budget,
                "predicted_peak_bytes": r.get("predicted"), "lean": r["arg"][1] if budget else None},
                indent=1))


if __name__ == "__main__":
    main()
