"""Every place sectionflow reads Keras (or keras-hub) internals: one function per touch point, nowhere else.

Keras has no public API for these; each function says what it reads and the releases it was written for
(``written_for``, listed in ``tf_internals.TOUCH_POINTS``). Where a Keras release no longer has what a lean
gradient reads, the function returns None and the caller runs Keras's own layer (one warning per touch point):
training stays exact, only the memory saving is lost; what ``SectionedModel`` cannot do without raises a one-line
error. TensorFlow's internals are the sibling ``tf_internals.py``'s. ``check_versions()`` (at import) warns once when
the installed Keras or TensorFlow is outside the range the test suite runs (``SUPPORTED``, as ``pyproject.toml``
declares it).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import inspect

import keras
import tensorflow as tf

from .tf_internals import written_for

__all__ = ["SUPPORTED", "check_versions", "batch_norm_axes", "autocast_dtype", "autocast", "attention_settings",
           "gemma_attention_class", "replace_method", "attention_hooks", "gemma_settings", "is_functional",
           "functional_graph", "run_through_graph", "nodes_by_depth", "outputs_struct", "operation_for_node",
           "call_context_args", "unscale_loss_for_distribution", "train_writer", "distribute_strategy",
           "loss_tracker", "symbolic_build", "optimizer_strategy", "flatten_layers"]

#: ``{package: (lowest, first unsupported)}``: the versions ``pyproject.toml`` allows; the suite runs the newest
#: and the exactness core on the lowest (``tests/test_keras_versions.py``, slow).
SUPPORTED = {"keras": ("3.10", "3.16"), "tensorflow": ("2.16", "2.22")}
_KERAS = ("keras",) + SUPPORTED["keras"]
_HUB = ("keras-hub", "0.32", "0.33")
_warned: set = set()
_ABSENT = object()


def _version(text: str) -> tuple:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_versions(versions: dict | None = None) -> list[str]:
    """The packages outside ``SUPPORTED`` (each warned about once), given ``{name: version}`` (default: installed)."""
    versions = versions or {"keras": keras.__version__, "tensorflow": tf.__version__}
    outside = []
    for name, (low, high) in SUPPORTED.items():
        have = versions.get(name)
        if have is not None and not _version(low) <= _version(have) < _version(high):
            outside.append(f"{name} {have} (supported: >={low},<{high})")
    if outside and tuple(outside) not in _warned:
        _warned.add(tuple(outside))
        warnings.warn(f"sectionflow is tested with {', '.join(outside)}: lean gradients fall back to Keras's own "
                      f"where an internal they read is missing", stacklevel=2)
    return outside


def _missing(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"sectionflow: this Keras ({keras.__version__}) has no {what}; that layer runs Keras's own "
                      f"gradient (exact, without the lean memory saving)", stacklevel=3)
    return None


# ------------------------------------------------------------------------------------------- layers
@written_for(*_KERAS)
def batch_norm_axes(layer) -> list | None:
    """``BatchNormalization``'s reduction axes (``_reduction_axes``), None when it has none (not built) or this
    Keras lacks them; with ``renorm``/``synchronized`` (attributes of later Keras releases) read as off where
    absent."""
    if not hasattr(layer, "_reduction_axes"):
        return _missing("BatchNormalization._reduction_axes")
    return None if layer._reduction_axes is None else list(layer._reduction_axes)


@written_for(*_KERAS)
def autocast_dtype():
    """The dtype of the active autocast scope (``keras.src.backend.get_autocast_scope``), or None."""
    get = getattr(getattr(keras, "src", None) and keras.src.backend, "get_autocast_scope", None)
    scope = get() if get is not None else None
    return None if scope is None else scope.dtype


@written_for(*_KERAS)
def autocast(dtype):
    """A context re-entering Keras's autocast scope for ``dtype`` (``keras.src.backend.AutocastScope``; absent: a
    one-line error, where ``autocast_dtype`` found a scope)."""
    if dtype is None:
        return contextlib.nullcontext()
    return _private(keras.src.backend, "AutocastScope", "lean gradients re-enter the autocast scope")(dtype)


@written_for(*_KERAS)
def attention_settings(layer) -> dict | None:
    """What ``MultiHeadAttention._compute_attention`` reads from its layer: the scale
    (``_inverse_sqrt_key_dim``), the dropout rate (``_dropout``) and its dropout layer's seed generator; None where
    the attention is not over the sequence axis (``_dot_product_equation``) or this Keras lacks one of them."""
    names = ("_dot_product_equation", "_inverse_sqrt_key_dim", "_dropout")
    if not all(hasattr(layer, n) for n in names):
        return _missing("MultiHeadAttention " + "/".join(names))
    if layer._dot_product_equation != "aecd,abcd->acbe":
        return None
    return {"scale": float(layer._inverse_sqrt_key_dim), "rate": float(layer._dropout),
            "seeds": getattr(getattr(layer, "_dropout_layer", None), "seed_generator", None)}


@written_for(*_HUB)
def gemma_attention_class():
    """keras-hub's ``CachedGemmaAttention`` where keras-hub is imported, else None."""
    module = sys.modules.get("keras_hub.src.models.gemma.gemma_attention")
    return getattr(module, "CachedGemmaAttention", None)


@written_for(*_KERAS)
def replace_method(cls: type, name: str, method):
    """``cls.name`` becomes ``method`` for every instance in the process, until the returned ``undo()`` puts back
    what the class itself held (or removes the override, where the class inherited the method): how lean
    gradients and lean attention route Keras layers' ``call`` and ``_compute_attention`` while a ``lean_scope`` is
    open (Keras has no hook around a layer's call; the wrapper runs the original outside ``lean_scope`` and where
    the lean version declines)."""
    own = cls.__dict__.get(name, _ABSENT)
    setattr(cls, name, method)

    def undo() -> None:
        if own is _ABSENT:
            delattr(cls, name)
        else:
            setattr(cls, name, own)

    return undo


@written_for(*_KERAS)
def attention_hooks() -> list[tuple[str, type, str]]:
    """The attention methods lean attention routes (``(key, class, method name)``): Keras's
    ``MultiHeadAttention._compute_attention``, and keras-hub's ``CachedGemmaAttention._compute_attention`` where
    keras-hub is imported."""
    hooks = [("attention", keras.layers.MultiHeadAttention, "_compute_attention")]
    gemma = gemma_attention_class()
    return hooks + ([("gemma_attention", gemma, "_compute_attention")] if gemma is not None else [])


@written_for(*_HUB)
def gemma_settings(layer) -> dict | None:
    """What keras-hub's Gemma attention reads: whether it runs the fused op, its sliding-window mask, its dropout
    layer; None where this keras-hub lacks one."""
    names = ("_use_fused_attention_op", "_mask_sliding_window", "dropout_layer", "logit_soft_cap",
             "query_head_dim_normalize", "use_sliding_window_attention")
    if not all(hasattr(layer, n) for n in names):
        return _missing("CachedGemmaAttention " + "/".join(names))
    return {"fused": layer._use_fused_attention_op(), "sliding_window": layer._mask_sliding_window,
            "seeds": getattr(layer.dropout_layer, "seed_generator", None)}


# ------------------------------------------------------------------------------------------- models
@written_for(*_KERAS)
def is_functional(model) -> bool:
    """Whether ``model`` is a Functional model (``keras.src.models.functional.Functional``: a layer graph); where
    that module is gone, whether a class of that name is among its bases."""
    try:
        from keras.src.models.functional import Functional
    except ImportError:
        return any(c.__name__ == "Functional" for c in type(model).__mro__)
    return isinstance(model, Functional)


@written_for(*_KERAS)
def functional_graph(model):
    """The Functional model holding a Sequential's layer graph (``Sequential._functional``; None unbuilt), or the
    model itself."""
    return getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model


@written_for(*_KERAS)
def run_through_graph(model, inputs, operation_fn):
    """A Functional model's graph called on ``inputs``, each layer through ``operation_fn(layer)`` (new nodes of the
    model's own layers; ``Functional._run_through_graph``, without ``call``'s input standardizing). Absent: a
    one-line error."""
    return _private(model, "_run_through_graph", "run_through_graph calls it")(inputs, operation_fn=operation_fn)


@written_for(*_KERAS)
def nodes_by_depth(fn) -> dict:
    """A Functional model's nodes by depth (``_nodes_by_depth``). Absent: a one-line error."""
    return _private(fn, "_nodes_by_depth", "from_keras cuts the model's graph by it")


@written_for(*_KERAS)
def outputs_struct(fn):
    """A Functional model's output structure (``_outputs_struct``). Absent: a one-line error."""
    return _private(fn, "_outputs_struct", "from_keras packs the model's outputs by it")


@written_for(*_KERAS)
def unscale_loss_for_distribution(loss):
    """The loss as Keras reports it under a distribution strategy (``keras.src.losses.loss``). Absent: a one-line
    error."""
    try:
        from keras.src.losses.loss import unscale_loss_for_distribution as unscale
    except ImportError:
        raise _error("keras.src.losses.loss.unscale_loss_for_distribution", "SectionedModel reports fit's loss "
                     "with it") from None
    return unscale(loss)


@written_for(*_KERAS)
def train_writer(board):
    """A ``keras.callbacks.TensorBoard``'s training summary writer (``_train_writer``). Absent: a one-line error."""
    return _private(board, "_train_writer", "SectionedModel writes each section's memory with it")


@written_for(*_KERAS)
def operation_for_node(fn, node):
    """The layer a Functional model's node runs (``Functional._get_operation_for_node``, which follows a cloned
    model's substitutions), or the node's own ``operation`` where this Keras lacks it."""
    get = getattr(fn, "_get_operation_for_node", None)
    return get(node) if get else node.operation


@written_for(*_KERAS)
def call_context_args(layer) -> tuple:
    """The call-context arguments (``training``, ...) a layer's ``call`` takes (``_call_context_args``); empty
    where this Keras lacks it (the caller then passes no ``training``: Keras's own call context supplies it)."""
    return tuple(getattr(layer, "_call_context_args", ()))


@written_for(*_KERAS)
def distribute_strategy(model):
    """The ``tf.distribute`` strategy a Keras model was made under (``Trainer._distribute_strategy``; None: none),
    or where this Keras lacks it, the strategy in scope now (None outside one)."""
    if hasattr(model, "_distribute_strategy"):
        return model._distribute_strategy
    return tf.distribute.get_strategy() if tf.distribute.has_strategy() else None


@written_for(*_KERAS)
def optimizer_strategy(optimizer, default):
    """The strategy a Keras optimizer was made under (``_distribution_strategy``), ``default`` where it has none."""
    return getattr(optimizer, "_distribution_strategy", default)


@written_for(*_KERAS)
def loss_tracker(model):
    """A compiled model's loss metric (``Trainer._loss_tracker``, the ``loss`` of ``fit``'s logs). Absent: a
    one-line error."""
    if getattr(model, "_loss_tracker", None) is None:
        raise _error("a compiled Model._loss_tracker", "SectionedModel reports fit's loss through it")
    return model._loss_tracker


@written_for(*_KERAS)
def symbolic_build(model, data_batch) -> None:
    """Build a compiled model's loss, metrics and optimizer variables from a batch's shapes, as ``fit`` does
    before its first step (``Trainer._symbolic_build(data_batch=...)``). Absent, or without ``data_batch``: a
    one-line error."""
    build = getattr(model, "_symbolic_build", None)
    if build is None or "data_batch" not in inspect.signature(build).parameters:
        raise _error("Model._symbolic_build(data_batch=...)", "SectionedModel builds fit's metrics with it")
    build(data_batch=data_batch)


def _private(owner, name: str, why: str):
    """``owner.name``, or a one-line error naming it where this Keras lacks it."""
    if not hasattr(owner, name):
        raise _error(f"{getattr(owner, '__name__', type(owner).__name__)}.{name}", why)
    return getattr(owner, name)


def _error(what: str, why: str) -> RuntimeError:
    low, high = SUPPORTED["keras"]
    return RuntimeError(f"sectionflow: this Keras ({keras.__version__}) has no {what}; {why} (written for "
                        f"keras>={low},<{high})")


@written_for(*_KERAS)
def flatten_layers(model) -> list:
    """Every layer inside ``model``, nested ones included (``Layer._flatten_layers``). Absent: a one-line error."""
    return list(_private(model, "_flatten_layers", "SectionedModel checks the model's layers with it")())


check_versions()
