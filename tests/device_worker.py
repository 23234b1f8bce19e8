"""Cases run in a child process on an emulated device of fixed memory (TF_CPU_BFC_MEM_LIMIT_IN_MB is read when
TensorFlow loads). `python tests/device_worker.py CASE` prints one JSON line.

- `recover`: `sections="auto"` trains 5 steps twice from the same start, the second time with an allocation far
  past the device injected into the third step's forward; prints both runs' losses and the re-plans.
- `restore`: a fitting dry step, two that run out of memory, the fitting one again (bytes in use between).
- `lean_count`: one lean section's dry step against what its blocks' traces count (``static_blocks``).
- `apply`: Adam's update of 12 variables of 1 MiB as the engine applies it in the backward (``Executor``): the
  peak beyond what was in use (the gradients included), and the largest variable's bytes.
- `workspace`: kernels' work buffers as ``Workspaces`` measures them in a traced convolution gradient, against the
  same kernels run directly (and how many ops it ran to measure them).
- `region`: the device's limit reserved as one region, then a tensor that fits only in one region.
- `fit`: a Keras model under plain `fit` and wrapped in `SectionedModel(model, sections="auto")`, one epoch
  each; prints how each ended and the wrapped run's step peaks.
"""

from __future__ import annotations

import json
import sys

from sections.allocator import configure

configure()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import sections  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(1)  # as the runner runs the sectioned engine: one op order


class Injector(keras.layers.Layer):
    """The identity; while `armed` holds 1, its next call disarms it and then asks for 4 GiB (out of memory)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.armed = tf.Variable(0, trainable=False, dtype=tf.int32)  # a plain variable: no state a step restores

    def call(self, x):
        n = tf.identity(self.armed.read_value())  # read before it is disarmed: a shape known only when it runs
        with tf.control_dependencies([n]):
            disarm = self.armed.assign(0)
        with tf.control_dependencies([disarm]):
            extra = tf.reduce_sum(tf.zeros(tf.reshape(n * 2**30, [1]), x.dtype))  # 4 GiB when armed, else nothing
        return x + extra * 0


def conv_model(injector=None, size=32, width=32, depth=6, classes=10):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((size, size, 3))
    h = keras.layers.Conv2D(width, 3, padding="same", name="stem")(inputs)
    for i in range(depth):
        h = keras.layers.Conv2D(width, 3, padding="same", name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i}")(h)
        h = keras.layers.ReLU(name=f"relu{i}")(h)
        if injector is not None and i == depth // 2:
            h = injector(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    outputs = keras.layers.Dense(classes, name="head")(h)
    return keras.Model(inputs, outputs)


def data(n, size=32, classes=10):
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, size, size, 3)).astype("float32"), rng.integers(0, classes, n).astype("int32")


def recover(batch=64, steps=4) -> dict:
    x, y = data(batch * steps, size=16)
    losses, replans = {}, {}
    for name in ("uninterrupted", "injected"):
        injector = Injector(name="injector")
        xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        network = sections.from_keras(conv_model(injector, size=16), loss=lambda out, b: xent(b["label"], out),
                                      inputs="image", loss_fields=["label"])
        # Lean gradients off: with room in the budget, sections=auto picks lean or plain sections by their dry
        # steps' timing, and the two round differently (losses 1.8e-6 apart after 4 steps in one CI run), so the
        # two runs would differ by that choice, not by the recovery.
        engine = sections.Engine(network, keras.optimizers.Adam(1e-3), sections="auto", lean=False)
        run = []
        for step in range(steps):
            if name == "injected" and step == 2:
                injector.armed.assign(1)
            stats = engine.train_step({"image": x[step * batch:(step + 1) * batch],
                                       "label": y[step * batch:(step + 1) * batch]})
            run.append(float(stats["loss"]))
        losses[name], replans[name] = run, list(engine.replans)
        budget = engine.memory_budget
    return {"losses": losses, "replans": replans, "budget": budget}


def fit(batch=256) -> dict:
    x, y = data(batch * 2)
    out = {}
    model = conv_model()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    try:
        model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        out["plain"] = "trained"
    except tf.errors.ResourceExhaustedError:
        out["plain"] = "out of memory"
    del model
    keras.backend.clear_session()
    import gc

    gc.collect()
    model = conv_model()
    wrapped = sections.SectionedModel(model, sections="auto")
    wrapped.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.SparseCategoricalCrossentropy(True))
    history = wrapped.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    out["sectioned"] = "trained"
    out["sectioned_loss"] = [float(v) for v in history.history["loss"]]
    out["sectioned_sections"] = len(wrapped.engine.sections)
    return out


def restore(batch=64, big=1024) -> dict:
    """A fitting dry step, dry steps of a batch the device has no memory for, the fitting one again: bytes in use
    before and after each, and the two fitting peaks."""
    x, y = data(big, size=32)
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    network = sections.from_keras(conv_model(size=32), loss=lambda out, b: xent(b["label"], out), inputs="image",
                                  loss_fields=["label"])
    engine = sections.Engine(network, keras.optimizers.Adam(1e-3), sections=3)
    small = {"image": tf.constant(x[:batch]), "label": tf.constant(y[:batch])}
    large = {"image": tf.constant(x), "label": tf.constant(y)}
    engine.build(small)

    def in_use():
        return int(tf.config.experimental.get_memory_info("CPU:0")["current"])

    out = {"before": in_use(), "first": engine.dry_step(small).peak}
    out["after_first"] = in_use()
    out["ran_out"] = [engine.dry_step(large).ran_out for _ in range(2)]
    out["after_out"] = in_use()
    out["again"] = engine.dry_step(small).peak
    out["after_again"] = in_use()
    return out


def lean_count(batch=256) -> dict:
    """One lean section of convolutions with batch norm and ReLU: its dry step's peak beyond what was in use, and
    the bytes the section's own trace counts for it (``static_cost.count_span``, what the planner adds to them)."""
    from sections.backend.static_cost import count_span

    x, y = data(batch, size=32)
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10,
                                           classifier_activation=None)
    network = sections.from_keras(model, loss=lambda out, b: xent(b["label"], out), inputs="image",
                                  loss_fields=["label"])
    engine = sections.Engine(network, keras.optimizers.Adam(1e-3), sections=1, lean=True)
    small = {"image": tf.constant(x), "label": tf.constant(y)}
    engine.build(small)
    engine.dry_step(small)  # kernels set up
    before = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    peak = engine.dry_step(small).peak
    return {"counted": count_span(network, engine.borders, 0, len(network.blocks), True), "measured": peak - before}


def apply() -> dict:
    from sections.step.executor import Executor

    variables = [keras.Variable(np.full((256, 1024), 0.5, "float32")) for _ in range(12)]
    optimizer = keras.optimizers.Adam(1e-3)
    optimizer.build(variables)
    grads = [tf.fill((256, 1024), 1e-3 * (i + 1)) for i in range(12)]
    executor = Executor.__new__(Executor)  # only what ``_apply_gradients`` reads
    executor.optimizer, executor.trainable, executor.apply_reason = optimizer, variables, None
    executor.replicas = type("OneDevice", (), {"distributed": False})()
    update = tf.function(lambda g: executor._apply_gradients(g, tuple(range(12)), True))
    update(grads)  # traced, kernels set up
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    update(grads)
    peak = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    return {"beyond": peak - before, "largest": 256 * 1024 * 4, "iterations": int(optimizer.iterations.numpy())}


def faithful(batch=256, width=1024) -> dict:
    """Training steps' peaks and the bytes in use between them, before and after dry steps of the same plan."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    h = inputs
    for _ in range(4):
        h = keras.layers.Dense(width, activation="relu")(h)  # 4 MiB kernels
    model = keras.Model(inputs, keras.layers.Dense(10)(h))
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    network = sections.from_keras(model, loss=lambda out, b: xent(b["label"], out), inputs="x",
                                  loss_fields=["label"])
    engine = sections.Engine(network, keras.optimizers.Adam(1e-3), sections=2)
    batch_ = {"x": tf.random.uniform((batch, width)), "label": tf.range(batch) % 10}
    engine.build(batch_)

    def steps():
        peaks = [engine.train_step(batch_)["step_peak_bytes"] for _ in range(3)]
        return peaks, int(tf.config.experimental.get_memory_info("CPU:0")["current"])

    before, in_use_before = steps()
    dry = [engine.dry_step(batch_).peak for _ in range(2)]
    after, in_use_after = steps()
    return {"before": before, "in_use_before": in_use_before, "dry": dry, "after": after,
            "in_use_after": in_use_after}


def workspace() -> dict:
    """Kernels' work buffers from a traced gradient of two identical 3x3 convolutions (``Workspaces``), and the
    same gradient kernels run eagerly with the allocator's peak read around each: what they held beyond their
    inputs and output. At batch 32 (32x16x16x64) and at a size whose tensors are all under 64 KiB (2x8x8x8).
    ``slack``: an op that allocates only its output (``Fill``, 4 MiB), measured where the allocator's only free
    chunk that fits is 1.5 times the output (BFC serves a request from a free chunk under twice its size whole)."""
    out = {"slack": _output_slack()}  # first, while the allocator's free chunks are few
    out.update({name: _conv_gradient_work(shape) for name, shape in (("large", [32, 16, 16, 64]),
                                                                     ("small", [2, 8, 8, 8]))})
    return out


def _output_slack() -> dict:
    from sections.backend.memory import MemoryMeter
    from sections.backend.workspace import Workspaces

    shape = [1024, 1024]  # 4 MiB of float32
    graph = tf.function(lambda: tf.fill(shape, 1.0)).get_concrete_function().graph
    fill = next(op for op in graph.get_operations() if op.type == "Fill")
    wide = tf.zeros([3 * 1024 * 1024 // 2], tf.float32)  # 6 MiB
    fence = tf.zeros([64], tf.float32)  # allocated after it: its chunk cannot merge with what lies beyond
    del wide  # a free 6 MiB chunk: the best fit for a 4 MiB request, served whole
    meter = MemoryMeter("CPU:0")
    meter.reset()
    before = meter.current()
    made = tf.fill(shape, 1.0)
    beyond_output = meter.peak() - before - made.numpy().nbytes  # what a reading net of the output's bytes shows
    del made
    counted = Workspaces(meter)(fill)
    del fence
    return {"counted": counted, "beyond_output": int(beyond_output)}


def _conv_gradient_work(shape) -> dict:
    from sections.backend.liveness import graph_memory
    from sections.backend.memory import MemoryMeter
    from sections.backend.workspace import Workspaces

    x = tf.random.uniform(shape)
    kernel = tf.random.uniform([3, 3, shape[-1], shape[-1]])

    def train(x):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = tf.nn.conv2d(tf.nn.conv2d(x, kernel, 1, "SAME"), kernel, 1, "SAME")
        return tape.gradient(y, [x, kernel])  # both: a gradient no output needs is never run, nor counted

    graph = tf.function(train).get_concrete_function(tf.TensorSpec(x.shape)).graph
    work = Workspaces(MemoryMeter("CPU:0"))
    counted = {op.type: work(op) for op in graph.get_operations() if op.type.startswith("Conv2DBackprop")}
    dy = tf.random.uniform(shape)
    filter_sizes, input_sizes = tf.constant(kernel.shape.as_list()), tf.constant(shape)
    direct = {}
    for name, run in (("Conv2DBackpropFilter", lambda: tf.raw_ops.Conv2DBackpropFilter(
            input=x, filter_sizes=filter_sizes, out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME")),
                      ("Conv2DBackpropInput", lambda: tf.raw_ops.Conv2DBackpropInput(
            input_sizes=input_sizes, filter=kernel, out_backprop=dy, strides=[1, 1, 1, 1], padding="SAME"))):
        run()
        tf.config.experimental.reset_memory_stats("CPU:0")
        result = run()
        info = tf.config.experimental.get_memory_info("CPU:0")
        direct[name] = info["peak"] - info["current"]  # held at the peak beyond the inputs and the output's chunk
        del result
    return {"counted": counted, "direct": direct, "measured_ops": len(work.cache),
            "tensor_bytes": 4 * (int(np.prod(shape)) + int(np.prod(kernel.shape))),
            "peak": graph_memory(graph).peak, "peak_with_work": graph_memory(graph, work=work).peak}


def region() -> dict:
    """The limit reserved as one region, then tensors of 1, 3, 7 and 15 MiB (a growing allocator makes a region
    for each), freed, then one of 40 MiB on a 64 MiB device: it fits only where the free memory is one region."""
    said = sections.reserve_cpu_limit()
    pieces = [tf.raw_ops.Empty(shape=[mib * 2**20], dtype=tf.uint8) for mib in (1, 3, 7, 15)]
    del pieces
    try:
        big = tf.raw_ops.Empty(shape=[40 * 2**20], dtype=tf.uint8)
        fits = int(big.shape[0]) == 40 * 2**20
    except tf.errors.ResourceExhaustedError:
        fits = False
    again = sections.reserve_cpu_limit()
    from sections.backend import device

    device._reserved.clear()  # as a process that did not reserve first
    return {"said": said, "fits": fits, "again": again, "late": sections.reserve_cpu_limit()}


if __name__ == "__main__":
    cases = {"region": region, "recover": recover, "fit": fit, "restore": restore, "lean_count": lean_count, "apply": apply,
             "faithful": faithful, "workspace": workspace}
    print(json.dumps(cases[sys.argv[1]]()))
