"""``tf.custom_gradient`` whose graph-mode gradient lives on the traced op, not in TensorFlow's global registry.

Inside a ``tf.function``, ``tf.custom_gradient`` registers each call's gradient under a fresh name in the
process-wide gradient registry (``ops.RegisterGradient``); the registry never forgets it, and its closure keeps the
traced graph and everything the graph captured (variables, layers) for the life of the process. Here the same
``IdentityN`` op is made, but its gradient function is set on the op itself (``Operation._gradient_function``, the
first place ``ops.get_gradient_function`` looks, as TensorFlow does for function-call and control-flow ops): it
lives exactly as long as the graph, however late a ``tf.function``'s backward is built (lazily, on a retrace or
for a tape outside the function). A tape inside the function uses the function recorded on it, as in TensorFlow.

Limits, checked: tensor arguments only, no keyword arguments, and no variable read inside the forward (pass its
value in). A graph saved to a SavedModel keeps no custom gradient (TensorFlow's own does only with
``experimental_custom_gradients``, through the registry); the engine's training functions are never saved.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from . import tf_internals as internals

__all__ = ["custom_gradient"]


def custom_gradient(f):
    """Like ``tf.custom_gradient(f)``: ``f(*tensors) -> (outputs, grad_fn)``; eager calls are TensorFlow's own."""
    eager = tf.custom_gradient(f)

    @functools.wraps(f)
    def call(*args):
        if tf.executing_eagerly():
            return eager(*args)
        return _graph_call(f, args)

    return call


def _graph_call(f, args):
    args = [tf.convert_to_tensor(a) for a in args]
    with internals.variable_watcher() as watcher:
        result, grad_fn = f(*args)
    if watcher.watched_variables():
        names = sorted(v.name for v in watcher.watched_variables())
        raise ValueError(f"custom_gradient: {f.__name__} reads variables {names} inside its forward; pass their "
                         f"values in as arguments (only tensor arguments get gradients here).")
    flat_result = tf.nest.flatten(result)
    count = len(flat_result)

    def tape_grad_fn(*result_grads):
        input_grads = grad_fn(*result_grads[:count])
        input_grads = list(input_grads) if isinstance(input_grads, (list, tuple)) else [input_grads]
        if len(input_grads) != len(args):
            raise ValueError(f"custom_gradient: {f.__name__}'s gradient returned {len(input_grads)} gradients for "
                             f"{len(args)} arguments.")
        return [None] * count + input_grads  # one per IdentityN input: the outputs' own inputs get none

    inputs = flat_result + args
    outputs = internals.identity_n(inputs)
    # Graph gradients (a function's backward) read this first; the op and so the closure die with the graph.
    internals.set_gradient_function(outputs[0].op, lambda op, *grads: tape_grad_fn(*grads))
    internals.record_operation(f.__name__, outputs, inputs, tape_grad_fn)  # tapes inside the function
    return tf.nest.pack_sequence_as(result, outputs[:count])
