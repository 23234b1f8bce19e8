"""Lean gradients: Keras layers whose TensorFlow gradient holds more than it needs, run with one that holds less.

The forward runs Keras's own ops, so outputs and state updates are bit-identical; only what the backward reads
and the temporaries it makes change, with the same math (equal within rounding):

* ``BatchNormalization`` in training mode: the gradient keeps the layer's input (in its own dtype, not the
  float32 copy Keras makes of a float16/bfloat16 input) and the per-channel batch mean and variance, and
  computes the input's gradient in closed form, ``gamma / sigma * (dy - mean(dy) - x_hat * mean(dy * x_hat))``,
  where TensorFlow differentiates the moments and the affine step op by op (several input-sized temporaries
  at once). On a CPU-only process with float32 statistics and the channels last, that closed form is TensorFlow's
  fused kernel (``FusedBatchNormGradV3``, oneDNN's where TensorFlow uses oneDNN): one input-sized result, no
  temporaries, 2-3x faster than the closed form in TensorFlow ops with oneDNN (as fast without). Renorm,
  synchronized statistics, a mask, a frozen layer or inference mode: Keras's own call.
* A batch norm whose input a ``Conv1D/2D/3D``, ``DepthwiseConv2D`` or ``Dense`` layer made (inside the same
  scope) keeps nothing input-sized: its backward re-runs that layer's ``call`` on the layer's input, which the
  layer's own gradient keeps anyway (one more forward of that layer per step).
* Under ``lean_scope("recompute")``: a ``Conv``/``DepthwiseConv2D``/``Dense`` layer whose input is a lean batch
  norm's output, or a ReLU (ReLU6) of one, keeps nothing of that input either: its output's own gradient is
  stopped and replaced by one that re-makes the input from what the batch norm keeps (its input, or its
  producer's recipe) and runs TensorFlow's gradient of the layer (and the ReLU) there. A re-make runs at most
  ``MAX_REMADE_PRODUCERS`` producer calls; past that, the batch norm keeps its input. A producer's re-made output
  is made once per graph: the next layer's re-made input and the batch norm's backward (which runs right after)
  share it. In a pre-activation residual block only the block's input stays for the backward, for one more run
  of the first convolution (as with ``lean=True``).
* ``LeakyReLU`` (and ``Activation``/``ReLU`` computing a leaky ReLU) and ``softplus``: the derivative from the
  output (TensorFlow's keeps the input, a tensor nothing else may need). ReLU, ReLU6, sigmoid, tanh, ELU and
  SELU already differentiate from their output in TensorFlow: nothing to gain, left alone.

The custom gradients are ``graph_gradient.custom_gradient``: inside a ``tf.function`` each lives on its traced op
and dies with the graph (``tf.custom_gradient`` would register it in TensorFlow's global registry, which keeps the
graph and what it captured for the life of the process).

Lean calls apply only inside ``lean_scope()`` (the engine enters it while tracing a section's training run),
and only where one of these classes' own ``call`` runs: for a layer of the class, of a subclass that keeps that
``call``, or through a subclass's ``super().call``, unless the subclass overrides a method the class's call uses
that the lean one does not (batch norm's ``_moments``). Outside it every layer runs its own ``call``.

The classes are patched only while a lean scope is open: entering the process's first open (enabled) scope, on
any thread, replaces their ``call`` (and the attention classes' ``_compute_attention``) with a router to the lean
version, and leaving the last open one puts Keras's own methods back (a count under a lock). While they are
patched, a thread outside every scope runs each layer's own ``call`` through the router; once no scope is open,
Keras's classes are untouched, and a model trained without the engine runs no code of this project. A function
traced inside the scope keeps what it traced; a retrace runs its Python again, inside the scope where the engine
entered it in the traced body (``SectionFunctions._run``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from typing import Callable, NamedTuple

import keras
import tensorflow as tf

from ..rules import check_lean
from . import attention
from . import keras_internals as internals
from .graph_gradient import custom_gradient

__all__ = ["lean_scope", "lean_active", "patched", "LEAN_LAYERS", "gradient_traces"]

_state = threading.local()
# The patches in force: ``{class or attention key: undo}``, and how many enabled lean scopes are open on all threads.
_installed: dict = {}
_open = {"scopes": 0}
_patching = threading.Lock()
# Python-side count of lean gradients built (at trace time), per kind: tests read it to prove the lean path ran.
_traces = {"batch_norm": 0, "recomputed": 0, "fused": 0, "activation": 0, "remade_input": 0}
REMAKE_PRODUCERS = True  # False: a batch norm after a producer keeps its input too (benchmarks compare both)
FUSED = True  # False: the closed form in TensorFlow ops everywhere (benchmarks compare both)
MAX_REMADE_PRODUCERS = 1  # a re-make runs at most this many convolution/dense calls; past it, the tensor is kept
# Element-wise ops a ``"recompute"`` re-make runs again between a batch norm and the layer reading its output:
# each differentiates from its output, which its gradient would keep unless the reader bypasses it.
_REMAKE_OPS = {"Relu": tf.nn.relu, "Relu6": tf.nn.relu6}


class _Recipe(NamedTuple):
    """How to re-make a traced tensor from tensors the backward keeps anyway, and how many producer layer calls
    (convolution, dense) that runs."""
    make: Callable[[], tf.Tensor]
    producers: int


def gradient_traces() -> dict:
    """How many lean gradient graphs were built so far: ``batch_norm``, of which ``recomputed`` re-make their
    input and ``fused`` run TensorFlow's fused kernel, ``activation``, and ``remade_input`` (a convolution or dense layer re-making its input: ``"recompute"``)."""
    return dict(_traces)


def _recipes() -> dict:
    """``output.ref() -> _Recipe``, for layers called inside this thread's current lean_scope."""
    if not hasattr(_state, "recipes"):
        _state.recipes = {}
    return _state.recipes


def lean_active() -> bool:
    return bool(getattr(_state, "on", False))


def lean_attention_active() -> bool:
    """Whether attention should run lean here: inside the engine's ``lean_scope`` (``lean=True`` or
    ``"recompute"``: its training functions, and the eager forward that reads the blocks' output shapes)."""
    return lean_active()


def _remaking_inputs() -> bool:
    return getattr(_state, "on", False) == "recompute"


@contextlib.contextmanager
def lean_scope(enabled: bool | str = True):
    """Inside it (on this thread), supported Keras layers run with lean gradients; ``enabled=False``: plain;
    ``"recompute"``: lean, and a convolution or dense layer whose input a batch norm (and a ReLU) made re-makes
    that input in its backward instead of keeping it."""
    on = check_lean(enabled)
    if on:
        _acquire()
    before = getattr(_state, "on", False)
    _state.on = on
    try:
        yield
    finally:
        _state.on = before
        if not before:
            _recipes().clear()
        if on:
            _release()


def patched() -> bool:
    """Whether Keras's classes are patched now (some enabled ``lean_scope`` is open, on some thread)."""
    return bool(_installed)


def _acquire() -> None:
    """One more open scope; the patches installed where missing (all at the first; Gemma's once keras-hub is
    imported)."""
    with _patching:
        _open["scopes"] += 1
        _install()


def _release() -> None:
    """One scope fewer; the last one puts every patched method back as Keras defined it."""
    with _patching:
        _open["scopes"] -= 1
        if _open["scopes"] == 0:
            for undo in reversed(list(_installed.values())):
                undo()
            _installed.clear()


def _chain(t):
    """``(source, op, recipe)``: ``t`` is ``op(source)`` (``op`` None: ``t`` is ``source``) and ``source`` has a
    recipe running at most ``MAX_REMADE_PRODUCERS`` producers; or None."""
    recipe = _recipes().get(t.ref())
    if recipe is not None:
        return (t, None, recipe) if recipe.producers <= MAX_REMADE_PRODUCERS else None
    op = getattr(t, "op", None)
    if op is None or op.type not in _REMAKE_OPS or len(op.inputs) != 1:
        return None
    recipe = _recipes().get(op.inputs[0].ref())
    if recipe is None or recipe.producers > MAX_REMADE_PRODUCERS:
        return None
    return op.inputs[0], _REMAKE_OPS[op.type], recipe


# ---------------------------------------------------------------------------------------------- batch norm
def _batch_norm_call(layer, original, inputs, training=None, mask=None):
    """``BatchNormalization.call`` with a lean gradient, or ``NotImplemented`` to run Keras's own."""
    axes = internals.batch_norm_axes(layer)
    if (mask is not None or not training or not layer.trainable or getattr(layer, "renorm", False)
            or getattr(layer, "synchronized", False) or axes is None):
        return NotImplemented
    x = tf.convert_to_tensor(inputs)
    if not x.dtype.is_floating or x.shape.rank is None:
        return NotImplemented
    stats_dtype = tf.float64 if x.dtype == tf.float64 else tf.float32  # Keras: result_type(x, "float32")
    x_stats = tf.stop_gradient(tf.cast(x, stats_dtype))
    # Keras's own moments (ops.moments): the same values, so the moving statistics update exactly as in Keras.
    mean, variance = keras.ops.moments(x_stats, axes=axes)
    moving_mean = keras.ops.cast(layer.moving_mean, stats_dtype)
    moving_variance = keras.ops.cast(layer.moving_variance, stats_dtype)
    layer.moving_mean.assign(moving_mean * layer.momentum + mean * (1.0 - layer.momentum))
    layer.moving_variance.assign(moving_variance * layer.momentum + variance * (1.0 - layer.momentum))
    params = [keras.ops.cast(p, stats_dtype) for p in (layer.gamma if layer.scale else None,
                                                      layer.beta if layer.center else None) if p is not None]
    out_dtype = tf.as_dtype(keras.backend.standardize_dtype(layer.compute_dtype))
    count = tf.cast(tf.size(x, tf.int64) // tf.size(mean, tf.int64), stats_dtype)
    recipe = _recipes().get(x.ref()) if REMAKE_PRODUCERS else None
    if recipe is not None and recipe.producers > MAX_REMADE_PRODUCERS:
        recipe = None
    forward = functools.partial(_batch_norm_forward, axis=layer.axis, epsilon=layer.epsilon, has_scale=layer.scale,
                                has_center=layer.center, stats_dtype=stats_dtype, out_dtype=out_dtype)
    fn = _lean_batch_norm(forward, axes, layer.axis, layer.epsilon, layer.scale, layer.center, stats_dtype,
                          x.shape.rank, x.dtype, count, recipe.make if recipe is not None else None)
    y = fn(x, mean, variance, *params)
    if _remaking_inputs() and tf.inside_function():
        remake = recipe.make if recipe is not None else (lambda: x)  # x: the gradient keeps it anyway
        _recipes()[y.ref()] = _Recipe(lambda: forward(remake(), mean, variance, *params),
                                      recipe.producers if recipe is not None else 0)
    return y


def _batch_norm_forward(x, mean, variance, *params, axis, epsilon, has_scale, has_center, stats_dtype, out_dtype):
    """Keras's forward op for op: ``ops.batch_normalization`` on the float32 (or float64) copy, then the cast."""
    gamma = params[0] if has_scale else None
    beta = params[-1] if has_center else None
    y = keras.ops.batch_normalization(tf.cast(x, stats_dtype), mean, variance, axis=axis, offset=beta,
                                      scale=gamma, epsilon=epsilon)
    return tf.cast(y, out_dtype)


def _lean_batch_norm(forward, axes, axis, epsilon, has_scale, has_center, stats_dtype, rank, in_dtype, count,
                     recompute):
    """The batch norm as a custom-gradient function of ``(x, mean, variance, [gamma], [beta])``.

    ``recompute``: a function re-making ``x`` from its producer's input (a convolution or dense layer whose own
    gradient keeps that input anyway); then the backward keeps no input-sized tensor of its own."""

    @custom_gradient
    def batch_norm(x, mean, variance, *params):
        gamma = params[0] if has_scale else None
        y = forward(x, mean, variance, *params)
        kept = None if recompute is not None else x  # the grad closes over nothing input-sized but this
        fused = _fusable(x, y, axis, rank, stats_dtype)

        def grad(dy):
            _traces["batch_norm"] += 1
            # Everything waits for dy: else the executor may run it (and hold its result) during the forward.
            with tf.control_dependencies([dy]):
                if kept is None:
                    _traces["recomputed"] += 1
                    source = recompute()
                else:
                    source = tf.identity(kept)
                if fused:
                    _traces["fused"] += 1
                    return _fused_grad(source, dy, mean, variance, gamma, epsilon, has_scale, has_center)
                shape = [1] * rank
                shape[axis] = -1
                m, v = tf.reshape(mean, shape), tf.reshape(variance, shape)
                inv_std = tf.math.rsqrt(v + tf.constant(epsilon, stats_dtype))  # not via float32
                dy32 = tf.cast(dy, stats_dtype)
                centered = tf.cast(source, stats_dtype) - m
                del source
                sum_dy = tf.reduce_sum(dy32, axes, keepdims=True)
                sum_dy_xhat = tf.reduce_sum(dy32 * centered, axes, keepdims=True) * inv_std
                a = inv_std if gamma is None else inv_std * tf.reshape(gamma, shape)
                # dx = a * (dy - mean(dy) - x_hat * mean(dy * x_hat)), per-channel factors folded first
                dx = dy32 * a + centered * (-a * inv_std * sum_dy_xhat / count) - a * sum_dy / count
                del centered
                grads = [tf.cast(dx, in_dtype), None, None]
                if has_scale:
                    grads.append(tf.reshape(sum_dy_xhat, [-1]))
                if has_center:
                    grads.append(tf.reshape(sum_dy, [-1]))
            return grads

        return y, grad

    return batch_norm


def _fusable(x, y, axis, rank, stats_dtype) -> bool:
    """Whether TensorFlow's fused batch-norm gradient kernel can compute this backward: channels last, float32
    statistics of a float32/float16/bfloat16 input and output alike, on a process with CPU devices only (where the
    kernel's second statistic is the batch variance; cuDNN's is the inverse standard deviation)."""
    return (FUSED and stats_dtype == tf.float32 and x.dtype == y.dtype
            and x.dtype in (tf.float32, tf.float16, tf.bfloat16) and axis in (-1, rank - 1) and rank >= 2
            and _cpu_only())


@functools.cache
def _cpu_only() -> bool:
    return all(d.device_type == "CPU" for d in tf.config.list_logical_devices())


def _fused_grad(x, dy, mean, variance, gamma, epsilon, has_scale, has_center):
    """``[dx, None, None, dgamma?, dbeta?]`` by one ``FusedBatchNormGradV3`` (training mode: the same closed form,
    one pass; oneDNN's kernel where TensorFlow uses it), on ``x`` viewed as NHWC."""
    shape = tf.shape(x)
    channels = shape[-1]
    view = [shape[0], -1, 1, channels]  # every axis but the channels is reduced: any rank folds into NHWC
    scale = gamma if gamma is not None else tf.ones([channels], tf.float32)
    dx, dgamma, dbeta, _, _ = tf.raw_ops.FusedBatchNormGradV3(  # dy has x's dtype, gamma float32: _fusable
        y_backprop=tf.reshape(dy, view), x=tf.reshape(x, view), scale=scale,
        reserve_space_1=mean, reserve_space_2=variance, reserve_space_3=tf.zeros([0], tf.float32),
        epsilon=epsilon, data_format="NHWC", is_training=True)
    grads = [tf.reshape(dx, shape), None, None]
    if has_scale:
        grads.append(dgamma)
    if has_center:
        grads.append(dbeta)
    return grads


# ---------------------------------------------------------------------------------------------- producers
def _producer_call(layer, original, inputs, *args, **kwargs):
    """Run a convolution or dense layer as Keras does and note how to re-make its output from its input (its
    own gradient keeps that input): a batch norm reading the output then keeps nothing input-sized. Under
    ``"recompute"``, where the input is a batch norm's output (or a ReLU of one) with a recipe, the layer's own
    gradient is replaced by one that re-makes the input from that recipe: the input is not kept either."""
    if not _floating(inputs):
        return NotImplemented
    # Only while tracing: an eager recipe would keep its input tensor alive until the scope ends (every
    # activation of an eager forward run inside the scope).
    if not tf.inside_function() or layer.non_trainable_weights:  # no state a re-run could read
        return original(layer, inputs, *args, **kwargs)
    dtype = internals.autocast_dtype()  # re-entered so the re-run casts variables alike

    def run(x):
        with internals.autocast(dtype):
            return original(layer, x, *args, **kwargs)

    chain = _chain(inputs) if _remaking_inputs() else None
    out = original(layer, inputs, *args, **kwargs)
    if not _floating(out):
        return out
    if chain is None:
        _recipes()[out.ref()] = _Recipe(_once_per_graph(lambda: run(inputs)), 1)
        return out
    source, op, recipe = chain
    remake = (lambda: op(recipe.make())) if op is not None else recipe.make
    out = _remade_input(layer, run, tf.stop_gradient(out), source, op, recipe.make)
    _recipes()[out.ref()] = _Recipe(_once_per_graph(lambda: run(remake())), 1 + recipe.producers)
    return out


def _once_per_graph(make):
    """``make``, run once per graph: a re-made convolution output serves both the next layer's re-made input
    (whose backward runs first) and the batch norm's backward right after it, for one convolution run, not two."""
    made = {}  # id(graph) -> (a weak reference to the graph, its tensor); dies with the gradients holding it

    def shared():
        graph = tf.compat.v1.get_default_graph()
        entry = made.get(id(graph))
        if entry is None or entry[0]() is not graph:
            entry = made[id(graph)] = (weakref.ref(graph), make())
        return entry[1]

    return shared


def _remade_input(layer, run, out, source, op, make):
    """``out`` (the layer's output, its own gradient stopped) with a gradient that re-makes ``source`` by
    ``make``, applies ``op`` (when not None) and differentiates ``run`` (the layer's call) there: the gradient for
    ``source`` and the layer's trainable variables, TensorFlow's own gradient ops on equal values."""
    variables = list(layer.trainable_variables)

    @custom_gradient
    def remade_input(out, source, *reads):
        def grad(dy):
            _traces["remade_input"] += 1
            with tf.control_dependencies([dy]):  # else the executor may re-make it during the forward
                s = make()
            with tf.GradientTape() as tape:  # watches the variables the call reads
                tape.watch(s)
                y = run(op(s) if op is not None else s)
            grads = tape.gradient(y, [s, *variables], output_gradients=dy)
            # A variable's gradient for its read here: under autocast the read is the float16 cast, whose gradient
            # is the float16 one the float32 variable's was cast from (so the cast back is exact).
            return [None, grads[0], *[g if g is None else tf.cast(g, r.dtype) for g, r in zip(grads[1:], reads)]]

        return tf.identity(out), grad

    return remade_input(out, source, *[tf.convert_to_tensor(v.value) for v in variables])


# ---------------------------------------------------------------------------------------------- activations
def _leaky_relu(x, slope):
    @custom_gradient
    def leaky(x):
        y = tf.nn.leaky_relu(x, alpha=slope)

        def grad(dy):
            _traces["activation"] += 1
            # sign(y) == sign(x) for slope > 0; TF's LeakyReluGrad takes the slope where x <= 0, as here, and
            # holds it as a float32 attribute (hence the cast through float32).
            return tf.where(y > 0, dy, dy * tf.cast(slope, dy.dtype))

        return y, grad

    return leaky(x)


def _softplus(x):
    @custom_gradient
    def softplus(x):
        y = tf.math.softplus(x)

        def grad(dy):
            _traces["activation"] += 1
            with tf.control_dependencies([dy]):
                return dy * -tf.math.expm1(-y)  # sigmoid(x) = 1 - exp(-softplus(x))

        return y, grad

    return softplus(x)


def _lean_activation(fn, config: dict):
    """A lean version of ``keras.activations`` function ``fn`` with its arguments, or None."""
    if fn is keras.activations.leaky_relu or (fn is keras.activations.relu and config.get("negative_slope", 0.0) and
                                config.get("max_value") is None and not config.get("threshold", 0.0)):
        slope = float(config.get("negative_slope", 0.2))
        return (lambda x: _leaky_relu(x, slope)) if slope > 0 else None
    if fn is keras.activations.softplus:
        return _softplus
    return None


def _floating(x) -> bool:
    return isinstance(x, tf.Tensor) and x.dtype.is_floating


def _leaky_layer_call(layer, original, inputs, **kwargs):
    slope = float(getattr(layer, "negative_slope", 0.0))
    if not _floating(inputs) or slope <= 0:
        return NotImplemented
    return _leaky_relu(inputs, slope)


def _relu_layer_call(layer, original, inputs, **kwargs):
    fn = _lean_activation(keras.activations.relu, {"negative_slope": layer.negative_slope,
                                                   "max_value": layer.max_value, "threshold": layer.threshold})
    return fn(inputs) if fn is not None and _floating(inputs) else NotImplemented


def _activation_layer_call(layer, original, inputs, **kwargs):
    fn = _lean_activation(layer.activation, {})
    return fn(inputs) if fn is not None and _floating(inputs) else NotImplemented


LEAN_LAYERS = {
    keras.layers.BatchNormalization: _batch_norm_call,
    keras.layers.Conv1D: _producer_call,
    keras.layers.Conv2D: _producer_call,
    keras.layers.Conv3D: _producer_call,
    keras.layers.DepthwiseConv2D: _producer_call,
    keras.layers.Dense: _producer_call,
    keras.layers.LeakyReLU: _leaky_layer_call,
    keras.layers.ReLU: _relu_layer_call,
    keras.layers.Activation: _activation_layer_call,
}
# Methods a class's own call reaches through ``self`` that its lean call does not (the batch norm's computes its
# moments itself; the others run the class's call, or read only attributes). The wrapper below runs only where
# that class's call runs (a layer of it, of a subclass that keeps it, or a subclass's ``super().call``), so a
# subclass overriding none of these computes with the lean call exactly what the class's call would.
_BYPASSED = {keras.layers.BatchNormalization: ("_moments",)}
_eligible: dict = {}


def _runs_lean(layer_type: type, cls: type) -> bool:
    """Whether a layer of ``layer_type`` (``cls`` or a subclass), running ``cls``'s call, may run it lean."""
    key = (layer_type, cls)
    if key not in _eligible:
        _eligible[key] = all(getattr(layer_type, name) is getattr(cls, name) for name in _BYPASSED.get(cls, ()))
    return _eligible[key]


def _install() -> None:
    """Route each supported class's ``call`` (and ``MultiHeadAttention._compute_attention``) through its lean
    version when ``lean_scope`` is on (each class once while scopes are open; ``_release`` undoes it)."""
    _install_attention()
    for cls, lean in LEAN_LAYERS.items():
        if cls in _installed:
            continue
        original = cls.call

        @functools.wraps(original)
        def call(self, *args, __cls=cls, __original=original, __lean=lean, **kwargs):
            if lean_active() and _runs_lean(type(self), __cls):
                out = __lean(self, __original, *args, **kwargs)
                if out is not NotImplemented:
                    return out
            return __original(self, *args, **kwargs)

        _installed[cls] = internals.replace_method(cls, "call", call)


def _install_attention() -> None:
    """``MultiHeadAttention._compute_attention`` (once), and keras-hub's Gemma attention once keras-hub is imported."""
    lean = {"attention": attention.mha_compute_attention, "gemma_attention": attention.gemma_compute_attention}
    for key, cls, name in internals.attention_hooks():
        _wrap_method(key, cls, name, lean[key])


def _wrap_method(key: str, cls: type, name: str, lean) -> None:
    """``cls.name`` runs ``lean(self, original, ...)`` inside ``lean_scope``, the original where that returns
    ``NotImplemented`` or outside it."""
    if key in _installed:
        return
    original = getattr(cls, name)

    @functools.wraps(original)
    def method(self, *args, __original=original, **kwargs):
        if lean_active():
            out = lean(self, __original, *args, **kwargs)
            if out is not NotImplemented:
                return out
        return __original(self, *args, **kwargs)

    _installed[key] = internals.replace_method(cls, name, method)
