"""Plain model.fit vs keras.RematScope modes vs sections.SectionedModel.fit on a keras.applications model.

Each variant runs in its own process (``--variant``); the driver prints step peak memory and step time as
ratios to plain fit measured in the same run. Peaks read the allocator of CPU:0 (GPU:0 when there is one):
plain and RematScope variants reset its statistics at each step's start and read them at its end (a Keras
callback); SectionedModel reports the engine's own step peak (every phase of the step, the optimizer's
included; the engine resets the statistics between sections). The first ``--warmup`` steps (tracing) are
not counted; figures are the median of the other steps.

    python docs/bench/fit/bench_fit.py --model ResNet50 --size 96 --batch 32 --steps 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
VARIANTS = ["plain", "remat:full", "remat:activations", "remat:larger_than", "remat:list_of_layers",
            "sectioned:2", "sectioned:4", "sectioned:auto"]


def run_variant(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.path.insert(0, ROOT)
    import numpy as np
    import keras
    import tensorflow as tf

    import sections

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    kind, _, option = args.variant.partition(":")
    shape = (args.size, args.size, 3)
    build = lambda: getattr(keras.applications, args.model)(weights=None, input_shape=shape, classes=10)  # noqa: E731
    keras.utils.set_random_seed(0)
    if kind == "remat":
        extra = {}
        if option == "list_of_layers":  # every convolution (names from a throwaway copy)
            extra["layer_names"] = [l.name for l in build().layers if isinstance(l, keras.layers.Conv2D)]
            keras.utils.set_random_seed(0)
        with keras.RematScope(mode=option, **extra):
            model = build()
    else:
        model = build()
    fit_model = model
    if kind == "sectioned":
        if option == "auto":
            fit_model = sections.SectionedModel(model, sections="auto", memory_budget=int(args.budget))
        else:
            fit_model = sections.SectionedModel(model, sections=int(option))
    fit_model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "sparse_categorical_crossentropy")

    rng = np.random.default_rng(0)
    n = args.batch * (args.steps + args.warmup)
    x = rng.normal(size=(n, *shape)).astype("float32")
    y = rng.integers(0, 10, n)
    peaks, times = [], []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if kind != "sectioned":
                tf.config.experimental.reset_memory_stats(device)
            self.t = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            if "loss" in logs:
                float(logs["loss"])  # waits for the step
            seconds = time.perf_counter() - self.t
            if kind == "sectioned":
                peak = fit_model.section_stats["step_peak_bytes"]
            else:
                peak = tf.config.experimental.get_memory_info(device)["peak"]
            if batch >= args.warmup:
                peaks.append(peak)
                times.append(seconds)

    result = {"variant": args.variant, "device": device}
    try:
        fit_model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Probe()])
        result.update(peak=float(np.median(peaks)), seconds=float(np.median(times)))
        if kind == "sectioned":
            result["sections"] = len(fit_model.engine.sections)
    except Exception as e:  # a mode that fails inside fit is reported, not hidden
        import re

        text = " ".join(l.strip() for l in re.sub(r"\x1b\[[0-9;]*m", "", str(e)).splitlines() if l.strip())
        result["error"] = f"{type(e).__name__}: {text[:240]}"
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="ResNet50")
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return

    common = ["--model", args.model, "--size", str(args.size), "--batch", str(args.batch),
              "--steps", str(args.steps), "--warmup", str(args.warmup)]
    results, plain = [], None
    for variant in args.variants.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, *common]
        if variant == "sectioned:auto":
            if plain is None or "peak" not in plain:
                results.append({"variant": variant, "error": "needs plain fit's peak first"})
                continue
            cmd += ["--budget", str(0.5 * plain["peak"])]
        out = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
        r = json.loads(lines[-1][7:]) if lines else {"variant": variant,
                                                      "error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
        if variant == "plain":
            plain = r
        results.append(r)
        print(f"  done {variant}: {r}", file=sys.stderr, flush=True)

    print(f"{args.model} {args.size}x{args.size}, batch {args.batch}, median of {args.steps} steps after "
          f"{args.warmup} warm-up, device {plain.get('device', '?') if plain else '?'}")
    print(f"{'variant':24} {'peak MiB':>9} {'peak/plain':>10} {'time s':>8} {'time/plain':>10}  note")
    for r in results:
        if "peak" in r:
            note = f"{r['sections']} sections" if "sections" in r else ""
            if r["variant"] == "sectioned:auto":
                note += f", budget {0.5 * plain['peak'] / 2**20:.0f} MiB: " + \
                        ("within" if r["peak"] <= 0.5 * plain["peak"] else "OVER")
            print(f"{r['variant']:24} {r['peak'] / 2**20:9.0f} {r['peak'] / plain['peak']:10.3f} "
                  f"{r['seconds']:8.2f} {r['seconds'] / plain['seconds']:10.2f}  {note}")
        else:
            print(f"{r['variant']:24} {'-':>9} {'-':>10} {'-':>8} {'-':>10}  fails: {r['error']}")


if __name__ == "__main__":
    main()
