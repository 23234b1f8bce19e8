"""Where the 0.25 refusal's spread comes from: the section probe's repeated runs or the dry steps' two runs."""
import sys
from sections import allocator
allocator.configure()
import keras, numpy as np, tensorflow as tf
from sections import Engine
from sections.step import engine as E
from models.keras_app import build_keras_app
budget = int(float(sys.argv[1]) * 2**20)
keras.utils.set_random_seed(0)
rng = np.random.default_rng(0)
net = build_keras_app("ResNet50", 10, [96, 96, 3])
data = {"image": tf.constant(rng.uniform(-1, 1, (256, 96, 96, 3)).astype("float32")),
        "label": tf.constant(rng.integers(0, 10, 256).astype("int32"))}
tr = Engine(net, keras.optimizers.SGD(0.01, momentum=0.9), sections="auto", memory_budget=budget, lean="recompute",
            probe_batch=64)
orig = E.Engine._dry_step
def dry(self, batch):
    before = self._dry_spread
    out = orig(self, batch)
    print("DRY", [s.stop - s.start for s in self.sections], "peak MiB", out[0] / 2**20, "secs", round(out[1], 2),
          "dry spread so far MiB", self._dry_spread / 2**20, flush=True)
    return out
E.Engine._dry_step = dry
try:
    tr.build(data)
except ValueError as err:
    print("REFUSED", str(err)[:300])
sp = sorted(tr.section_probe.spread.items(), key=lambda kv: -kv[1])[:6]
print("PROBE SPREAD MiB", [(k, round(v / 2**20, 1)) for k, v in sp])
print("probe measured", len(tr.section_probe.measured))
for _ in range(3):
    if tr._built:
        print("STEP", tr.train_step(data)["step_peak_bytes"] / 2**20, flush=True)
