"""One attention's forward and backward, `[2, 2048, 4, 64]`, causal mask, in one `tf.function`: Keras-style
attention (whole scores) against lean attention (`sections.backend.attention`), with and without dropout 0.1, and
one Philox draw of the whole weights' uniforms (what Keras's dropout draws once and lean attention twice);
with `--old REV` also lean attention as it was at git revision REV (its module extracted with `git show`).
Interleaved, median and min of `--runs` timed calls each.

    python docs/bench/transformer/attention_micro.py --old 1f7b0f1~1     # before and after the heads-first change
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
parser = argparse.ArgumentParser()
parser.add_argument("--old", help="a git revision whose sections/backend/attention.py to time too")
parser.add_argument("--runs", type=int, default=6)
args = parser.parse_args()

from sections import allocator  # noqa: E402

allocator.configure()
import tensorflow as tf  # noqa: E402

from sections.backend import attention as new  # noqa: E402

variants = {"lean": new}
if args.old:
    source = subprocess.run(["git", "show", f"{args.old}:sections/backend/attention.py"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    source = source.replace("from . import keras_internals", "from sections.backend import keras_internals")
    source = source.replace("from .graph_gradient import", "from sections.backend.graph_gradient import")
    folder = tempfile.mkdtemp()
    with open(os.path.join(folder, "old_attention.py"), "w") as f:
        f.write(source)
    sys.path.insert(0, folder)
    import old_attention  # noqa: E402

    variants[f"lean@{args.old}"] = old_attention

B, T, N, H = 2, 2048, 4, 64
q, k, v = (tf.random.normal([B, T, N, H], seed=i) for i in range(3))
mask = tf.linalg.band_part(tf.ones([B, T, T], tf.bool), -1, 0)
seed = tf.constant([1, 2], tf.int32)


def keras_style(rate):
    s = tf.einsum("btnh,bsnh->bnts", q * 0.125, k)
    s = tf.where(mask[:, None], s, -1e9)
    p = tf.where(mask[:, None], tf.nn.softmax(s, -1), 0.0)
    if rate:
        p = tf.nn.experimental.stateless_dropout(p, rate, seed)
    return tf.einsum("bnts,bsnh->btnh", p, v)


def step(forward):
    @tf.function
    def run():
        with tf.GradientTape() as tape:
            tape.watch([q, k, v])
            y = forward()
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [q, k, v])
    return run


fns = {("philox draw [2, 4, 2048, 2048]", None): tf.function(lambda: [tf.random.stateless_uniform([B, N, T, T], seed)])}
for rate in (0.0, 0.1):
    fns[("keras-style", rate)] = step(lambda rate=rate: keras_style(rate))
    for name, module in variants.items():
        fns[(name, rate)] = step(lambda m=module, rate=rate: m.attention(q, k, v, scale=0.125, mask=mask,
                                                                          dropout=rate, seed=seed, style="explicit"))
for fn in fns.values():
    fn()
times = {key: [] for key in fns}
for _ in range(args.runs):
    for key, fn in fns.items():
        began = time.perf_counter()
        fn()[0].numpy()
        times[key].append(time.perf_counter() - began)
for (name, rate), ts in times.items():
    ts = sorted(ts)
    print(f"{name:32s} dropout {rate}: median {ts[len(ts) // 2]:.3f} s, min {ts[0]:.3f} s")
