"""Kernels' work buffers: what a kernel allocates beside its inputs and outputs while it runs, which no shape says
(TensorFlow's CPU convolution gradients unroll patches: 8-32 MiB each at keras.applications ResNet50's second
stage, batch 32). Measured once per distinct op (type, attributes, input shapes and constant inputs) by running
that op alone on the device, and added to the traced count at the op that needs it (``liveness.graph_memory``).
A kernel sizes its buffers from shapes and the machine's caches and threads; what the allocator adds (a chunk
served whole for a smaller request, which moves with what the process freed before) is read out: the outputs'
chunks are read after the run, and a buffer's reading is taken again with its chunk held (``PEELS``)."""

from __future__ import annotations

import logging
import time

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from .liveness import ALIASES, IN_PLACE, NO_BUFFER, SHAPE_ONLY, tensor_bytes

log = logging.getLogger("sections")

_SKIP = ALIASES | IN_PLACE | NO_BUFFER | SHAPE_ONLY
_OPAQUE = (tf.resource, tf.variant, tf.string)
PEELS = 3  # readings of an op's work buffers after its first, each with the chunk the last was served from held
PEEL_FROM = 2**20  # ... for readings of at least this many bytes (a smaller one moves by kilobytes)
PEEL_SHARE = 0.8  # ... taken only while what is in use, the op's tensors and twice its reading stay within this share


class Workspaces:
    """``workspaces(op)``: the bytes ``op``'s kernel allocates beside its inputs and outputs on ``device``, measured
    by running the op alone (``meter``: a ``MemoryMeter`` on that device) the first time an op like it is asked
    for; 0 for ops that cannot run alone (functions, resources, random or stateful ops). Ops of every size are
    measured: a kernel's buffer need not scale with its tensors (TensorFlow's CPU convolution gradients hold 16-32
    MiB for their patches beside 0.3 MiB of inputs and outputs at batch 16, and the same at 64; ResNet50's 146
    distinct ops measure in 5 s). ``unmeasured``: op types that could not be measured (named in the log once). ``limit``: the
    device's hard limit in bytes, where it has one: an op whose inputs and outputs would not fit beside what is in
    use is not run (a failed allocation costs TensorFlow's allocator retry, 10 s). ``room``: the device's memory
    (None: unknown): a reading is checked again with its chunk held (``PEELS``) only where that fits well within it."""

    def __init__(self, meter, device: str | None = None, limit: int | None = None, room: int | None = None):
        self.meter, self.device, self.limit, self.room = meter, device or meter.device, limit, room
        self.cache: dict = {}
        self.seconds = 0.0
        self._failed = None  # the inputs and outputs of the smallest op that ran out of memory alone
        self.unmeasured: set = set()

    def __call__(self, op) -> int:
        key = op_key(op) if self.meter.available else None
        if key is None:
            return 0
        if key not in self.cache:
            began = time.perf_counter()
            work = self._measure(op)
            self.seconds += time.perf_counter() - began
            if work is None:
                if op.type not in self.unmeasured:
                    log.info(f"planning: {op.type}'s work buffers were not measured (it cannot run alone here); "
                             f"counted as none")
                self.unmeasured.add(op.type)
            self.cache[key] = work or 0
        return self.cache[key]

    def _measure(self, op) -> int | None:
        sizes = sum(tensor_bytes(t) for t in (*op.inputs, *op.outputs))
        if (self.limit is not None and self.meter.current() + sizes > self.limit) or \
                (self._failed is not None and sizes >= self._failed):
            return None  # its inputs and outputs alone would not fit beside what is in use
        try:
            with tf.device(self.device):
                run = standalone(op)
                if run is None:
                    return None
                fn, args = run
                fn(*args)  # the first run: a GPU's algorithm search, whose trial buffers are not a step's
                work = self._peeled(fn, args, self._held_beyond(fn, args), sizes)
            del args
            return work
        except tf.errors.ResourceExhaustedError:
            self._failed = min(sizes, self._failed or sizes)
            return None
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, ValueError, TypeError):
            return None

    def _peeled(self, fn, args, work: int, sizes: int) -> int:
        """The least of ``work`` and further readings, each with the chunk the last was served from held. A reading
        is the buffers' chunks: the allocator serves a request whole from a free chunk under twice its size, so a
        reading can hold up to that much slack, by what the process freed before (MobileNetV2's 1x1 convolution
        gradients read 21.8-38.3 MiB by process). With those chunks taken, the buffers come from chunks cut to size."""
        plugs = []
        try:
            for _ in range(PEELS):
                if work < PEEL_FROM or self.room is None or \
                        self.meter.current() + sizes + 2 * work > PEEL_SHARE * self.room:
                    break
                plugs.append(tf.zeros([work], tf.uint8))
                work = min(work, self._held_beyond(fn, args))
        except tf.errors.ResourceExhaustedError:
            pass  # the device's edge: the least reading so far stands
        del plugs
        return work

    def _held_beyond(self, fn, args) -> int:
        """What one run of ``fn`` held at its peak beyond its inputs and its outputs' chunks (the outputs' own
        chunks read after the run: their slack is the allocator's, not the kernel's)."""
        self.meter.reset()
        out = fn(*args)
        peak, held = self.meter.peak(), self.meter.current()
        del out
        return max(0, peak - held)


def op_key(op):
    """What an op's work buffers depend on (type, attributes, input dtypes and shapes, constant inputs' values), or
    None for ops that allocate nothing beyond their outputs or cannot run alone."""
    if op.type in _SKIP or op.op_def.is_stateful or not op.outputs:
        return None
    if any(tensor_bytes(t) is None for t in (*op.inputs, *op.outputs)):
        return None
    if any(t.dtype in _OPAQUE for t in op.inputs) or any(a.HasField("func") or a.list.func
                                                          for a in op.node_def.attr.values()):
        return None
    attrs = tuple(sorted((k, v.SerializeToString(deterministic=True)) for k, v in op.node_def.attr.items()
                         if not k.startswith("_")))
    inputs = []
    for t in op.inputs:
        value = None if t.dtype.is_floating else static_value(t)
        inputs.append((t.dtype.name, tuple(t.shape.as_list()), None if value is None else np.asarray(value).tobytes()))
    return op.type, attrs, tuple(inputs)


def static_value(tensor):
    """A graph tensor's value where the graph fixes it (a constant, or the shape of a tensor of known shape)."""
    value = tf.get_static_value(tensor)
    op = tensor.op
    if value is None and op.type in ("Shape", "ShapeN"):
        source = op.inputs[tensor.value_index if op.type == "ShapeN" else 0]
        if source.shape.is_fully_defined():
            value = np.array(source.shape.as_list(), tensor.dtype.as_numpy_dtype)
    return value


def standalone(op):
    """A ``tf.function`` running a copy of ``op`` alone, and its arguments (zeros of the inputs' shapes; inputs
    that are not floating point take their value from the graph where it is constant); None where a non-float
    input's value is not known."""
    graph = graph_pb2.GraphDef()
    node = graph.node.add()
    node.CopyFrom(op.node_def)
    node.name, node.device = "op", ""
    del node.input[:]
    for k in [k for k in node.attr if k.startswith("_")]:
        del node.attr[k]
    args, feeds = [], {}
    for i, t in enumerate(op.inputs):
        name = f"input_{i}"
        value = None if t.dtype.is_floating else static_value(t)
        if not t.dtype.is_floating and value is None:
            return None
        source = graph.node.add()
        source.name = name
        if value is not None:
            source.op = "Const"
            source.attr["dtype"].type = t.dtype.as_datatype_enum
            source.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=t.dtype))
        else:
            source.op = "Placeholder"
            source.attr["dtype"].type = t.dtype.as_datatype_enum
            source.attr["shape"].shape.CopyFrom(t.shape.as_proto())
            feeds[f"{name}:0"] = len(args)
            args.append(tf.zeros(t.shape, t.dtype))
        node.input.append(name)
    outputs = [f"op:{k}" for k in range(len(op.outputs))]

    @tf.function(autograph=False)
    def run(*values):
        return tf.graph_util.import_graph_def(graph, input_map={n: values[k] for n, k in feeds.items()},
                                              return_elements=outputs, name="alone")

    try:
        run.get_concrete_function(*args)
    except (ValueError, TypeError, tf.errors.OpError):
        return None
    return run, args
