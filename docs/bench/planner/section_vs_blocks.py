"""Issue 22 item 3's cause: a section's activations as the planner estimated them from its blocks' probe figures
(the largest over j of what blocks s..j kept plus block j's transient) against the same section measured as one
compiled run (forward, then backward with a ones upstream gradient, state untouched), for a fixed partition.

    PYTHONPATH=. python docs/bench/planner/section_vs_blocks.py ResNet50 64 32 4
"""
import sys, time
from sections import allocator; allocator.configure()
import keras, numpy as np, tensorflow as tf
from models.keras_app import build_keras_app
from sections import Engine
from sections.backend.profile import probe_slice, profile_blocks, _first_component
from sections.schedule.planner import _Chain
from sections.backend.structure import float_leaves, nbytes
from sections.backend.relaxed import RelaxedFunction
MiB = 2**20
name, size, B, nsec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
batch = {"image": tf.constant(rng.normal(size=(B, size, size, 3)).astype("float32")), "label": tf.constant(rng.integers(0, 10, B).astype("int32"))}
net = build_keras_app(name, 10, [size, size, 3], max_blocks=64)
eng = Engine(net, keras.optimizers.SGD(0.01, momentum=0.9), sections=nsec)
eng.build(batch)
small, real = probe_slice(net, batch, B)
profs = profile_blocks(net, small, real, eng.meter)
ch = _Chain(profs, nbytes(eng.borders.input_specs))
meter = eng.meter

def chain_train(s, t):
    blocks = net.blocks[s:t]
    state = [v for b in blocks for v in b.layer.non_trainable_variables]
    variables = [v for b in blocks for v in b.layer.trainable_variables]
    def train(h, snapshot):
        with tf.GradientTape() as tape:
            xs = float_leaves(h); tape.watch(xs)
            with keras.StatelessScope(state_mapping=list(zip(state, snapshot))):
                out = h
                for b in blocks:
                    out = b(out, small, training=True)
        ys = float_leaves(out)
        return tape.gradient(ys, xs + variables, output_gradients=[tf.ones_like(y) for y in ys])
    return RelaxedFunction(train, batch_args=(0,)), state

# inputs of each section: run forward
h = small[net.inputs]
borders = [h]
mapping = [(v, tf.identity(v.value)) for v in net.non_trainable_variables]
with keras.StatelessScope(state_mapping=mapping):
    for b in net.blocks:
        h = b(h, small, training=True); borders.append(h)
for s in eng.sections:
    fn, state = chain_train(s.start, s.stop)
    snap = [tf.identity(v.value) for v in state]
    x = borders[s.start]
    fn(B, x, snap)
    used = []
    for _ in range(3):
        meter.reset(); base = meter.current(); r = fn(B, x, snap); used.append((meter.peak() - base) / MiB); del r
    sec = ch.section(s.start, s.stop)
    print(f"section {s.index} blocks {s.start}..{s.stop}: estimated from blocks {sec.activation_bytes/MiB:.1f}  measured chain {used}  out {nbytes(borders[s.stop])/MiB:.1f}")
