"""What a block probe of a slice reads, scaled to the real batch, against probing the real batch: the small ResNet
of tests/test_device.py (32x32x3, widths 16/32/64, depths 2/2/2) at batch 512, lean gradients, oneDNN off and the
BFC allocator as under an emulated device, one inter-op thread:
    PYTHONPATH=. python docs/bench/planner/slice_scaling.py 64 128 256 512
Prints each block's output, kept (its compiled backward's peak less the transient gradients) and stored (what a
tape keeps) bytes in MiB, as ``profile_blocks`` scales them from each slice."""
import os
import sys

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # noqa: E402

from models import build_resnet  # noqa: E402
from sections.backend.lean import lean_scope  # noqa: E402
from sections.backend.memory import MemoryMeter  # noqa: E402
from sections.backend.profile import probe_slice, profile_blocks  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)
net = build_resnet(num_classes=10, input_shape=(32, 32, 3), widths=(16, 32, 64), depths=(2, 2, 2))
batch = {"image": tf.random.normal([512, 32, 32, 3]), "label": tf.random.uniform([512], 0, 10, tf.int32)}
meter, MiB, found = MemoryMeter("CPU:0"), 2**20, {}
for pb in [int(a) for a in sys.argv[1:]] or [64, 512]:
    small, real = probe_slice(net, batch, pb)
    with lean_scope(True):
        found[pb] = {p.name: p for p in profile_blocks(net, small, real, meter)}
print("block | " + " | ".join(f"slice {pb}: out / kept / stored" for pb in found))
for name in found[next(iter(found))]:
    cells = [f"{p.output_bytes / MiB:.1f} / {p.kept_bytes / MiB:.1f} / {p.stored_bytes / MiB:.1f}"
             for p in (found[pb][name] for pb in found)]
    print(f"{name} | " + " | ".join(cells))
