"""Per-section step peaks of ResNet50 64x64 batch 32 at 4 fixed sections against the planner's composition (base + kept
borders + upstream gradient + the section measured as one run + gradients held): the gap found at the end of issue 22
item 3 (measured 439.6 / 427.1 / 402.8 / 361.3 MiB, composed 369.9 / 369.4 / 346.7 / 314.7 MiB)."""
import sys
from sections import allocator; allocator.configure()
import keras, numpy as np, tensorflow as tf
from models.keras_app import build_keras_app
from sections import Engine
from sections.backend.profile import SectionProbe, gradient_bytes, probe_slice
from sections.backend.structure import nbytes
from sections.step.calibrate import PlanCosts
MiB = 2**20
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
B, size = 32, 64
batch = {"image": tf.constant(rng.uniform(-1, 1, size=(B, size, size, 3)).astype("float32")), "label": tf.constant(rng.integers(0, 10, B).astype("int32"))}
net = build_keras_app("ResNet50", 10, [size, size, 3])
eng = Engine(net, keras.optimizers.SGD(0.01, momentum=0.9), sections=4)
eng.build(batch)
small, real = probe_slice(net, batch, B)
probe = SectionProbe(net, small, real, eng.meter)
G = gradient_bytes(net)
base = PlanCosts.of(net, eng.optimizer, eng.borders, eng.apply_reason is None).base_bytes
n = len(net.blocks)
borders = [nbytes(eng.borders.input_specs)] + [nbytes(s) for s in eng.borders.output_specs]
acts = {(s.start, s.stop): probe(s.start, s.stop) for s in eng.sections}
for i in range(3):
    st = eng.train_step(batch)
print("measured", st["step_peak_bytes"] / MiB, [round(b / MiB, 1) for b in st["peak_bytes"]])
K = len(eng.sections)
for s in eng.sections:
    k = s.index
    held = sum(borders[x.start] for x in eng.sections[1:k + 1])  # kept inputs of sections 1..k
    up = borders[s.stop] if s.stop < n else 0
    pred = base + held + up + acts[(s.start, s.stop)] + sum(G[s.stop:])
    print(k, f"pred {pred/MiB:.1f} = base {base/MiB:.1f} held {held/MiB:.1f} up {up/MiB:.1f} act {acts[(s.start, s.stop)]/MiB:.1f} gafter {sum(G[s.stop:])/MiB:.1f}")
