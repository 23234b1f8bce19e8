"""Memory counted from a traced graph (``sections.backend.liveness``) and the per-block costs built on it."""

import keras
import numpy as np
import tensorflow as tf

from sections.allocator import kernel_crash_warning
from sections.backend.liveness import graph_memory

MiB = 2**20


def _graph(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def test_a_chain_holds_two_buffers_at_once_and_views_hold_none():
    spec = tf.TensorSpec([256, 1024], tf.float32)  # 1 MiB

    def chain(x):
        a = x * 2.0          # 1 MiB (x is the caller's)
        b = tf.reshape(a, [1024, 256])  # a view
        c = tf.exp(b) + 1.0  # exp reuses nothing it does not own last... a dies at exp: reused in place
        return tf.reduce_sum(c)

    memory = graph_memory(_graph(chain, spec))
    assert memory.peak == 1 * MiB + 4, memory  # one buffer, written in place along the chain, and the sum

    def both(x):
        a = x * 2.0
        b = x * 3.0  # a still alive: two buffers
        return a + b

    assert graph_memory(_graph(both, spec)).peak == 2 * MiB


def test_what_a_forward_leaves_its_backward_is_counted_as_kept():
    spec = tf.TensorSpec([256, 1024], tf.float32)
    split = []

    def train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.exp(x)          # exp's gradient reads its output: kept
            z = tf.reduce_sum(y * y)
        split.append(len(tf.compat.v1.get_default_graph().get_operations()))
        return tape.gradient(z, x)

    graph = _graph(train, spec)
    memory = graph_memory(graph, split[0])
    assert memory.kept >= 1 * MiB and memory.peak >= memory.kept and memory.unsized == 0


def test_unknown_shapes_are_said_not_counted():
    memory = graph_memory(_graph(lambda x: x * 2.0, tf.TensorSpec([None, 8], tf.float32)))
    assert memory.unsized == 1 and memory.peak == 0


def test_a_cpu_limit_with_onednn_not_off_is_said_before_planning():
    """A user's script: keras loaded TensorFlow before sectionflow could turn oneDNN off under the limit."""
    line = kernel_crash_warning({"TF_CPU_BFC_MEM_LIMIT_IN_MB": "455", "TF_CPU_ALLOCATOR_USE_BFC": "true"})
    assert "crash" in line and "TF_ENABLE_ONEDNN_OPTS=0" in line and "455" in line
    assert kernel_crash_warning({"TF_CPU_BFC_MEM_LIMIT_IN_MB": "455", "TF_CPU_ALLOCATOR_USE_BFC": "true",
                                 "TF_ENABLE_ONEDNN_OPTS": "0"}) is None
    assert kernel_crash_warning({}) is None


def test_block_costs_are_the_same_in_every_count_and_grow_with_the_batch():
    """Counted, not measured: two counts agree exactly (the same plan in every process), and activations grow
    with the batch."""
    from engine_nets import conv_stack, make_batch
    from sections import Engine

    figures = []
    for n in (16, 16, 32):
        engine = Engine(conv_stack(depth=3), keras.optimizers.SGD(0.1), sections="auto", memory_budget="4GiB")
        engine.build(make_batch(n=n, size=8, classes=10))
        figures.append([(p.kept_bytes, p.transient_bytes, p.output_bytes) for p in engine.profiles])
    assert figures[0] == figures[1]
    assert sum(k for k, *_ in figures[2]) > sum(k for k, *_ in figures[0])


def test_section_functions_run_with_model_pruning_off_and_others_with_the_defaults():
    """Grappler's model pruning re-wires the control edges that keep a lean gradient's re-computation in the
    backward, and its dependency optimizer turned a backward's creation-order chain into a cycle (oneDNN's kernels,
    mixed_bfloat16: "26 nodes in a cycle"); the engine's functions are called without either, every other call
    keeps TensorFlow's options."""
    from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
    from tensorflow.python.eager import context

    from sections.backend.relaxed import RelaxedFunction
    from sections.backend.tf_internals import unpruned_calls

    def pruning_off() -> bool:
        config = config_pb2.ConfigProto()
        config.ParseFromString(context.context().function_call_options.config_proto_serialized)
        rewrites = config.graph_options.rewrite_options
        dependencies_off = rewrites.dependency_optimization == rewriter_config_pb2.RewriterConfig.OFF
        assert rewrites.disable_model_pruning == dependencies_off, rewrites  # both off, or TensorFlow's defaults
        return rewrites.disable_model_pruning

    seen = []
    before = pruning_off()
    with unpruned_calls():
        seen.append(pruning_off())
    assert seen == [True] and pruning_off() == before is False

    class Spy:  # stands for the tf.function: what the options are while a RelaxedFunction calls it
        def get_concrete_function(self, *specs):
            return None

        def __call__(self, x):
            seen.append(pruning_off())
            return x

    fn = RelaxedFunction(lambda x: x, batch_args=(0,))
    fn.function = Spy()
    fn(4, tf.ones([4, 2]))
    assert seen == [True, True] and pruning_off() is False


def _measured(fn, *args) -> int:
    """The device's peak bytes beyond those in use before one call of ``fn`` (traced and run once before)."""
    fn(*args)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    out = fn(*args)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
    del out
    return peak


def test_what_a_call_would_not_run_and_views_of_views_of_inputs_hold_nothing_counted_as_run():
    """Two facts of TensorFlow's execution the count follows, each counted and measured: ops no output needs are
    pruned before a function runs (a forward output no gradient reads), and a view of a view of the caller's input
    is no new buffer (one MobileNetV2 batch-norm block at batch 64 counted two 54 MiB tensors its run never
    made)."""
    x = tf.random.uniform([16, 32, 32, 64])  # 4 MiB
    spec = tf.TensorSpec(x.shape, x.dtype)

    def dead_output(x):
        unused = tf.transpose(tf.transpose(x))  # nothing returned reads them: neither runs
        del unused
        return x * 3.0

    def view_of_view(x):
        return tf.transpose(tf.reshape(tf.identity(x), [16, -1]))  # the transpose: the only new buffer

    for fn in (dead_output, view_of_view):
        counted = graph_memory(_graph(fn, spec)).peak
        assert 4 * MiB <= counted < 4 * MiB + 4096, (fn.__name__, counted)
        measured = _measured(tf.function(fn), x)
        assert abs(measured - counted) < 4096, (fn.__name__, counted, measured)


def test_a_border_the_backward_reads_is_counted_and_one_it_does_not_is_not():
    from sections.backend.liveness import read_after

    spec = tf.TensorSpec([256, 1024], tf.float32)  # 1 MiB
    split, names = [], []

    def train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.exp(x)          # exp's gradient reads its output, not its input
        split.append(len(tf.compat.v1.get_default_graph().get_operations()))
        names.append((x.name, y.name))
        return tape.gradient(y, x)

    graph = _graph(train, spec)
    (x, y), = names
    assert read_after(graph, [y], split[0]) == 1 * MiB
    assert read_after(graph, [x], split[0]) == 0

    def square(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = x * x              # its gradient reads its input
        split.append(len(tf.compat.v1.get_default_graph().get_operations()))
        names.append((x.name, y.name))
        return tape.gradient(y, x)

    graph = _graph(square, spec)
    x, y = names[-1]
    assert read_after(graph, [x], split[-1]) == 1 * MiB and read_after(graph, [y], split[-1]) == 0


def test_slots_that_cannot_fit_the_device_are_refused_before_they_are_made():
    """Making an optimizer's slots past a device's memory fails inside a kernel (VGG16's Adam slots on a 495 MiB
    device ended the process with SIGSEGV): where they cannot fit, one line says so first."""
    import pytest

    from sections.step.calibrate import check_variables_fit, slots_per_variable

    assert slots_per_variable(keras.optimizers.Adam()) == 2
    assert slots_per_variable(keras.optimizers.SGD(momentum=0.9)) == 1
    assert slots_per_variable(keras.optimizers.SGD()) == 0

    class Net:
        trainable_variables = [keras.Variable(tf.zeros([256, 1024])), keras.Variable(tf.zeros([256, 512]))]

    adam = keras.optimizers.Adam()
    check_variables_fit(Net, adam, 10 * MiB, 14 * MiB)  # 10 + 2 x 1.5 + 1 MiB: fits
    with pytest.raises(ValueError, match=r"the optimizer's 2 slot\(s\) per variable \(3.0 MiB for 1.5 MiB of "
                                         r"trainable variables\).* need 14.0 MiB, more than the device's 13.0 MiB"):
        check_variables_fit(Net, adam, 10 * MiB, 13 * MiB)
    assert not adam.built  # nothing of the real optimizer was made
    check_variables_fit(Net, adam, 10 * MiB, None)  # no hard limit: nothing to check


def test_a_kernels_work_buffer_is_held_at_its_op_beside_what_is_live_there():
    spec = tf.TensorSpec([256, 1024], tf.float32)  # 1 MiB

    def f(x):
        a = x * 2.0                                   # 1 MiB, read last by the product
        b = tf.linalg.matmul(a, a, transpose_b=True)  # 0.25 MiB
        return tf.reduce_sum(b)

    graph = _graph(f, spec)
    assert graph_memory(graph).peak == MiB + MiB // 4
    work = graph_memory(graph, work=lambda op: 10 * MiB if op.type == "MatMul" else 0)
    assert work.peak == MiB + MiB // 4 + 10 * MiB  # a and b live while the product's buffer is
    later = graph_memory(graph, work=lambda op: 10 * MiB if op.type == "Sum" else 0)
    assert later.peak == MiB // 4 + 4 + 10 * MiB  # a freed by then


def test_a_backward_chained_in_creation_order_gets_an_edge_between_each_pair_of_compute_ops():
    from sections.backend.liveness import ALIASES, NO_BUFFER, SHAPE_ONLY
    from sections.backend.tf_internals import run_in_creation_order

    spec = tf.TensorSpec([8, 6, 6, 4], tf.float32)
    kernel = tf.ones([3, 3, 4, 4])
    marks = []

    def train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            a = tf.nn.conv2d(x, kernel, 1, "SAME")
            y = tf.nn.relu(a) + tf.nn.conv2d(x, kernel, 1, "SAME")  # two branches: either order is valid
        graph = tf.compat.v1.get_default_graph()
        marks.append(len(graph.get_operations()))
        grad = tape.gradient(y, x)
        marks.append(len(graph.get_operations()))
        run_in_creation_order(graph, *marks)
        return grad

    graph = _graph(train, spec)
    chained = [op for op in graph.get_operations()[marks[0]:marks[1]]
               if op.type not in ALIASES | NO_BUFFER | SHAPE_ONLY]
    assert len(chained) >= 4, [op.type for op in chained]  # both convolutions' input gradients, relu's, the sum's
    for before, op in zip(chained, chained[1:]):
        assert before in op.control_inputs, (before.name, op.name)
    assert not any(op.control_inputs for op in graph.get_operations()[:marks[0]])  # the forward is left alone


def test_a_chained_while_loop_gradient_runs_without_a_cycle():
    """A while loop's gradient gives the forward loop new outputs after the gradient ops that read them were made:
    chained in creation order alone, that was a cycle (a masked GRU's backward: "182 nodes in a cycle")."""
    from sections.backend.tf_internals import run_in_creation_order

    marks = []

    @tf.function
    def train(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            h = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.tanh(h) * x), [0, x])[1]
            y = tf.reduce_sum(h * h)
        graph = tf.compat.v1.get_default_graph()
        marks.append(len(graph.get_operations()))
        grad = tape.gradient(y, x)
        run_in_creation_order(graph, marks[0], len(graph.get_operations()))
        return grad

    x = tf.constant([0.5, -0.3, 0.8])
    with tf.GradientTape() as tape:  # the same gradient, unchained
        tape.watch(x)
        h = x
        for _ in range(3):
            h = tf.tanh(h) * x
        y = tf.reduce_sum(h * h)
    np.testing.assert_allclose(train(x).numpy(), tape.gradient(y, x).numpy(), rtol=1e-6)


def test_the_engine_chains_each_sections_backward_and_runs_it(monkeypatch):
    """Every re-run backward and the fused last section trace their backward through ``run_in_creation_order``,
    and the chained functions run (a control edge through a view had made a cycle under ``fit``)."""
    import keras

    from engine_nets import conv_stack, make_batch
    from sections import Engine
    from sections.step import section_functions

    seen = []
    real = section_functions.run_in_creation_order
    monkeypatch.setattr(section_functions, "run_in_creation_order",
                        lambda graph, first, last: (seen.append(graph.name), real(graph, first, last)))
    engine = Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections=2)
    reading = engine.train_step(make_batch(n=8, size=8, classes=10))
    assert reading["loss"] == reading["loss"]  # ran: a finite loss
    assert sorted(name.split("_body")[0] for name in seen) == ["fused", "rerun_backward"], seen


class _Meter:
    """A meter whose readings a test sets: each run of the op reads the next of ``readings`` (bytes held at its
    peak beyond what it left), ``current`` what is in use."""

    available, device = True, "CPU:0"

    def __init__(self, readings, current=0):
        self.readings, self.in_use, self.runs = list(readings), current, 0

    def reset(self):
        pass

    def run(self):
        self.runs += 1
        self._reading = self.readings.pop(0)

    def peak(self):
        return self.in_use + self._reading

    def current(self):
        return self.in_use


def test_a_work_buffer_is_the_least_reading_with_the_last_readings_chunks_held():
    """The allocator serves a request whole from a free chunk under twice its size, so one reading can hold that
    slack (MobileNetV2's 1x1 convolution gradients read 21.8-38.3 MiB by process); with each reading's chunk held,
    the next is served elsewhere: the least stands. No reading is taken again where the plugs would not fit well
    within the device's room, nor without a room."""
    from sections.backend.workspace import PEEL_FROM, PEELS, Workspaces

    def fn(meter):
        return lambda: meter.run()

    meter = _Meter([22 * MiB, 30 * MiB, 22 * MiB, 5 * MiB])  # after a first reading of 32 MiB
    assert Workspaces(meter, room=2**30)._peeled(fn(meter), (), 32 * MiB, 0) == 22 * MiB
    assert meter.runs == PEELS == 3  # three more readings: 22, 30, 22; the fourth is never taken
    meter = _Meter([0, 99 * MiB])
    assert Workspaces(meter, room=2**30)._peeled(fn(meter), (), 0, 0) == 0 and meter.runs == 0  # none to peel
    meter = _Meter([0])
    assert Workspaces(meter, room=2**30)._peeled(fn(meter), (), PEEL_FROM - 1, 0) == PEEL_FROM - 1  # kilobytes
    assert meter.runs == 0
    meter = _Meter([10 * MiB], current=700 * MiB)
    assert Workspaces(meter, room=900 * MiB)._peeled(fn(meter), (), 32 * MiB, 100 * MiB) == 32 * MiB  # no room
    assert meter.runs == 0
    meter = _Meter([10 * MiB])
    assert Workspaces(meter)._peeled(fn(meter), (), 32 * MiB, 0) == 32 * MiB and meter.runs == 0  # room unknown


def test_a_sections_count_holds_the_arriving_gradient_apart_from_what_its_backward_makes():
    """The engine hands a section the gradient on its output as an argument and holds it through the section's
    backward, so no kernel writes into it: the count leaves it out (the planner holds it beside the count) and
    counts every buffer the backward makes. A ReLU's gradient then writes into the ReLU's output, not into the
    arriving gradient, and the input gradient and the kernel's gradient are made beside it (MobileNetV2 at batch
    96: a batch norm's section read 81 MiB over a count that let the arriving gradient be reused)."""
    from types import SimpleNamespace

    from sections.backend.static_cost import count_span

    dense = keras.layers.Dense(256, use_bias=False)
    dense.build((None, 256))

    class Block:
        name, layer = "b", dense

        def __call__(self, h, batch, training=None):
            return tf.nn.relu(dense(h))

    spec = tf.TensorSpec([64, 256], tf.float32)
    borders = SimpleNamespace(specs_before=lambda j: spec, output_specs=[spec, spec], probe_slice={}, real_batch=64)
    network = SimpleNamespace(blocks=[Block(), Block()])
    side = 64 * 256 * 4
    # the ReLU's gradient (in its output's buffer), the input's gradient and the kernel's: the arriving gradient
    # and the input are the caller's
    assert count_span(network, borders, 0, 1, lean=False) == side + side + 256 * 256 * 4
