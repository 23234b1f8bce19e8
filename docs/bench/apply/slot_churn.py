"""Per-step peak spread of a fixed sectioned plan, by optimizer (does slot migration move the peak?).

    TF_NUM_INTEROP_THREADS=1 PYTHONPATH=. python docs/bench/apply/slot_churn.py sgdm|adam|sgd in_backward|at_end SECTIONS STEPS
"""
import sys, time, os
from sections import allocator
allocator.configure()
import keras, numpy as np, tensorflow as tf
from sections import Engine
from models.keras_app import build_keras_app
optname, apply, sections, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
net = build_keras_app("ResNet50", 10, [96, 96, 3])
opt = {"sgdm": lambda: keras.optimizers.SGD(0.01, momentum=0.9), "sgd": lambda: keras.optimizers.SGD(0.01),
       "adam": lambda: keras.optimizers.Adam(1e-4)}[optname]()
b = 256
data = {"image": tf.constant(rng.uniform(-1, 1, (b, 96, 96, 3)).astype("float32")),
        "label": tf.constant(rng.integers(0, 10, b).astype("int32"))}
tr = Engine(net, opt, sections=sections, lean="recompute", apply=apply)
tr.build(data)
peaks, times = [], []
for _ in range(steps):
    t = time.perf_counter(); s = tr.train_step(data); times.append(time.perf_counter() - t)
    peaks.append(s["step_peak_bytes"] // 2**20)
print("RESULT", optname, apply, sections, "peaks", peaks, "spread", max(peaks[1:]) - min(peaks[1:]), "median s", round(float(np.median(times[1:])), 2), flush=True)
