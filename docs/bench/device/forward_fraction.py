"""Forward time vs a whole training step (tape, Adam), the notebook ResNet at batch 2048, oneDNN off as under a
device limit: `PYTHONPATH=. python docs/bench/device/forward_fraction.py`."""
import os, time, statistics
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
import tensorflow as tf, keras, numpy as np
from models import build_resnet
net = build_resnet(num_classes=10, input_shape=(28, 28, 1))
b = 2048
batch = {"image": tf.random.normal([b, 28, 28, 1]), "label": tf.random.uniform([b], 0, 10, tf.int32)}
def fwd(batch):
    h = batch["image"]
    for blk in net.blocks:
        h = blk(h, batch, training=True)
    return net.loss(h, batch)
opt = keras.optimizers.Adam(1e-3)
fwd(batch)
vars_ = [v for blk in net.blocks for v in blk.layer.trainable_variables]
opt.build(vars_)
@tf.function
def forward(batch): return fwd(batch)
@tf.function
def step(batch):
    with tf.GradientTape() as tape:
        loss = fwd(batch)
    g = tape.gradient(loss, vars_)
    opt.apply(g, vars_)
    return loss
for f in (forward, step): f(batch)
F, S = [], []
for _ in range(5):
    t = time.perf_counter(); forward(batch).numpy(); F.append(time.perf_counter() - t)
    t = time.perf_counter(); step(batch).numpy(); S.append(time.perf_counter() - t)
f, s = statistics.median(F), statistics.median(S)
print(f"forward {f:.3f} s  step {s:.3f} s  fraction {f/s:.3f}  F={[round(x,2) for x in F]} S={[round(x,2) for x in S]}")
