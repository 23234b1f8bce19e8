"""``apply="in_backward"``: each section's gradients applied as its backward makes them, the same update as one
apply after a plain whole-graph step, and no step holding every gradient at once."""

import keras
import pytest
import tensorflow as tf

from sections import Engine, Network
from engine_nets import assert_same_variables, hard_network, make_batch, reference_train, twin_networks

OPTIMIZERS = {
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    # the step count read by each section's update: a schedule halving the rate each step, Adam's bias correction
    "adam-schedule": lambda: keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 1, 0.5)),
    "adamw-clipnorm": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1, clipnorm=0.5),
    "lion": lambda: keras.optimizers.Lion(1e-3),
}


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("sections", [4, "names"])
def test_updates_in_the_backward_equal_one_update_after_a_whole_graph_step(optimizer, sections):
    batches = [make_batch(seed=s) for s in range(3)]
    reference, net = twin_networks(hard_network, batches[0])
    reference_train(reference, batches, OPTIMIZERS[optimizer]())
    engine = Engine(net, OPTIMIZERS[optimizer](), sections=4 if sections == 4 else ["split/b", "head"],
                    apply="in_backward")
    for batch in batches:
        engine.train_step(batch)
    assert engine.apply_reason is None
    assert_same_variables(reference, net)
    assert int(engine.optimizer.iterations.numpy()) == 3
    traces = engine.trace_counts()
    assert traces["apply"] == 0 and all(traces[f"apply/section_{k}"] == 1 for k in range(len(engine.sections))
                                        if any(v.trainable for v in engine.sections[k].variables)), traces


class Twice(keras.layers.Layer):
    """Applies one Dense layer owned elsewhere: its variables are read by two sections."""

    def __init__(self, dense, **kwargs):
        super().__init__(**kwargs)
        self.dense = dense

    def call(self, x):
        return tf.tanh(self.dense(x))


def shared_network():
    shared = keras.layers.Dense(6, name="shared")
    return Network([("first", Twice(shared)), ("middle", keras.layers.Dense(6, activation="tanh")),
                    ("again", Twice(shared)), ("out", keras.layers.Dense(3))],
                   loss=lambda out, b: tf.reduce_mean(tf.square(out - b["y"])), inputs="x")


def test_a_variable_two_sections_read_is_updated_after_the_earlier_ones_backward():
    """Updated after the later section's backward, the earlier section's re-run would read the new weights."""
    def batch(seed):
        g = tf.random.Generator.from_seed(seed)
        return {"x": g.normal((8, 6)), "y": g.normal((8, 3))}

    batches = [batch(s) for s in range(3)]
    reference, net = twin_networks(shared_network, batches[0])
    reference_train(reference, batches, keras.optimizers.Adam(1e-2))
    engine = Engine(net, keras.optimizers.Adam(1e-2), sections=["middle", "again"], apply="in_backward")
    for b in batches:
        engine.train_step(b)
    shared = [i for i, v in enumerate(engine.executor.trainable) if "shared" in v.path]
    assert shared and all(i in engine.compiled.complete[0] for i in shared)  # both sections read it: the first updates it
    assert_same_variables(reference, net)


def dense_chain(width=512, depth=4):
    """Weights far larger than activations: each block a width x width Dense layer (1 MiB at width 512)."""
    blocks = [(f"dense_{i}", keras.layers.Dense(width, activation="tanh")) for i in range(depth)]
    return Network(blocks, loss=lambda out, b: tf.reduce_mean(tf.square(out)), inputs="x")


def test_no_step_holds_every_gradient_at_once():
    """At the end, the first section's backward holds the later sections' gradients until one update; in the
    backward each is applied and freed as its section finishes: the step's peak is lower by about them."""
    batch = {"x": tf.random.stateless_normal((4, 512), seed=(1, 2))}
    peaks = {}
    for apply in ("at_end", "in_backward"):
        engine = Engine(dense_chain(), keras.optimizers.SGD(0.1, momentum=0.9), sections=4, apply=apply)
        engine.train_step(batch)
        assert engine.meter.available, "no memory statistics: tests run with sections.allocator.configure()"
        before = engine.meter.current()  # what is allocated between steps (an earlier engine's weights too)
        peaks[apply] = engine.train_step(batch)["step_peak_bytes"] - before
    later = 3 * (512 * 512 + 512) * 4  # the gradients of sections 1-3, held through section 0's backward at the end
    assert peaks["at_end"] - peaks["in_backward"] >= 0.9 * later, (peaks, later)


@pytest.mark.parametrize("optimizer, reason", [
    (lambda: keras.optimizers.Nadam(), "Nadam is not one of"),
    (lambda: keras.optimizers.Adam(global_clipnorm=1.0), "global_clipnorm=1.0"),
    (lambda: keras.optimizers.SGD(use_ema=True), "use_ema=True"),
    (lambda: keras.optimizers.SGD(gradient_accumulation_steps=2), "gradient_accumulation_steps=2"),
    (lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "LossScaleOptimizer is not one of"),
])
def test_an_update_that_acts_on_every_gradient_runs_at_the_end(optimizer, reason):
    engine = Engine(hard_network(), optimizer(), sections=3)
    assert reason in engine.apply_reason
    with pytest.raises(ValueError, match=f"apply='in_backward' would not equal one update: .*{reason}"):
        Engine(hard_network(), optimizer(), sections=3, apply="in_backward")


def test_update_at_end_equals_the_reference_and_names_itself():
    batches = [make_batch(seed=s) for s in range(2)]
    reference, net = twin_networks(hard_network, batches[0])
    reference_train(reference, batches, keras.optimizers.Nadam(1e-2))
    engine = Engine(net, keras.optimizers.Nadam(1e-2), sections=3)  # auto: Nadam updates at the end
    for batch in batches:
        engine.train_step(batch)
    assert_same_variables(reference, net)
    assert Engine(hard_network(), keras.optimizers.SGD(), apply="at_end").apply_reason == "apply='at_end'"


def test_a_bad_update_setting_names_the_allowed_ones():
    with pytest.raises(ValueError, match="apply='early': must be one of auto, in_backward, at_end"):
        Engine(hard_network(), keras.optimizers.SGD(), apply="early")


def _slot_writes(opt, var, in_place: bool) -> dict:
    """Per slot written by one traced apply, the op types writing it (through the function's captured handles)."""
    from sections.step.update import assign_in_place

    fn = tf.function(lambda g: opt.apply_gradients([(g, var)]))
    with assign_in_place(opt, enabled=in_place):
        graph = fn.get_concrete_function(tf.TensorSpec(var.shape)).graph
    names = {id(inner): v.name for v in opt.variables for outer, inner in graph.captures if outer is v.value.handle}
    writes: dict = {}
    for op in graph.get_operations():
        if op.type in ("AssignVariableOp", "ResourceStridedSliceAssign") and id(op.inputs[0]) in names:
            writes.setdefault(names[id(op.inputs[0])], set()).add(op.type)
    return writes


@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Lion"])
def test_slots_are_written_into_their_own_buffers(name):
    """Keras assigns a slot a new value whose buffer the variable adopts (AssignVariableOp), so slots move around
    the heap every step; within ``assign_in_place`` the value is copied into the slot's buffer."""
    var = keras.Variable(tf.ones((4, 3)))
    opt = getattr(keras.optimizers, name)(0.1, **({"momentum": 0.9} if name in ("SGD", "RMSprop") else {}))
    opt.build([var])
    slots = {v.name for v in opt.variables if len(v.shape)}
    keras_writes, ours = _slot_writes(opt, var, in_place=False), _slot_writes(opt, var, in_place=True)
    assert slots and {k: keras_writes[k] for k in slots} == {k: {"AssignVariableOp"} for k in slots}
    assert {k: ours[k] for k in slots} == {k: {"ResourceStridedSliceAssign"} for k in slots}
    assert "assign" not in vars(opt)


@pytest.mark.parametrize("apply", ["in_backward", "at_end"])
def test_the_engine_updates_slots_in_place(apply, monkeypatch):
    import sections.step.executor as engine_module
    from sections.step.update import assign_in_place

    used = []

    def spy(optimizer, enabled=True):
        used.append(enabled)
        return assign_in_place(optimizer, enabled)

    monkeypatch.setattr(engine_module, "assign_in_place", spy)
    batch = make_batch(seed=0)
    _, net = twin_networks(hard_network, batch)
    engine = Engine(net, keras.optimizers.SGD(0.05, momentum=0.9), sections=4, apply=apply)
    engine.train_step(batch)
    assert used and all(used)  # every traced update ran within it
    assert "assign" not in vars(engine.optimizer)


@pytest.mark.parametrize("name", ["SGD", "RMSprop", "Adadelta", "Lion", "Ftrl"])
def test_assignment_in_place_gives_the_same_bits(name):
    from sections.step.update import assign_in_place

    def run(in_place):
        keras.utils.set_random_seed(1)
        var = keras.Variable(tf.random.normal((5, 3)))
        opt = getattr(keras.optimizers, name)(0.1, **({"momentum": 0.9} if name in ("SGD", "RMSprop") else {}))
        step = tf.function(lambda g: opt.apply_gradients([(g, var)]))
        for k in range(3):
            with assign_in_place(opt, enabled=in_place):
                step(tf.random.stateless_normal((5, 3), (k, 7)))
        return var.numpy(), [v.numpy() for v in opt.variables]

    (w1, s1), (w2, s2) = run(True), run(False)
    assert (w1 == w2).all() and all((a == b).all() for a, b in zip(s1, s2))


def test_size_groups_pack_consecutive_variables_within_the_largest():
    from sections.step.update import size_groups

    assert size_groups([4, 1, 1, 2, 3, 1]) == [[0], [1, 2, 3], [4, 5]]
    assert size_groups([1, 1, 1, 1]) == [[0], [1], [2], [3]]
    assert size_groups([]) == []


@pytest.mark.parametrize("partial", [False, True])
def test_an_update_in_groups_equals_one_update_bit_for_bit(partial):
    """Each group reads the same step count (a schedule, Adam's bias correction) and the count advances once."""
    from sections.step.update import apply_in_groups

    def make():
        variables = [keras.Variable(tf.random.stateless_normal(shape, (i, 1))) for i, shape in
                     enumerate([(8, 8), (3,), (8, 8), (16, 4), (2,), (8, 8)])]
        grads = [tf.random.stateless_normal(v.shape, (i, 2)) for i, v in enumerate(variables)]
        optimizer = OPTIMIZERS["adam-schedule"]()
        optimizer.build(variables)
        return variables, grads, optimizer

    one, one_grads, one_opt = make()
    grouped, grouped_grads, grouped_opt = make()
    step = tf.function(lambda: apply_in_groups(grouped_opt, list(zip(grouped_grads, grouped)),
                                               [v.shape.num_elements() for v in grouped], partial))
    for _ in range(2):
        one_opt.apply_gradients(zip(one_grads, one))
        if partial:
            one_opt.iterations.assign_sub(1)
        step()
    assert all(bool(tf.reduce_all(a.value == b.value)) for a, b in zip(one, grouped))
    assert int(grouped_opt.iterations.numpy()) == int(one_opt.iterations.numpy()) == (0 if partial else 2)
