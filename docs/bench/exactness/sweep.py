"""Exactness at every cut: keras.applications models, sectioned vs a plain compiled GradientTape step.

Each model is built twice from the same seed (the reference and the one the engine cuts: nothing shared). The
check runs in float64, where rounding is about 1e-16: a hand-over error between sections shows as a relative
gradient error far above 1e-8, rounding stays below it. The batch must not be tiny: at batch 2, ResNet50's last
stage normalises two values per channel and its own float64 gradient moves by 1.5e-5 when its weights move by one
unit of rounding (6e-13 at batch 8). (In float32, graphs compiled apart fuse ops differently
and models such as ResNet50 at initialisation amplify that rounding about 1e5-fold: see ``--float32``.)

Per model: every allowed cut at once (each block its own section, ``max_blocks`` unlimited, so every border of
the model is handed over in one step), then ``--random`` partitions of 2-6 sections with random policies
(``recompute``, ``store``, ``recreate``). ``--single N`` also checks N single cuts spread along the chain one at
a time (``--single all``: every allowed cut, slow). ``--float32`` adds, for the single cuts, the float32 error
beside the whole step's own float32 rounding sensitivity (``sections.compare_with_whole``).

    python docs/bench/exactness/sweep.py                                   # all six models
    python docs/bench/exactness/sweep.py --models ResNet50 --single 8 --float32

Exits 1 if any case is above the threshold.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from sections import Engine, Network, compare_with_whole  # noqa: E402

SIZES = {"ResNet50": 32, "ResNet50V2": 32, "MobileNetV2": 32, "DenseNet121": 32, "EfficientNetB0": 32,
         "InceptionV3": 75}
THRESHOLD = 1e-8


def use(dtype: str) -> None:
    """Build layers in ``dtype`` from here on (both settings: an explicitly set global policy wins over floatx)."""
    keras.config.set_floatx(dtype)
    keras.config.set_dtype_policy(dtype)


def build(name: str, size: int, seed: int = 7):
    keras.utils.set_random_seed(seed)
    return getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=10,
                                            classifier_activation=None)


def xent(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["label"], logits, from_logits=True))


def make_batch(size: int, batch: int, dtype: str, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.uniform(-1, 1, (batch, size, size, 3)).astype(dtype)),
            "label": tf.constant(rng.integers(0, 10, batch).astype("int32"))}


def reference_gradients(model, batch) -> list:
    """A plain compiled GradientTape step of the whole model."""

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = xent(model(batch["image"], training=True), batch)
        return tape.gradient(loss, model.trainable_variables)

    return [np.asarray(g, np.float64) for g in grads()]


def relative_error(ours, theirs) -> float:
    """``|a - b| / |b|`` over every gradient as one vector."""
    diff = np.sqrt(sum(np.sum((np.asarray(a, np.float64) - b) ** 2) for a, b in zip(ours, theirs)))
    return float(diff / np.sqrt(sum(np.sum(b * b) for b in theirs)))


class Checker:
    """One model, its reference gradients and a fresh twin per engine."""

    def __init__(self, name: str, batch_size: int, dtype: str = "float64"):
        self.name, self.size, self.dtype = name, SIZES[name], dtype
        use(dtype)
        self.batch = make_batch(self.size, batch_size, dtype)
        self.want = reference_gradients(build(name, self.size), self.batch)
        self.twin = build(name, self.size)
        self.start = [v.numpy() for v in self.twin.variables]
        self.net = Network.from_keras(self.twin, xent, inputs="image", max_blocks=100_000)

    def gradients(self, sections, policy="recompute") -> list:
        for v, value in zip(self.twin.variables, self.start):
            v.assign(value)
        _, grads = Engine(self.net, keras.optimizers.SGD(0.01), sections=sections, policy=policy).gradients(
            self.batch)
        by_variable = {id(v): g for v, g in zip(self.net.trainable_variables, grads)}
        return [by_variable[id(v)] for v in self.twin.trainable_variables]  # the reference's order

    def error(self, sections, policy="recompute") -> float:
        return relative_error(self.gradients(sections, policy), self.want)


def sweep(name: str, batch: int, partitions: int, single: str | None, float32: bool, seed: int = 0) -> list:
    rows, rng = [], random.Random(seed)
    check = Checker(name, batch)
    cuts = list(check.net.boundaries)
    t = time.time()
    rows.append((name, f"every allowed cut at once ({len(cuts)} cuts, {len(cuts) + 1} sections)", "recompute",
                 check.error(cuts), None, None, time.time() - t))
    for _ in range(partitions):
        chosen = sorted(rng.sample(range(len(cuts)), rng.randint(1, min(5, len(cuts)))))
        names = [cuts[i] for i in chosen]
        policy = [rng.choice(["recompute", "store", "recreate"]) for _ in range(len(names) + 1)]
        policy[0] = rng.choice(["recompute", "store"])  # section 0's input is the data: nothing to re-create
        policy[-1] = "recompute"  # the last section is fused (forward, loss, backward)
        t = time.time()
        rows.append((name, ", ".join(names), "/".join(p[:4] for p in policy), check.error(names, policy),
                     None, None, time.time() - t))
    if single:
        picks = cuts if single == "all" else [cuts[int((k + 0.5) * len(cuts) / int(single))]
                                              for k in range(int(single))]
        f32 = Checker(name, batch, "float32") if float32 else None
        use("float64")
        for cut in picks:
            t = time.time()
            err64 = check.error([cut])
            err32 = sens = None
            if f32 is not None:
                use("float32")
                f32_engine = Engine(f32.net, keras.optimizers.SGD(0.01), sections=[cut])
                report = compare_with_whole(f32_engine, f32.batch, examples=None)
                err32, sens = report["gradient_rel_error"], report["sensitivity"]
                use("float64")
            rows.append((name, cut, "recompute", err64, err32, sens, time.time() - t))
    use("float32")
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--random", type=int, default=3, help="random multi-cut partitions per model")
    parser.add_argument("--single", default=None, help="N single cuts spread along the model, or 'all'")
    parser.add_argument("--float32", action="store_true", help="float32 error and sensitivity for single cuts")
    args = parser.parse_args(argv)
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}; batch {args.batch}; float64 threshold "
          f"{THRESHOLD:g}\n")
    print("| model | cut(s) | policies | float64 error | float32 error | float32 sensitivity | s |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for name in args.models:
        for model, cuts, policy, err, err32, sens, secs in sweep(name, args.batch, args.random, args.single,
                                                                   args.float32):
            ok = err <= THRESHOLD
            failed += not ok
            f32 = "-" if err32 is None else f"{err32:.2g}"
            sn = "-" if sens is None else f"{sens:.2g}"
            print(f"| {model} | {cuts} | {policy} | {err:.2g}{'' if ok else ' FAIL'} | {f32} | {sn} | {secs:.0f} |",
                  flush=True)
    print(f"\n{failed} case(s) above {THRESHOLD:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
