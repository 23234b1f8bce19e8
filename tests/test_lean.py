"""Lean gradients (``sections.backend.lean``) against plain Keras layers, and whole models with them on.

Each reference is a fresh Keras layer (or network twin) built by its first call and differentiated by an ordinary
GradientTape, outside ``lean_scope``: it shares no code with the lean path. Gradients are compared as one vector
(distance over the reference's size); outputs and batch-norm statistics must be bit-identical (the lean forward
runs Keras's own ops).
"""

import gc
import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.framework.func_graph import FuncGraph

from sections import Engine, Network, SectionedModel
from sections.backend.lean import gradient_traces, lean_scope
from engine_nets import hard_network, make_batch, reference_train, twin_networks

# float32 gradients of a batch norm computed in closed form vs op by op differ by rounding (~1e-7 relative)
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "mixed_float16": 1e-5, "mixed_bfloat16": 1e-5}


pytestmark = pytest.mark.usefixtures("float32_after")  # tests/conftest.py


def use(policy: str) -> None:
    keras.config.set_floatx("float64" if policy == "float64" else "float32")
    keras.config.set_dtype_policy(policy)


def relative_error(ours, theirs) -> float:
    ours = [np.asarray(a, np.float64) for a in ours]
    theirs = [np.asarray(b, np.float64) for b in theirs]
    diff = np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(ours, theirs)))
    return float(diff / np.sqrt(sum(np.sum(b * b) for b in theirs)))


def run_layers(make, x, lean: bool, steps: int = 1, tape_outside: bool = False):
    """Fresh layers from ``make()`` built by their first call; ``steps`` tape steps (each with its own upstream
    gradient). Returns the last outputs, the gradients on the input and every trainable variable, and the
    non-trainable variables' values after the steps. ``tape_outside``: the layers run in a ``tf.function`` of
    their own and an eager tape differentiates its call (TensorFlow builds that function's backward itself)."""
    layers = make()

    def forward(x):
        h = x
        with lean_scope(lean):
            for layer in layers:
                h = layer(h, training=True) if isinstance(layer, keras.layers.BatchNormalization) else layer(h)
        return h

    traced = tf.function(forward)

    def step(x, seed):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = traced(x) if tape_outside else forward(x)
            upstream = tf.random.stateless_normal(tf.shape(y), seed, dtype=tf.float32)
            loss = tf.reduce_sum(tf.cast(y, tf.float32) * upstream)
        variables = [v for layer in layers for v in layer.trainable_variables]
        return y, tape.gradient(loss, [x] + variables)

    step = step if tape_outside else tf.function(step)
    for i in range(steps):
        y, grads = step(x, tf.constant([i, 7]))
    state = [v.numpy() for layer in layers for v in layer.non_trainable_variables]
    return y.numpy(), [g.numpy() for g in grads], state


def bn(**kwargs):
    return keras.layers.BatchNormalization(momentum=0.7, gamma_initializer=keras.initializers.RandomNormal(1.0, 0.3, 1),
                                           beta_initializer=keras.initializers.RandomNormal(0.0, 0.3, 2), **kwargs)


def conv(**kwargs):
    return keras.layers.Conv2D(5, 3, padding="same", kernel_initializer=keras.initializers.GlorotUniform(3), **kwargs)


def image(shape=(4, 6, 6, 3), dtype="float32"):
    x = np.random.default_rng(0).normal(2.0, 3.0, size=shape)
    return tf.constant(x, dtype=dtype)


def assert_lean_equals_plain(make, x, policy, kind="batch_norm", used=True, steps=2, tape_outside=False, lean=True):
    before = gradient_traces()[kind]
    y0, g0, s0 = run_layers(make, x, lean=False, steps=steps, tape_outside=tape_outside)
    assert gradient_traces()[kind] == before  # the plain run never builds a lean gradient
    y1, g1, s1 = run_layers(make, x, lean=lean, steps=steps, tape_outside=tape_outside)
    assert (gradient_traces()[kind] > before) == used
    np.testing.assert_array_equal(y1, y0)  # the forward is Keras's own ops
    for a, b in zip(s1, s0):
        np.testing.assert_array_equal(a, b)  # moving statistics: the same values, updated once per call
    assert [g.dtype for g in g1] == [g.dtype for g in g0]
    error = relative_error(g1, g0)
    assert error <= TOLERANCE[policy], f"relative gradient error {error:.3g}"


@pytest.mark.parametrize("policy", ["float32", "float64", "mixed_float16", "mixed_bfloat16"])
def test_batch_norm_after_a_convolution(policy):
    use(policy)
    before = gradient_traces()["recomputed"]
    x = image(dtype="float64" if policy == "float64" else "float32")
    assert_lean_equals_plain(lambda: [conv(), bn()], x, policy)
    assert gradient_traces()["recomputed"] > before  # the convolution's output was re-made, not kept


def preact_chain():
    """A pre-activation block's layers: batch norm, ReLU, convolution, twice."""
    return [bn(), keras.layers.ReLU(), conv(use_bias=False), bn(), keras.layers.Activation("relu"), conv()]


def postact_chain():
    """A post-activation bottleneck's layers: (convolution, batch norm, ReLU) twice, then a convolution."""
    return [conv(use_bias=False), bn(), keras.layers.ReLU(), conv(use_bias=False), bn(), keras.layers.ReLU(), conv()]


@pytest.mark.parametrize("chain", [preact_chain, postact_chain], ids=["pre", "post"])
@pytest.mark.parametrize("policy", ["float32", "float64", "mixed_float16", "mixed_bfloat16"])
def test_convolutions_re_make_their_inputs_under_recompute(policy, chain):
    """``lean="recompute"``: each convolution after a batch norm and ReLU re-makes its input in its backward (the
    second through the first convolution); values, gradients and statistics as plain Keras's."""
    use(policy)
    before = gradient_traces()["remade_input"]
    x = image(dtype="float64" if policy == "float64" else "float32")
    assert_lean_equals_plain(chain, x, policy, lean="recompute")
    assert gradient_traces()["remade_input"] > before


def _traced_step(lean, chain=preact_chain) -> tf.Graph:
    """The traced graph of a training step (forward and backward) of ``chain``'s layers."""
    layers = chain()

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            with lean_scope(lean):
                for layer in layers:
                    h = layer(h, training=True) if isinstance(layer, keras.layers.BatchNormalization) else layer(h)
            loss = tf.reduce_sum(h * h)
        return tape.gradient(loss, [v for layer in layers for v in layer.trainable_variables])

    return step.get_concrete_function(tf.TensorSpec([4, 6, 6, 3])).graph


def _forward_relu_readers(lean) -> set:
    """The op types reading the forward's ReLU outputs in a traced training step of ``preact_chain``."""
    graph = _traced_step(lean)
    forward = [op for op in graph.get_operations() if op.type == "Relu" and not op.control_inputs
               and op.inputs[0].op.type == "IdentityN"]  # a lean batch norm's output; re-made ones read a Cast
    assert len(forward) == 2
    return {reader.type for op in forward for reader in op.outputs[0].consumers()}


def test_under_recompute_no_backward_op_reads_a_relu_output_the_forward_made():
    """What the backward keeps is what its ops read: with ``lean=True`` the convolutions' filter gradients (and the
    ReLU's own) read the forward's ReLU outputs, so they stay alive until then; under ``"recompute"`` only the
    forward convolutions read them."""
    assert {"Conv2DBackpropFilter", "ReluGrad"} & _forward_relu_readers(True)
    assert _forward_relu_readers("recompute") == {"Conv2D"}


@pytest.mark.parametrize("chain, lean, runs", [(preact_chain, False, 2), (preact_chain, True, 3),
                                               (preact_chain, "recompute", 3), (postact_chain, False, 3),
                                               (postact_chain, True, 5), (postact_chain, "recompute", 4)])
def test_recompute_re_runs_each_convolution_at_most_once_more(chain, lean, runs):
    """Convolutions the step's results depend on (a forward made only to be differentiated is pruned): the
    forward ones, and under lean each one a batch norm follows re-made once for that batch norm's backward;
    under ``"recompute"`` the next convolution's re-made input reuses that same re-made output (not a second
    run), and in the post-activation chain the second batch norm keeps its input (a re-make would run two
    convolutions), so its convolution is not re-run at all."""
    graph = _traced_step(lean, chain)
    live, todo = set(), [t.op for t in graph.outputs]
    while todo:  # the ops the step's results depend on: what the executor runs
        op = todo.pop()
        if op not in live:
            live.add(op)
            todo += [t.op for t in op.inputs] + list(op.control_inputs)
    assert sum(op.type == "Conv2D" for op in live) == runs


@pytest.mark.parametrize("policy", ["float32", "float64", "mixed_float16"])
def test_batch_norm_alone(policy):
    use(policy)
    before = gradient_traces()["recomputed"]
    assert_lean_equals_plain(lambda: [bn()], image(dtype="float64" if policy == "float64" else "float32"), policy)
    assert gradient_traces()["recomputed"] == before  # nothing to re-make: it kept its input


@pytest.mark.parametrize("policy, shape, axis, fused", [
    ("float32", (4, 6, 6, 3), -1, True), ("mixed_float16", (4, 6, 6, 3), -1, True),
    ("mixed_bfloat16", (4, 6, 6, 3), -1, True), ("float32", (8, 6), -1, True), ("float32", (4, 5, 3), -1, True),
    ("float32", (2, 3, 4, 5, 3), -1, True), ("float64", (4, 6, 6, 3), -1, False), ("float32", (4, 3, 6, 6), 1, False)])
def test_batch_norm_backward_is_tensorflows_fused_kernel_where_it_computes_the_same(policy, shape, axis, fused):
    """Channels last with float32 statistics on CPU: one fused gradient op (any rank, viewed as NHWC);
    float64 or channels first: the closed form in TensorFlow ops. Both equal Keras's op-by-op gradient."""
    use(policy)
    before = gradient_traces()["fused"]
    x = image(shape, dtype="float64" if policy == "float64" else "float32")
    assert_lean_equals_plain(lambda: [bn(axis=axis)], x, policy)
    assert (gradient_traces()["fused"] > before) == fused


def test_batch_norm_closed_form_in_tensorflow_ops_when_the_fused_kernel_is_off(monkeypatch):
    from sections.backend import lean as _lean

    monkeypatch.setattr(_lean, "FUSED", False)
    before = gradient_traces()["fused"]
    assert_lean_equals_plain(lambda: [conv(use_bias=False), bn(), keras.layers.LeakyReLU(0.2)], image(), "float32")
    assert gradient_traces()["fused"] == before


@pytest.mark.parametrize("kwargs", [dict(center=False), dict(scale=False), dict(center=False, scale=False),
                                    dict(axis=1), dict(epsilon=0.5)], ids=str)
def test_batch_norm_options(kwargs):
    assert_lean_equals_plain(lambda: [conv(use_bias=False), bn(**kwargs)], image(), "float32")


def test_batch_norm_on_dense_features():
    x = tf.constant(np.random.default_rng(1).normal(1.0, 2.0, size=(8, 6)), tf.float32)
    dense = lambda: keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(4))  # noqa: E731
    assert_lean_equals_plain(lambda: [dense(), bn(), keras.layers.LeakyReLU(0.2)], x, "float32")


def test_lean_gradients_when_tensorflow_builds_the_traced_functions_backward():
    """A tape outside the tf.function: the gradients come from the traced ops themselves (built lazily)."""
    before = gradient_traces()
    x = tf.constant(np.random.default_rng(1).normal(1.0, 2.0, size=(8, 6)), tf.float32)
    dense = lambda: keras.layers.Dense(4, kernel_initializer=keras.initializers.GlorotUniform(4))  # noqa: E731
    assert_lean_equals_plain(lambda: [dense(), bn(), keras.layers.LeakyReLU(0.2), keras.layers.Activation("softplus")],
                             x, "float32", tape_outside=True)
    after = gradient_traces()
    assert after["recomputed"] > before["recomputed"] and after["activation"] >= before["activation"] + 2


def test_a_lean_gradient_refuses_a_forward_that_reads_a_variable():
    from sections.backend.graph_gradient import custom_gradient

    v = tf.Variable(2.0)

    @custom_gradient
    def scaled(x):
        return x * v, lambda dy: dy * v

    with pytest.raises(ValueError, match=r"scaled reads variables \['Variable:0'\] inside its forward"):
        tf.function(scaled).get_concrete_function(tf.TensorSpec([2]))


@pytest.mark.parametrize("kwargs", [dict(renorm=True), dict(synchronized=True)], ids=str)
def test_batch_norm_variants_fall_back_to_keras(kwargs):
    import inspect

    if not set(kwargs) <= set(inspect.signature(keras.layers.BatchNormalization.__init__).parameters):
        pytest.skip(f"this Keras ({keras.__version__}) has no BatchNormalization({', '.join(kwargs)}=...)")
    assert_lean_equals_plain(lambda: [bn(**kwargs)], image(), "float32", used=False)


class NamedBN(keras.layers.BatchNormalization):  # only configuration: the base class's call and moments
    def __init__(self, **kwargs):
        super().__init__(momentum=0.7, **kwargs)


class NamedConv(keras.layers.Conv2D):
    def __init__(self, **kwargs):
        super().__init__(5, 3, padding="same", kernel_initializer=keras.initializers.GlorotUniform(3), **kwargs)


class ShiftedBN(keras.layers.BatchNormalization):  # its own call around the base's: the base's part runs lean
    def call(self, inputs, training=None, mask=None):
        return super().call(inputs + 1.0, training=training, mask=mask)


class ScaledMomentsBN(keras.layers.BatchNormalization):  # its own moments, which the lean call would bypass
    def _moments(self, inputs, mask):
        mean, variance = super()._moments(inputs, mask)
        return mean, 2.0 * variance


@pytest.mark.parametrize("bn_class,remade", [(NamedBN, True), (ShiftedBN, False)], ids=["configured", "super-call"])
def test_subclasses_that_keep_what_lean_replaces_run_lean(bn_class, remade):
    before = gradient_traces()["recomputed"]
    assert_lean_equals_plain(lambda: [NamedConv(), bn_class()], image(), "float32")
    # the subclassed convolution's output is re-made; ShiftedBN's input is the shifted one, kept
    assert (gradient_traces()["recomputed"] > before) == remade


def test_a_subclass_with_its_own_moments_runs_keras_batch_norm():
    assert_lean_equals_plain(lambda: [ScaledMomentsBN()], image(), "float32", used=False)


@pytest.mark.parametrize("layer", [
    lambda: keras.layers.LeakyReLU(0.1),
    lambda: keras.layers.ReLU(negative_slope=0.3),
    lambda: keras.layers.Activation("leaky_relu"),
    lambda: keras.layers.Activation("softplus"),
], ids=["LeakyReLU", "ReLU(negative_slope)", "Activation(leaky_relu)", "Activation(softplus)"])
@pytest.mark.parametrize("policy", ["float32", "float64"])
def test_activations_from_their_output(layer, policy):
    use(policy)
    x = image(dtype="float64" if policy == "float64" else "float32")
    x = tf.concat([x, tf.zeros_like(x[:1])], 0)  # exact zeros: the derivative's choice at the kink
    assert_lean_equals_plain(lambda: [layer()], x, policy, kind="activation")


@pytest.mark.parametrize("layer", [lambda: keras.layers.ReLU(), lambda: keras.layers.ReLU(max_value=6.0),
                                   lambda: keras.layers.Activation("sigmoid")], ids=["relu", "relu6", "sigmoid"])
def test_activations_that_already_keep_their_output_are_left_alone(layer):
    assert_lean_equals_plain(lambda: [layer()], image(), "float32", kind="activation", used=False)


# ------------------------------------------------------------------------------------------------ whole models
def small_resnet():
    from models import build_resnet

    return build_resnet(num_classes=3, input_shape=(8, 8, 2), widths=[4, 8], depths=[1, 1], seed=0)


def keras_functional():
    """A Functional model cut by from_keras: conv, batch norm, leaky ReLU, a residual add and a dense batch norm."""
    inp = keras.Input((8, 8, 2), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", name="c1")(inp)
    h = keras.layers.BatchNormalization(name="b1")(h)
    h = keras.layers.LeakyReLU(0.1, name="a1")(h)
    skip = h
    h = keras.layers.Conv2D(4, 3, padding="same", name="c2")(h)
    h = keras.layers.BatchNormalization(name="b2")(h)
    h = keras.layers.Activation("softplus", name="a2")(keras.layers.Add(name="add")([h, skip]))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    h = keras.layers.Dense(6, name="d1")(h)
    h = keras.layers.BatchNormalization(name="b3")(h)
    out = keras.layers.Dense(3, name="logits")(keras.layers.ReLU(negative_slope=0.2, name="a3")(h))
    model = keras.Model(inp, out)
    loss = lambda out, batch: tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(  # noqa: E731
        batch["label"], out, from_logits=True))
    return Network.from_keras(model, loss, inputs="image")


def float64_batch(n=8):
    rng = np.random.default_rng(0)
    return {"image": tf.constant(rng.normal(size=(n, 8, 8, 2)), tf.float64),
            "label": tf.constant(rng.integers(0, 3, size=n), tf.int64)}


def keras_relu_chain():
    """A Functional model cut by from_keras: convolution, batch norm and ReLU twice, a third convolution and a skip."""
    inp = keras.Input((8, 8, 2), name="image")
    h = keras.layers.Conv2D(4, 3, padding="same", name="c1")(inp)
    skip = keras.layers.ReLU(name="a1")(keras.layers.BatchNormalization(name="b1")(h))
    h = keras.layers.Conv2D(4, 3, padding="same", name="c2")(skip)
    h = keras.layers.Activation("relu", name="a2")(keras.layers.BatchNormalization(name="b2")(h))
    h = keras.layers.Conv2D(4, 3, padding="same", name="c3")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(keras.layers.Add(name="add")([h, skip]))
    model = keras.Model(inp, keras.layers.Dense(3, name="logits")(h))
    loss = lambda out, batch: tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(  # noqa: E731
        batch["label"], out, from_logits=True))
    return Network.from_keras(model, loss, inputs="image")


@pytest.mark.parametrize("factory,sections,lean", [
    pytest.param(small_resnet, 3, True, marks=pytest.mark.slow),  # ~6 s; the from_keras case stays in the fast set
    pytest.param(small_resnet, 3, "recompute", marks=pytest.mark.slow),
    (keras_functional, ["a1", "pool"], True),
    (keras_relu_chain, 1, "recompute"),  # c2 and c3 re-make their inputs (c3's past the limit: b2 keeps its own)
    (keras_relu_chain, ["c2", "pool"], "recompute")],  # c2's input is a border: only c3
    ids=["resnet", "resnet-recompute", "from_keras", "relu-chain-recompute", "relu-chain-recompute-cut"])
def test_whole_models_with_lean_gradients_equal_a_plain_step_in_float64(factory, sections, lean):
    use("float64")
    batch = float64_batch()
    ref, net = twin_networks(factory, batch)
    before = gradient_traces()
    reference_train(ref, [batch] * 2, keras.optimizers.SGD(0.1))
    assert gradient_traces() == before
    engine = Engine(net, keras.optimizers.SGD(0.1), sections=sections, lean=lean)
    for _ in range(2):
        engine.train_step(batch)
    assert gradient_traces()["batch_norm"] > before["batch_norm"]  # the lean path ran
    assert gradient_traces()["recomputed"] > before["recomputed"]
    assert (gradient_traces()["remade_input"] > before["remade_input"]) == (lean == "recompute")
    trainable = relative_error([v.numpy() for v in net.trainable_variables],
                               [v.numpy() for v in ref.trainable_variables])
    assert trainable <= 1e-12
    for a, b in zip(net.non_trainable_variables, ref.non_trainable_variables):  # statistics moved once a step
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-12, atol=1e-14, err_msg=b.path)


def _func_graphs() -> dict:
    return {id(o): o for o in gc.get_objects() if isinstance(o, FuncGraph)}


def _train_and_drop(lean: bool) -> tuple[int, list]:
    """Build an engine over a fresh from_keras model, train one step (the first section stored, so its backward is
    built lazily outside the traced function; the last differentiated by a tape inside it) and drop everything.
    Returns how many of the model's variables and the names of the engine's traced graphs still alive."""
    before = _func_graphs()
    engine = Engine(keras_functional(), keras.optimizers.SGD(0.1), sections=["pool"], policy=["store", "recompute"],
                    lean=lean)
    engine.train_step(float64_batch(4))
    variables = [weakref.ref(v) for v in engine.network.variables]
    graphs = [weakref.ref(g) for i, g in _func_graphs().items() if i not in before]
    del engine
    gc.collect()
    return sum(v() is not None for v in variables), sorted(g().name for g in graphs if g() is not None)


def test_dropped_lean_engines_leave_no_gradient_graph_or_variable_behind():
    """tf.custom_gradient inside a tf.function registers every traced gradient in TensorFlow's process-wide
    registry, which keeps the graph and the variables it captured forever; lean's own gradients must not. (A
    lean-free engine leaves one graph behind: Keras's optimizer all-reduces through tf.custom_gradient.)"""
    use("float64")
    registry = len(ops._gradient_registry.list())
    alive, plain_graphs = _train_and_drop(lean=False)
    assert alive == 0
    plain = len(ops._gradient_registry.list()) - registry  # what a lean-free engine registers (Keras's own)
    registry = len(ops._gradient_registry.list())
    traces = gradient_traces()
    for _ in range(2):
        assert _train_and_drop(lean=True) == (0, plain_graphs)
    assert gradient_traces()["batch_norm"] > traces["batch_norm"]  # the lean gradients were built and used
    assert len(ops._gradient_registry.list()) - registry == 2 * plain


@pytest.mark.slow  # ~4 s; lean is opt-in, the layer tests stay fast
def test_lean_off_builds_no_lean_gradient_and_both_equal_the_reference():
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    _, net_lean = twin_networks(hard_network, batch)
    for a, b in zip(ref.variables, net_lean.variables):
        b.assign(a)
    ref_losses = reference_train(ref, [batch], keras.optimizers.Adam(1e-2))
    before = gradient_traces()
    off = Engine(net, keras.optimizers.Adam(1e-2), sections=2, lean=False)
    losses_off = [off.train_step(batch)["loss"]]
    assert gradient_traces() == before
    on = Engine(net_lean, keras.optimizers.Adam(1e-2), sections=2, lean=True)
    losses_on = [on.train_step(batch)["loss"]]
    assert gradient_traces()["batch_norm"] > before["batch_norm"]
    np.testing.assert_allclose(losses_off, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(losses_on, ref_losses, rtol=1e-5)
    want = [v.numpy() for v in ref.variables]
    for trained in (net, net_lean):
        assert relative_error([v.numpy() for v in trained.variables], want) <= 1e-5


@pytest.mark.slow  # ~6 s each; the layer tests above cover both mixed policies in the fast set
@pytest.mark.parametrize("lean", [True, "recompute"])
@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_engine_with_lean_gradients_equals_lean_off(policy, lean):
    use(policy)
    batch = make_batch(channels=2)
    a, b = twin_networks(small_resnet, batch)
    off = Engine(a, keras.optimizers.SGD(0.05), sections=2, lean=False)
    on = Engine(b, keras.optimizers.SGD(0.05), sections=2, lean=lean)
    for _ in range(2):
        np.testing.assert_allclose(on.train_step(batch)["loss"], off.train_step(batch)["loss"], rtol=1e-3)
    assert relative_error([v.numpy() for v in b.variables], [v.numpy() for v in a.variables]) <= 1e-3


def test_sectioned_model_passes_lean_to_its_engine():
    inp = keras.Input((4,))
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(keras.layers.Dense(3, name="hidden")(inp)))
    assert SectionedModel(model, sections=1, lean=False).engine.lean is False
    assert SectionedModel(model, sections=1).engine.lean is True  # the default
    assert SectionedModel(model, sections=1, lean="recompute").engine.lean == "recompute"
    with pytest.raises(ValueError, match="lean='deep': must be true, false or recompute"):
        SectionedModel(model, sections=1, lean="deep")


def test_an_eager_forward_inside_lean_scope_keeps_no_activation():
    """Recipes (how to re-make a convolution's output) are noted only while tracing: an eager forward inside the
    scope (the planner's probe computes its borders so) must not keep every layer's input alive until the scope
    ends (at batch 2048 that grew a process past 20 GiB)."""
    from sections.backend import lean

    conv, norm = keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization()
    x = tf.random.normal((2, 8, 8, 3))
    alive = []
    with lean_scope(True):
        for _ in range(3):
            h = tf.identity(x)
            alive.append(weakref.ref(h))  # weakref.ref works on eager tensors
            norm(conv(h), training=True)
            del h
        assert not lean._recipes()
    gc.collect()
    assert all(ref() is None for ref in alive)
