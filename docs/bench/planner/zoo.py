"""The planner on a zoo of models, each on emulated devices of a fraction of whole-graph training's peak.

    .venv/bin/python docs/bench/planner/zoo.py                      # the default zoo, devices 0.6 and 0.4
    .venv/bin/python docs/bench/planner/zoo.py --models resnet mobilenetv2 --fractions 0.6 --steps 3
    .venv/bin/python docs/bench/planner/zoo.py --models resnet --fractions 0.5 --fixed 2 4 8   # auto vs fixed N
    .venv/bin/python docs/bench/planner/zoo.py --models resnet mobilenetv2 --fractions 0.6 --batch-max  # batch=max

Per model: whole-graph training's peak at the batch with no limit (one process), then per fraction a process
under ``TF_CPU_ALLOCATOR_USE_BFC=true TF_CPU_BFC_MEM_LIMIT_IN_MB=<fraction x whole's peak>`` (oneDNN off, as the
runner sets under a limit) running ``sections="auto"`` with no budget: planning seconds, dry steps (and how many
ran out of memory), each dry step's predicted against measured peak, the plan, its training steps' peaks and
median step time against whole's unlimited step, and the planning's own summary of where its seconds went.
``--processes 3`` runs the sectioned process three times and
says whether the partitions agree. ``--fixed N ...`` also runs ``sections=N`` on the same device and compares
auto's step with the fastest of them that fits (issue 50, item 8). ``--batch-max`` also runs the runner's
``batch=max`` on the same device, ``engine=whole`` and ``sections=auto`` (synthetic images of the model's shape,
two training steps): each search's batch, trials and seconds, and auto's batch against whole's (issue 50, items 1
and 3; image models only). Nothing is asserted: the table is printed
(BENCHMARKS.md keeps it).
"""

from __future__ import annotations

import argparse
import json
import logging
import logging.handlers
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ZOO = {  # name: (builder, args, batch, input shape)
    "resnet": ("resnet", {}, 512, (28, 28, 1)),
    "mobilenetv2": ("keras_app", {"name": "MobileNetV2"}, 64, (96, 96, 3)),
    "efficientnetb0": ("keras_app", {"name": "EfficientNetB0"}, 32, (96, 96, 3)),
    "inceptionv3": ("keras_app", {"name": "InceptionV3"}, 32, (96, 96, 3)),
    "resnet50": ("keras_app", {"name": "ResNet50"}, 32, (64, 64, 3)),
    "resnet50v2": ("keras_app", {"name": "ResNet50V2"}, 64, (64, 64, 3)),
    "vgg16": ("keras_app", {"name": "VGG16"}, 32, (64, 64, 3)),
    "gpt2": ("keras_hub", {"name": "GPT2Backbone", "args": {"num_layers": 4, "num_heads": 4, "hidden_dim": 128,
                                                             "intermediate_dim": 512}}, 4, (1024,)),
    # A text encoder with a label per token (bidirectional attention; the padding mask and segment ids made inside).
    "bert": ("keras_hub", {"name": "BertBackbone", "task": "token_classification",
                           "args": {"num_layers": 4, "num_heads": 4, "hidden_dim": 128, "intermediate_dim": 512}},
             4, (1024,)),
}


def worker(model: str, engine_kind: str, steps: int) -> dict:
    """One process: build the model, train ``steps`` steps with the chosen engine, return the figures."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from sections.allocator import configure

    configure()
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    from sections import Engine, WholeGraph, reserve_cpu_limit

    reserve_cpu_limit()  # the emulated device as one region, as the runner does (before anything allocates)
    kind, args, batch_size, shape = ZOO[model]
    keras.utils.set_random_seed(0)
    try:
        net = _build(kind, args, shape)
    except tf.errors.ResourceExhaustedError:  # the weights' initializers alone do not fit the device
        return {"model": model, "batch": batch_size, "engine": engine_kind,
                "refused": "the device ran out building the model itself, before any engine"}
    if kind == "keras_hub":
        tokens = tf.random.uniform((batch_size, shape[0] + 1), 0, 256, dtype=tf.int32)
        if args.get("task") == "token_classification":
            batch = {"tokens": tokens[:, :-1], "label": tokens[:, 1:] % 10}
        else:
            batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}  # next-token prediction
    else:
        batch = {"image": tf.random.uniform((batch_size, *shape)), "label": tf.range(batch_size) % 10}
    opt = keras.optimizers.Adam(1e-3)
    if engine_kind == "whole":
        engine = WholeGraph(net, opt)
    else:  # "auto", or a fixed number of sections (balanced by counted activation bytes)
        engine = Engine(net, opt, sections="auto" if engine_kind == "auto" else int(engine_kind))
    began = time.perf_counter()
    out = {"model": model, "batch": batch_size, "engine": engine_kind}
    said = logging.handlers.BufferingHandler(capacity=10**6)  # the planning's own summary: where its seconds went
    logging.getLogger("sections").addHandler(said)
    logging.getLogger("sections").setLevel(logging.INFO)
    try:
        engine.build(batch)
    except Exception as err:  # a refusal: its one line, and the dry steps it rests on
        out.update(refused=str(err)[:400], build_seconds=time.perf_counter() - began,
                   dry_runs=getattr(engine, "dry_runs", []) if engine_kind != "whole" else [])
        return out
    out["build_seconds"] = time.perf_counter() - began
    if engine_kind == "auto":
        plan = engine.plan
        out.update(sections=plan.schedule.num_sections, starts=list(plan.schedule.starts),
                   policies=plan.policies, forward_runs=list(plan.forward_runs),
                   predicted=plan.predicted_peak, dry_runs=engine.dry_runs,
                   planning_seconds=engine.planning_seconds,
                   planning_summary=next((m for m in map(logging.LogRecord.getMessage, said.buffer)
                                          if m.startswith("planned in")), ""))
    peaks, seconds = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        try:
            stats = engine.train_step(batch)
        except Exception as err:  # a fixed partition that does not fit the device
            out.update(refused=f"step {len(peaks) + 1}: {str(err)[:300]}")
            return out
        seconds.append(time.perf_counter() - t0)
        peaks.append(stats["step_peak_bytes"])
    out.update(step_peaks=peaks, step_seconds=seconds)
    return out


def image_model(model: str, batch_size: int | None = None, max_blocks: int | None = None):
    """In a worker process: the project's allocator set-up, one inter-op thread and the limit as one region (as the
    runner), then ``model``'s network (seed 0; a keras.applications model cut into at most ``max_blocks`` blocks
    where given) and one synthetic batch of its images (the zoo's batch, or ``batch_size``). Returns (network, batch)."""
    sys.path.insert(0, str(ROOT))
    from sections.allocator import configure

    configure()
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    from sections import reserve_cpu_limit

    reserve_cpu_limit()
    kind, args, zoo_batch, shape = ZOO[model]
    batch_size = batch_size or zoo_batch
    keras.utils.set_random_seed(0)
    net = _build(kind, args, shape, max_blocks)
    return net, {"image": tf.random.uniform((batch_size, *shape)), "label": tf.range(batch_size) % 10}


def _build(kind: str, args: dict, shape: tuple, max_blocks: int | None = None):
    """The zoo entry's network, random weights."""
    if kind == "resnet":
        from models.resnet import build_resnet

        return build_resnet(num_classes=10)
    if kind == "keras_app":
        from models.keras_app import build_keras_app

        blocks = {"max_blocks": max_blocks} if max_blocks else {}
        return build_keras_app(args["name"], num_classes=10, input_shape=list(shape), **blocks)
    from models.keras_hub import build_keras_hub

    if args.get("task") == "token_classification":
        return build_keras_hub(args["name"], args=args["args"], task=args["task"], vocab_size=256, seq_len=shape[0],
                               num_classes=10, labels="token")
    return build_keras_hub(args["name"], args=args["args"], vocab_size=256, seq_len=shape[0])


def run(model: str, engine_kind: str, steps: int, limit_mib: int | None, onednn_off: bool = False) -> dict:
    """One worker process; ``onednn_off``: TensorFlow's own CPU kernels, what a limited process runs."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    if onednn_off:
        env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    if limit_mib is not None:
        env.update(TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPU_BFC_MEM_LIMIT_IN_MB=str(limit_mib))
    proc = subprocess.run([sys.executable, __file__, "--worker", model, engine_kind, str(steps)], env=env,
                          capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if not lines:
        return {"model": model, "engine": engine_kind, "crashed": proc.returncode, "tail": proc.stderr[-800:]}
    return json.loads(lines[-1])


def runner_args(model: str) -> list[str]:
    """The runner's overrides for a zoo image model on synthetic data of its shape (sized for 3x whole's batch)."""
    kind, args, batch, shape = ZOO[model]
    data = ["data=synthetic", f"data.image_shape=[{','.join(map(str, shape))}]", f"data.train_size={8 * batch}",
            "data.test_size=64"]
    if kind == "resnet":
        return ["model=resnet", *data]
    if kind == "keras_app":
        return ["model=keras_app", f"model.name={args['name']}", f"model.input_shape=[{','.join(map(str, shape))}]",
                *data]
    raise ValueError(f"--batch-max runs image models; {model} is not one")


def batch_max_overrides(model: str, engine: str, folder: Path) -> list[str]:
    """The runner's overrides for ``batch=max`` of a zoo image model with ``engine`` (``whole`` or ``auto``)."""
    chosen = ["engine=whole"] if engine == "whole" else ["sections=auto"]
    return [*runner_args(model), *chosen, "batch=max", "train.steps=2", "train.eval_every=0",
            "train.verify_exact=false", "train.save_model=false", "train.progress=log",
            "train.plan_cache=null", f"hydra.run.dir={folder}"]  # plan_cache=null: every search afresh


def batch_max(model: str, engine: str, limit_mib: int, folder: Path) -> dict:
    """The runner's ``batch=max`` for ``model`` with ``engine`` (``whole`` or ``auto``) under a device of
    ``limit_mib``: its metrics.json (``batch``, ``batch_max_trials``, ``batch_max_seconds``), or why it failed."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(limit_mib))
    command = [sys.executable, "-m", "runner", *batch_max_overrides(model, engine, folder)]
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - began
    metrics = folder / "metrics.json"
    if proc.returncode != 0 or not metrics.is_file():
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        return {"failed": (errors or [proc.stderr[-400:]])[-1], "seconds": seconds}
    return {**json.loads(metrics.read_text()), "seconds": seconds}


def batch_max_line(fraction: float, engine: str, r: dict) -> str:
    mib = 2**20
    if "failed" in r:
        return f"  {fraction:.1f}: batch=max {engine}: failed after {r['seconds']:.0f} s: {r['failed'][:300]}"
    trials = ", ".join(f"{t['batch']} {'fits' if t['fits'] else 'no'} {t['seconds'] or 0:.0f} s"
                       for t in r.get("batch_max_trials", []))
    return (f"  {fraction:.1f}: batch=max {engine}: batch {r['batch']}, search {r.get('batch_max_seconds', 0):.1f} s "
            f"({len(r.get('batch_max_trials', []))} trials: {trials}), steps at "
            f"{r.get('step_peak_bytes', 0) / mib:.1f} MiB, whole run {r['seconds']:.0f} s")


def step_seconds(result: dict) -> float:
    """The median step time of a worker's result, its first (tracing) step left out where there are others."""
    return statistics.median(result["step_seconds"][1:] or result["step_seconds"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="The planner on a zoo of models under emulated devices.")
    parser.add_argument("--models", nargs="*", default=["resnet", "mobilenetv2", "resnet50v2"])
    parser.add_argument("--fractions", nargs="*", type=float, default=[0.6, 0.4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--fixed", nargs="*", type=int, default=[],
                        help="also run sections=N for each N on the same device: auto's step against the fastest")
    parser.add_argument("--batch-max", action="store_true",
                        help="also run the runner's batch=max (engine=whole and sections=auto) on the same device")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "zoo",
                        help="where --batch-max's run folders go")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    mib = 2**20
    for model in args.models:
        whole = run(model, "whole", args.steps, None)
        if "step_peaks" not in whole:
            print(f"{model}: whole-graph training failed: {whole}")
            continue
        peak = max(whole["step_peaks"])
        step = step_seconds(whole)
        # The limited processes run TensorFlow's own kernels (oneDNN's crash where an allocation fails): whole's
        # step on those kernels too, so that a ratio compares engines, not kernels.
        same = run(model, "whole", args.steps, None, onednn_off=True)
        step_off = step_seconds(same) if "step_seconds" in same else float("nan")
        print(f"\n{model} batch {whole['batch']}: whole's peak {peak / mib:.1f} MiB, step {step:.2f} s (no limit), "
              f"{step_off:.2f} s on the limited runs' kernels (oneDNN off)")
        for fraction in args.fractions:
            limit = int(fraction * peak / mib)
            runs = [run(model, "auto", args.steps, limit) for _ in range(args.processes)]
            for r in runs:
                dry = r.get("dry_runs", [])
                pairs = ", ".join(f"{d['predicted'] / mib:.1f}->{d['measured'] / mib:.1f}"
                                  + (" OOM" if d["ran_out"] else "") for d in dry)
                if "refused" in r or "crashed" in r:
                    steps = f" [{len(dry)} dry steps ({sum(d['ran_out'] for d in dry)} out of memory): {pairs}]"
                    print(f"  {fraction:.1f} ({limit} MiB): {r.get('refused') or r}{steps if dry else ''}")
                    continue
                t = step_seconds(r)
                print(f"  {fraction:.1f} ({limit} MiB): {r['sections']} sections, forward runs {r['forward_runs']}, "
                      f"planning {r['planning_seconds']:.1f} s, {len(dry)} dry steps "
                      f"({sum(d['ran_out'] for d in dry)} out of memory) predicted->measured MiB [{pairs}], "
                      f"steps {[round(p / mib, 1) for p in r['step_peaks']]} MiB, step {t:.2f} s "
                      f"({t / step:.2f}x whole's, {t / step_off:.2f}x on the same kernels); "
                      f"{r.get('planning_summary', '')}")
            fixed = {n: run(model, str(n), args.steps, limit) for n in args.fixed}
            if fixed:
                fits = {n: step_seconds(r) for n, r in fixed.items()
                        if "step_seconds" in r}
                said = ", ".join(f"{n}: {fits[n]:.2f} s, {max(fixed[n]['step_peaks']) / mib:.1f} MiB" if n in fits
                                 else f"{n}: does not fit" for n in fixed)
                print(f"  {fraction:.1f}: fixed sections=N [{said}]")
                auto = [r for r in runs if "step_seconds" in r]
                if fits and auto:
                    n = min(fits, key=fits.get)
                    t = step_seconds(auto[0])
                    print(f"  {fraction:.1f}: auto's step {t:.2f} s = {t / fits[n]:.2f}x the fastest fixed plan that "
                          f"fits (sections={n}, {fits[n]:.2f} s), {t / step:.2f}x whole's unlimited, "
                          f"{t / step_off:.2f}x on the same kernels")
            if args.batch_max:
                found = {}
                for engine in ("whole", "auto"):
                    folder = args.out / f"{model}-{fraction}-{engine}-{time.strftime('%H%M%S')}"
                    found[engine] = batch_max(model, engine, limit, folder)
                    print(batch_max_line(fraction, engine, found[engine]), flush=True)
                if all("batch" in r for r in found.values()):
                    print(f"  {fraction:.1f}: batch=max auto {found['auto']['batch']} = "
                          f"{found['auto']['batch'] / found['whole']['batch']:.2f}x whole's {found['whole']['batch']}")
            if len(runs) > 1:
                same = len({json.dumps([r.get("starts"), r.get("policies")]) for r in runs}) == 1
                print(f"  {fraction:.1f}: {len(runs)} processes chose {'the same plan' if same else 'different plans'}")
                if not same:
                    for r in runs:
                        print(f"    starts {r.get('starts')}, policies {r.get('policies')}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
    else:
        main()
