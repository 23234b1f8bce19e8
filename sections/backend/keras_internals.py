"""Every place sectionflow reads Keras (or keras-hub) internals: one function per touch point, nowhere else.

Keras has no public API for these; each function says what it reads. Where a Keras release no longer has what a
lean gradient reads, the function returns None and the caller runs Keras's own layer (one warning per touch
point): training stays exact, only the memory saving is lost. ``check_versions()`` (at import) warns once when
the installed Keras or TensorFlow is outside the range the test suite runs (``SUPPORTED``, as ``pyproject.toml``
declares it).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import keras
import tensorflow as tf

__all__ = ["SUPPORTED", "check_versions", "batch_norm_axes", "autocast_dtype", "autocast", "attention_settings",
           "gemma_attention_class", "gemma_settings", "is_functional", "functional_graph", "nodes_by_depth",
           "outputs_struct", "unscale_loss_for_distribution", "train_writer", "flatten_layers", "in_xla_compile"]

#: ``{package: (lowest, first unsupported)}``: the versions ``pyproject.toml`` allows; the suite runs the newest
#: and the exactness core on the lowest (``tests/test_keras_versions.py``, slow).
SUPPORTED = {"keras": ("3.10", "3.16"), "tensorflow": ("2.16", "2.22")}
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
def batch_norm_axes(layer) -> list | None:
    """``BatchNormalization``'s reduction axes (``_reduction_axes``), None when it has none (not built) or this
    Keras lacks them; with ``renorm``/``synchronized`` (attributes of later Keras releases) read as off where
    absent."""
    if not hasattr(layer, "_reduction_axes"):
        return _missing("BatchNormalization._reduction_axes")
    return None if layer._reduction_axes is None else list(layer._reduction_axes)


def autocast_dtype():
    """The dtype of the active autocast scope (``keras.src.backend.get_autocast_scope``), or None."""
    get = getattr(getattr(keras, "src", None) and keras.src.backend, "get_autocast_scope", None)
    scope = get() if get is not None else None
    return None if scope is None else scope.dtype


def autocast(dtype):
    """A context re-entering Keras's autocast scope for ``dtype`` (``keras.src.backend.AutocastScope``)."""
    return keras.src.backend.AutocastScope(dtype) if dtype is not None else contextlib.nullcontext()


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


def gemma_attention_class():
    """keras-hub's ``CachedGemmaAttention`` where keras-hub is imported, else None."""
    module = sys.modules.get("keras_hub.src.models.gemma.gemma_attention")
    return getattr(module, "CachedGemmaAttention", None)


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


def attention_hooks() -> list[tuple[str, type, str]]:
    """The attention methods lean attention routes (``(key, class, method name)``): Keras's
    ``MultiHeadAttention._compute_attention``, and keras-hub's ``CachedGemmaAttention._compute_attention`` where
    keras-hub is imported."""
    hooks = [("attention", keras.layers.MultiHeadAttention, "_compute_attention")]
    gemma = gemma_attention_class()
    return hooks + ([("gemma_attention", gemma, "_compute_attention")] if gemma is not None else [])


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
def is_functional(model) -> bool:
    """Whether ``model`` is a Functional model (``keras.src.models.functional.Functional``: a layer graph)."""
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def functional_graph(model):
    """The Functional model holding a Sequential's layer graph (``Sequential._functional``; None unbuilt), or the
    model itself."""
    return getattr(model, "_functional", None) if isinstance(model, keras.Sequential) else model


def run_through_graph(model, inputs, operation_fn):
    """A Functional model's graph called on ``inputs``, each layer through ``operation_fn(layer)`` (new nodes of the
    model's own layers; ``Functional._run_through_graph``, without ``call``'s input standardizing)."""
    return model._run_through_graph(inputs, operation_fn=operation_fn)


def nodes_by_depth(fn) -> dict:
    """A Functional model's nodes by depth (``_nodes_by_depth``)."""
    return fn._nodes_by_depth


def outputs_struct(fn):
    """A Functional model's output structure (``_outputs_struct``)."""
    return fn._outputs_struct


def unscale_loss_for_distribution(loss):
    """The loss as Keras reports it under a distribution strategy (``keras.src.losses.loss``)."""
    from keras.src.losses.loss import unscale_loss_for_distribution as unscale

    return unscale(loss)


def train_writer(board):
    """A ``keras.callbacks.TensorBoard``'s training summary writer (``_train_writer``)."""
    return board._train_writer


# ------------------------------------------------------------------------------------------- TensorFlow
def set_gradient_function(op, fn) -> None:
    """The gradient function graph gradients use for ``op`` (``Operation._gradient_function``, the first place
    ``ops.get_gradient_function`` looks)."""
    op._gradient_function = fn


def record_operation(name: str, outputs, inputs, backward) -> None:
    """Record an operation on the active gradient tapes (``tensorflow.python.eager.record``)."""
    from tensorflow.python.eager import record

    record.record_operation(name, outputs, inputs, backward)


def variable_watcher():
    """A context recording the variables read inside it (``tensorflow.python.eager.record.VariableWatcher``)."""
    from tensorflow.python.eager import record

    return record.VariableWatcher()


def identity_n(inputs) -> list:
    """``IdentityN`` over ``inputs`` (``tensorflow.python.ops.array_ops``)."""
    from tensorflow.python.ops import array_ops

    return array_ops.identity_n(inputs)


def in_xla_compile() -> bool:
    """Whether the graph being traced compiles with XLA (``tf.function(jit_compile=True)``, Keras's
    ``jit_compile``), where every shape must be known when compiled (``control_flow_util``)."""
    from tensorflow.python.ops import control_flow_util

    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


def type_spec_class(value) -> type:
    """The class of a composite value's type spec (``_type_spec``; a per-replica value's takes component specs)."""
    return type(value._type_spec)


def flatten_layers(model) -> list:
    """Every layer inside ``model``, nested ones included (``Layer._flatten_layers``)."""
    return list(model._flatten_layers())


check_versions()
