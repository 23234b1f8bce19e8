"""A keras-hub GPT-2 causal LM at long context: plain fit vs RematScope vs tf.recompute_grad vs SectionedModel.

The model: ``keras_hub.models.GPT2Backbone`` from its constructor (random init, no preset): 6 layers, hidden 256,
4 heads, intermediate 1024, vocabulary 512, dropout 0.1 (keras-hub's default), ``max_sequence_length`` = the
sequence length; a Dense LM head (512 logits) over its sequence output; sparse categorical cross-entropy (from
logits) on random tokens (targets: the next token of a random window); Adam (1e-4). Inputs: the backbone's dict
(``token_ids``, ``padding_mask`` all ones).

Each variant runs in its own process (``--variant``); it prints one ``RESULT {json}`` line: the median step peak
(bytes) and the median step time (s) over the steps after ``--warmup``. Peaks: plain / RematScope /
recompute_grad reset the CPU:0 (GPU:0) allocator's statistics at each step's start and read its peak at the end
(a Keras callback, as docs/bench/fit/bench_fit.py); SectionedModel reports its engine's own step peak
(``section_stats["step_peak_bytes"]``: every phase of the step, the optimizer's included).

Variants:
    plain                     model.fit
    remat:<mode>              the model built under keras.RematScope(mode=<mode>) (full, activations, larger_than,
                              list_of_layers: every transformer layer named)
    recompute_grad            each transformer_layer_i's call wrapped in tf.recompute_grad (the decoder sequence
                              positional, its mask and flags closed over), then model.fit
    sect:layers               SectionedModel(model, sections=[transformer_layer_0 .. _5]) (lean attention on)
    sect:layers:nolean        the same with lean=False (lean attention and the engine's other lean gradients off)
    ends:<b1,b2,..>           SectionedModel(model, sections=[b1, b2, ..]): a fixed partition, e.g. the one auto chose
    auto:<fraction>           SectionedModel(model, sections="auto", memory_budget=<fraction> x plain's peak at
                              this length, measured earlier in the same sweep)

Sweep (each variant its own process, the variants interleaved, ``--reps`` rounds, one JSON line per run to --out):
    python docs/bench/transformer/bench_transformer.py sweep --seqs 512,1024,2048 --reps 2 --out docs/bench/transformer/sweep.jsonl
Emulated device (TF_CPU_BFC_MEM_LIMIT_IN_MB; sections.allocator then turns oneDNN off): the longest sequence, doubling:
    python docs/bench/transformer/bench_transformer.py device --mib 2048 --out docs/bench/transformer/device_2048.jsonl
Table and plot:
    python docs/bench/transformer/bench_transformer.py report docs/bench/transformer/sweep*.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HERE = os.path.dirname(os.path.abspath(__file__))
LAYERS, HIDDEN, HEADS, INTERMEDIATE, VOCAB, DROPOUT = 6, 256, 4, 1024, 512, 0.1
LAYER_NAMES = [f"transformer_layer_{i}" for i in range(LAYERS)]
VARIANTS = ["plain", "remat:full", "remat:activations", "remat:larger_than", "remat:list_of_layers",
            "recompute_grad", "sect:layers", "sect:layers:nolean", "auto:0.15"]


def one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(l.strip() for l in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if l.strip())
    return f"{type(e).__name__}: {text[:limit]}"


def run_variant(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    from sections import allocator

    allocator_line = allocator.configure()  # before TensorFlow: oneDNN on x86; with a limit: oneDNN off, BFC
    import numpy as np
    import keras
    import keras_hub
    import tensorflow as tf

    import sections

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    kind, _, option = args.variant.partition(":")
    seq, batch = args.seq, args.batch

    def build():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, num_layers=LAYERS, num_heads=HEADS,
                                                 hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE,
                                                 dropout=DROPOUT, max_sequence_length=seq)
        logits = keras.layers.Dense(VOCAB, name="lm_head")(backbone.output)
        # The backbone's own Input tensors as a list (one flat graph, the transformer layers at its top level):
        # SectionedModel refuses a dict of inputs at wrap time in this version (see the README).
        inputs = [backbone.input["token_ids"], backbone.input["padding_mask"]]
        return keras.Model(inputs, logits, name="gpt2_lm"), backbone

    keras.utils.set_random_seed(0)
    if kind == "remat":
        extra = {"layer_names": LAYER_NAMES} if option == "list_of_layers" else {}
        with keras.RematScope(mode=option, **extra):
            model, backbone = build()
    else:
        model, backbone = build()
    if kind == "recompute_grad":
        for name in LAYER_NAMES:
            layer = backbone.get_layer(name)
            original = layer.call

            def call(decoder_sequence, *rest, _original=original, **kwargs):
                def f(x):  # the sequence positional (custom_gradient takes no keywords in graph mode)
                    return _original(x, *rest, **kwargs)

                return tf.recompute_grad(f)(decoder_sequence)

            layer.call = call
    fit_model = model
    if kind == "sect":
        fit_model = sections.SectionedModel(model, sections=list(LAYER_NAMES), lean=option != "layers:nolean")
    elif kind == "ends":  # a fixed partition: the sections' last blocks, comma-separated (as auto's section_ends)
        fit_model = sections.SectionedModel(model, sections=option.split(","))
    elif kind == "auto":
        fit_model = sections.SectionedModel(model, sections="auto",
                                               memory_budget=int(args.budget) if args.budget else None)
    fit_model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    rng = np.random.default_rng(0)
    n = batch * (args.steps + args.warmup)
    windows = rng.integers(0, VOCAB, (n, seq + 1)).astype("int32")
    x = [windows[:, :-1], np.ones((n, seq), "int32")]  # token_ids, padding_mask
    y = windows[:, 1:]
    peaks, times, losses = [], [], []
    sectioned = kind in ("sect", "auto", "ends")

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            if not sectioned:
                tf.config.experimental.reset_memory_stats(device)
            if args.profile and step == args.warmup:
                tf.profiler.experimental.start(args.profile)
            self.t = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            loss = float(logs["loss"]) if logs and "loss" in logs else float("nan")  # waits for the step
            seconds = time.perf_counter() - self.t
            if sectioned:
                peak = fit_model.section_stats["step_peak_bytes"]
            else:
                peak = tf.config.experimental.get_memory_info(device)["peak"]
            losses.append(loss)
            if args.profile and step == args.warmup:
                tf.profiler.experimental.stop()
            if step >= args.warmup:
                peaks.append(peak)
                times.append(seconds)

    result = {"variant": args.variant, "seq": seq, "batch": batch, "device": device, "allocator": allocator_line,
              "limit_MiB": os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB"), "params": int(model.count_params())}
    if kind == "auto" and args.budget:
        result["budget"] = int(args.budget)
    began = time.perf_counter()
    try:
        fit_model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=[Probe()])
        result.update(peak=float(np.median(peaks)), peak_max=float(max(peaks)), seconds=float(np.median(times)),
                      seconds_min=float(min(times)), step_peaks=peaks, step_seconds=times, losses=losses)
        if not all(np.isfinite(losses)):
            result["nan"] = True
        if sectioned:
            result["sections"] = len(fit_model.engine.sections)
            result["section_ends"] = [s.block_names[-1] for s in fit_model.engine.sections]
        if kind == "auto":  # what the planner predicted for the steps, and the margins it kept
            engine = fit_model.engine
            result.update(predicted=engine.plan.predicted_peak, replans=engine.replans,
                          probe_spread=engine.calibrator.section_probe.largest_spread(),
                          dry_spread=engine.calibrator.dry_spread, budget_used=engine.memory_budget)
    except Exception as e:  # a mode that fails inside fit, or a step past the device, is an outcome
        import traceback

        result["error"] = one_line(e)
        result["oom"] = isinstance(e, (tf.errors.ResourceExhaustedError, getattr(sections, "OutOfMemory")))
        result["traceback_tail"] = [l for l in traceback.format_exc().splitlines() if l.startswith("  File ")][-40:] + traceback.format_exc().splitlines()[-4:]
        result["losses"] = losses
    result["wall"] = round(time.perf_counter() - began, 1)
    return result


def child(variant, seq, args, budget=None, env=None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--seq", str(seq), "--batch",
           str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if budget is not None:
        cmd += ["--budget", str(budget)]
    began = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][7:])
    tail = [l for l in out.stderr.strip().splitlines() if l.strip()][-6:]
    return {"variant": variant, "seq": seq, "batch": args.batch, "error": f"process exit {out.returncode}",
            "stderr_tail": tail, "oom": out.returncode in (-9, 137, -11, 139), "wall": round(time.perf_counter() - began, 1)}


def sweep(args) -> None:
    plain_peak = {}
    for rep in range(args.reps):
        for seq in [int(s) for s in args.seqs.split(",")]:
            for variant in args.variants.split(","):
                budget = None
                if variant.startswith("auto:"):
                    if seq not in plain_peak:
                        print(f"skip {variant} {seq}: no plain peak", file=sys.stderr)
                        continue
                    budget = float(variant.split(":")[1]) * plain_peak[seq]
                r = child(variant, seq, args, budget)
                r["rep"] = rep
                if variant == "plain" and "peak" in r:
                    plain_peak[seq] = r["peak"]
                with open(args.out, "a") as f:
                    f.write(json.dumps(r) + "\n")
                short = {k: r.get(k) for k in ("variant", "seq", "peak", "seconds", "sections", "error", "wall")}
                print(json.dumps(short), file=sys.stderr, flush=True)


def device(args) -> None:
    env = {**os.environ, "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(args.mib), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    for variant in args.variants.split(","):
        seq = args.start
        while seq <= args.max_seq:
            budget = None
            if variant.startswith("auto"):  # no fraction: the engine's default, the device less headroom
                variant_run = "auto:device"
            else:
                variant_run = variant
            r = child(variant_run, seq, args, budget, env)
            r["device_MiB"] = args.mib
            with open(args.out, "a") as f:
                f.write(json.dumps(r) + "\n")
            short = {k: r.get(k) for k in ("variant", "seq", "peak", "seconds", "sections", "error", "wall")}
            print(json.dumps(short), file=sys.stderr, flush=True)
            if "peak" not in r:
                break
            seq *= 2


def report(args) -> None:
    import statistics

    rows = [json.loads(l) for path in args.files for l in open(path) if l.strip()]
    sweep_rows = [r for r in rows if not r.get("limit_MiB") and "device_MiB" not in r]
    seqs = sorted({r["seq"] for r in sweep_rows})
    variants = []
    for r in sweep_rows:
        if r["variant"] not in variants:
            variants.append(r["variant"])
    print("Median over repetitions of each run's median step peak; time: the minimum over repetitions of each "
          "run's median step time; ratios against plain fit's figures at the same length from the same sweep.\n")
    print("| strategy | " + " | ".join(f"{s}: peak MiB (ratio), time ratio" for s in seqs) + " |")
    print("|---|" + "---|" * len(seqs))
    summary = {}
    for v in variants:
        cells = []
        for s in seqs:
            rs = [r for r in sweep_rows if r["variant"] == v and r["seq"] == s]
            ok = [r for r in rs if "peak" in r]
            plain = [r for r in sweep_rows if r["variant"] == "plain" and r["seq"] == s and "peak" in r]
            if not rs:
                cells.append("not run")
                continue
            if not ok:
                cells.append("fails: " + rs[0]["error"][:90])
                continue
            peak = statistics.median(r["peak"] for r in ok)
            sec = min(r["seconds"] for r in ok)
            pp = statistics.median(r["peak"] for r in plain)
            ps = min(r["seconds"] for r in plain)
            summary[(v, s)] = dict(peak=peak, seconds=sec, peak_ratio=peak / pp, time_ratio=sec / ps, runs=len(ok))
            extra = f", {ok[0]['sections']} sect." if "sections" in ok[0] else ""
            nan = " NaN!" if any(r.get("nan") for r in ok) else ""
            cells.append(f"{peak / 2**20:.0f} ({peak / pp:.3f}), {sec / ps:.2f}x ({sec:.1f} s){extra}{nan}")
        print(f"| {v} | " + " | ".join(cells) + " |")
    dev = [r for r in rows if "device_MiB" in r]
    if dev:
        print("\nEmulated device:")
        for r in dev:
            what = f"peak {r['peak'] / 2**20:.0f} MiB, {r['seconds']:.1f} s/step" if "peak" in r else r["error"][:200]
            print(f"  {r['device_MiB']} MiB {r['variant']} seq {r['seq']}: {what}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for v in variants:
            pts = sorted((s, summary[(v, s)]["peak"] / 2**20) for s in seqs if (v, s) in summary)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=v)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(seqs)
        ax.set_xticklabels([str(s) for s in seqs])
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("step peak (MiB)")
        ax.set_title(f"keras-hub GPT-2 ({LAYERS} layers, {HIDDEN} wide), batch {sweep_rows[0]['batch']}: step peak")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"\nplot: {args.plot}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["sweep", "device", "report"])
    p.add_argument("files", nargs="*")
    p.add_argument("--seqs", default="512,1024,2048")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out")
    p.add_argument("--plot")
    p.add_argument("--mib", type=int, default=2048)
    p.add_argument("--start", type=int, default=512)
    p.add_argument("--max-seq", type=int, default=32768)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    p.add_argument("--profile", help="with --variant: trace the first timed step with tf.profiler into this folder "
                   "(summed by op type with docs/bench/transformer/op_times.py)")
    args = p.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
    elif args.mode == "sweep":
        sweep(args)
    elif args.mode == "device":
        device(args)
    elif args.mode == "report":
        report(args)
    else:
        p.print_help()


if __name__ == "__main__":
    main()
