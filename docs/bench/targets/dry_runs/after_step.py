"""What a real step leaves that a dry step does not: MobileNetV2 96x96 b32, budget BUDGET_MIB (argv[1]).
``PREALLOC=MIB``: one tensor of that size allocated and freed before the model is built."""
import os, sys
sys.path[:0] = ["docs/bench/planner"]
from sections import allocator
allocator.configure()
import tensorflow as tf
tf.config.threading.set_inter_op_parallelism_threads(1)
import keras, numpy as np
import predictions
from sections import Engine
from sections.step.base import _as_tensors
if os.environ.get("PREALLOC"):
    _big = tf.zeros([int(os.environ["PREALLOC"]) * 2**18])  # float32: MIB * 2**18 elements
    del _big
net, batch = predictions.build("MobileNetV2:96:32")
e = Engine(net, keras.optimizers.SGD(0.01, momentum=0.9), sections="auto", memory_budget=int(sys.argv[1]) * 2**20)
e.build(batch)
M = lambda b: round(b / 2**20, 1)
tb = e.replicas.split(dict(_as_tensors(e.network, batch)))
cur = lambda: M(tf.config.experimental.get_memory_info("CPU:0")["current"])
print("in use after build", cur(), "plan", M(e.plan.predicted_peak))
print("dry", M(e._dry_step(tb)[0]), "in use", cur())
for i in range(3):
    print("step", M(e.train_step(batch)["step_peak_bytes"]), "in use", cur())
print("dry", M(e._dry_step(tb)[0]), "in use", cur())
print("step", M(e.train_step(batch)["step_peak_bytes"]), "in use", cur())
# A real step's update without the dry step's write-back: is it the slots' or weights' buffers?
slots = [v for v in e.optimizer.variables if "momentum" in v.path]
print("slots", len(slots), "MiB", M(sum(int(np.prod(v.shape)) * 4 for v in slots)))
