"""A strided 1x1 convolution's filter gradient against float64 NumPy, with oneDNN's kernels and with TensorFlow's own.

    .venv/bin/python docs/bench/exactness/onednn_pointwise.py             # both kernel sets, 200 runs per shape
    .venv/bin/python docs/bench/exactness/onednn_pointwise.py --runs 20

Each shape's ``Conv2DBackpropFilter`` (through ``tf.GradientTape`` of ``sum(conv2d(x, w, stride) ** 2)``) is run
``--runs`` times in a process with ``TF_ENABLE_ONEDNN_OPTS=1`` and in one with ``=0``; printed per shape: how many
runs were off the exact gradient by more than 1e-5 of its largest element, and the worst relative error
(``sections.backend.kernel_faults`` warns about the layers that meet the one found, uxlfoundation/oneDNN#6035).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

# (input height = width, input channels, stride)
SHAPES = [(14, 4, 2), (28, 2, 2), (28, 4, 2), (15, 4, 3), (14, 8, 2), (14, 15, 2), (14, 16, 2), (16, 4, 2),
          (14, 4, 1)]


def measure(runs: int) -> None:
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    for hw, channels, stride in SHAPES:
        x = rng.normal(size=(8, hw, hw, channels)).astype("float32")
        w = rng.normal(size=(1, 1, channels, 8)).astype("float32")
        sub = x[:, ::stride, ::stride, :].astype("float64")  # a 1x1 kernel with SAME padding reads these
        exact = np.einsum("nhwc,nhwk->ck", sub, 2 * (sub @ w[0, 0].astype("float64")))[None, None]

        @tf.function
        def grad(x, w):
            with tf.GradientTape() as tape:
                tape.watch(w)
                loss = tf.reduce_sum(tf.nn.conv2d(x, w, strides=stride, padding="SAME") ** 2)
            return tape.gradient(loss, w)

        errors = np.array([np.max(np.abs(grad(tf.constant(x), tf.constant(w)).numpy() - exact))
                           for _ in range(runs)]) / np.max(np.abs(exact))
        print(f"  {hw}x{hw}x{channels} stride {stride}: {int((errors > 1e-5).sum())} of {runs} runs off, "
              f"worst relative error {errors.max():.2g}", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        measure(args.runs)
        return
    for onednn in ("1", "0"):
        print(f"TF_ENABLE_ONEDNN_OPTS={onednn}", flush=True)
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="2")
        subprocess.run([sys.executable, __file__, "--worker", "--runs", str(args.runs)], env=env, check=True)


if __name__ == "__main__":
    main()
