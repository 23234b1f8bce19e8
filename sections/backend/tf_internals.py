"""Every place sectionflow reads TensorFlow internals: one function per touch point, nowhere else.

TensorFlow has no public name for these (``tensorflow.python`` modules, private attributes of its objects); each
function says what it reads and the TensorFlow releases it was written for (``written_for``: the range
``pyproject.toml`` declares, ``keras_internals.SUPPORTED``), and what it does where a release lacks it: a fallback
or a one-line error. ``sections/backend/keras_internals.py`` is its sibling for Keras and keras-hub;
``tests/test_architecture.py`` holds the rest of the tree to these two doors. The runner reaches the functions it
needs through the public ``sections.tf_compat``.

TensorFlow loads lazily here (in the functions), so the runner may import this module before TensorFlow starts.
"""

from __future__ import annotations

import contextlib
import heapq
import sys
import warnings

__all__ = ["TOUCH_POINTS", "written_for", "set_gradient_function", "record_operation", "variable_watcher",
           "identity_n", "in_xla_compile", "type_spec_class", "disable_op_determinism", "runtime_started",
           "write_checkpoint_state", "checkpoint_state_parses", "unpruned_calls", "onednn_enabled",
           "run_in_creation_order"]

#: ``{"module.function": (package, lowest, first unsupported)}``: the releases each touch point was written for.
TOUCH_POINTS: dict = {}
#: The TensorFlow releases ``pyproject.toml`` allows (``keras_internals.SUPPORTED["tensorflow"]``, checked there).
TENSORFLOW = ("tensorflow", "2.16", "2.22")
_warned: set = set()


def written_for(package: str, lowest: str, first_unsupported: str):
    """Marks a touch point with the releases it was written for (``fn.written_for``, listed in ``TOUCH_POINTS``)."""
    def mark(fn):
        fn.written_for = (package, lowest, first_unsupported)
        TOUCH_POINTS[f"{fn.__module__}.{fn.__name__}"] = fn.written_for
        return fn
    return mark


def _absent(what: str) -> str:
    import tensorflow as tf

    low, high = TENSORFLOW[1:]
    return f"this TensorFlow ({tf.__version__}) has no {what} (sectionflow was written for >={low},<{high})"


def _warn_once(what: str, consequence: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"sectionflow: {_absent(what)}; {consequence}", stacklevel=3)


# ------------------------------------------------------------------------------------------- gradients
@written_for(*TENSORFLOW)
def set_gradient_function(op, fn) -> None:
    """The gradient function graph gradients use for ``op`` (``Operation._gradient_function``, the first place
    ``ops.get_gradient_function`` looks). Absent: one-line error (a lean gradient cannot be placed)."""
    if not hasattr(op, "_gradient_function"):
        raise RuntimeError(_absent("Operation._gradient_function") + "; train with lean=False")
    op._gradient_function = fn


@written_for(*TENSORFLOW)
def record_operation(name: str, outputs, inputs, backward) -> None:
    """Record an operation on the active gradient tapes (``tensorflow.python.eager.record``). Absent: one-line
    error."""
    try:
        from tensorflow.python.eager import record
    except ImportError:
        raise RuntimeError(_absent("tensorflow.python.eager.record") + "; train with lean=False") from None
    record.record_operation(name, outputs, inputs, backward)


@written_for(*TENSORFLOW)
def variable_watcher():
    """A context recording the variables read inside it (``tensorflow.python.eager.record.VariableWatcher``).
    Absent: one-line error."""
    try:
        from tensorflow.python.eager.record import VariableWatcher
    except ImportError:
        raise RuntimeError(_absent("tensorflow.python.eager.record.VariableWatcher") + "; train with lean=False") \
            from None
    return VariableWatcher()


@written_for(*TENSORFLOW)
def identity_n(inputs) -> list:
    """``IdentityN`` over ``inputs`` (``tensorflow.python.ops.array_ops``); absent: ``tf.raw_ops.IdentityN``, the
    same op."""
    try:
        from tensorflow.python.ops.array_ops import identity_n as identity
    except ImportError:
        import tensorflow as tf

        return tf.raw_ops.IdentityN(input=inputs)
    return identity(inputs)


@written_for(*TENSORFLOW)
def in_xla_compile() -> bool:
    """Whether the graph being traced compiles with XLA (``tf.function(jit_compile=True)``, Keras's
    ``jit_compile``), where every shape must be known when compiled (``control_flow_util``). Absent: True (the
    caller then assumes every shape must be known, as under XLA: exact either way)."""
    import tensorflow as tf

    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:
        _warn_once("tensorflow.python.ops.control_flow_util", "lean attention reads every key of each block")
        return True
    return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))


@written_for(*TENSORFLOW)
def type_spec_class(value) -> type:
    """The class of a composite value's type spec (``_type_spec``; a per-replica value's takes component specs);
    where it has no ``_type_spec``, its public ``tf.type_spec_from_value``'s."""
    spec = getattr(value, "_type_spec", None)
    if spec is None:
        import tensorflow as tf

        spec = tf.type_spec_from_value(value)
    return type(spec)


# ------------------------------------------------------------------------------------------- the runtime
@written_for(*TENSORFLOW)
def disable_op_determinism() -> None:
    """Turn TensorFlow's op determinism off (``tensorflow.python.framework.config.disable_op_determinism``: only
    turning it on has a public name). Absent: nothing to do where it is off, else a one-line error."""
    try:
        from tensorflow.python.framework import config
    except ImportError:
        config = None
    if config is not None and hasattr(config, "disable_op_determinism"):
        config.disable_op_determinism()
        return
    if config is not None and hasattr(config, "is_op_determinism_enabled") and not config.is_op_determinism_enabled():
        return
    raise RuntimeError(_absent("config.disable_op_determinism") + ": op determinism stays on in this process; "
                       "run this job in a process of its own")


@written_for(*TENSORFLOW)
def runtime_started() -> bool:
    """Whether TensorFlow's runtime has started in this process (its eager context ``_initialized``): False where
    TensorFlow is not even imported; True (started, as far as anyone can tell) where the flag is absent."""
    if "tensorflow" not in sys.modules:
        return False
    try:
        from tensorflow.python.eager import context

        return bool(getattr(context.context(), "_initialized", True))
    except Exception:  # noqa: BLE001 - unknown: say started
        return True


@written_for(*TENSORFLOW)
def onednn_enabled() -> bool | None:
    """Whether this process runs oneDNN's CPU kernels (``_pywrap_util_port.IsMklEnabled``: what TensorFlow decided
    from ``TF_ENABLE_ONEDNN_OPTS`` and the CPU). Absent: None (unknown), with a warning once."""
    try:
        from tensorflow.python.util import _pywrap_util_port

        return bool(_pywrap_util_port.IsMklEnabled())
    except (ImportError, AttributeError):
        _warn_once("_pywrap_util_port.IsMklEnabled", "whether oneDNN's kernels run is not known")
        return None


@written_for(*TENSORFLOW)
def run_in_creation_order(graph, first: int, last: int) -> None:
    """Ops ``first .. last - 1`` of ``graph`` (a function being traced) run in the order they were made: each gets a
    control edge from the op made before it (``Operation._add_control_input``). TensorFlow's executor otherwise
    runs ready ops in an order of its own and puts off expensive ones (a convolution's filter gradient), while what
    they read waits: one section of keras.applications ResNet50's second stage at batch 32 held 52.0 MiB where its
    trace, counted in the order its ops were made, says 38.3 MiB; chained, 38.3 MiB. Absent: TensorFlow's order,
    said once."""
    from .liveness import ALIASES, NO_BUFFER, SHAPE_ONLY

    # Views, shapes and constants make no buffer worth ordering, and Grappler rewires their edges (a chain through
    # them ended in a cycle once it had).
    every = graph.get_operations()
    chosen = {id(op) for op in every[first:last]
              if op.type not in ALIASES and op.type not in NO_BUFFER and op.type not in SHAPE_ONLY}
    ops = [op for op in _creation_topological(every) if id(op) in chosen]
    try:
        for before, op in zip(ops, ops[1:]):
            op._add_control_input(before)
    except AttributeError:
        _warn_once("Operation._add_control_input",
                   "a backward runs its ops in TensorFlow's order, which may hold more than its trace counts")


def _creation_topological(ops: list) -> list:
    """``ops`` (a graph's, in creation order) in an order that respects their data and control edges, otherwise in
    creation order. Creation order alone usually does, but not always: a while loop's gradient gives the forward
    loop new outputs after the gradient's ops that read them were made (a masked GRU's backward: "182 nodes in a
    cycle" once chained)."""
    index = {id(op): i for i, op in enumerate(ops)}
    waiting = [0] * len(ops)
    readers: list = [[] for _ in ops]
    for i, op in enumerate(ops):
        sources = {index[id(t.op)] for t in op.inputs if id(t.op) in index}
        sources |= {index[id(c)] for c in op.control_inputs if id(c) in index}
        sources.discard(i)
        waiting[i] = len(sources)
        for j in sources:
            readers[j].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(ops[i])
        for j in readers[i]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    return order if len(order) == len(ops) else list(ops)


# ------------------------------------------------------------------------------------------- function calls
_unpruned: dict = {}  # id of a thread's call options -> (those options, the same with model pruning off)


@written_for(*TENSORFLOW)
@contextlib.contextmanager
def unpruned_calls():
    """Eager calls of ``tf.function``s in this block (this thread) run with Grappler's model pruning and dependency
    optimizer off (both re-wire control edges; the second below).

    The pruner removes identities and re-wires their control edges; a lean gradient's re-computation, ordered
    after the gradient arriving by such an edge, then runs in the forward pass and holds what lean gradients free
    (MobileNetV2 at batch 64, one lean section: 681 MiB with pruning, 404 without, against 398 counted from the
    trace). Each call's options go with the call (its ``config_proto`` attribute), so functions called elsewhere
    keep TensorFlow's defaults. Absent (TensorFlow's eager context changed): calls run with the defaults, said
    once."""
    try:
        from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
        from tensorflow.python.eager import context

        ctx = context.context()
        local = ctx._thread_local_data
        current = ctx.function_call_options
    except (ImportError, AttributeError):
        _warn_once("eager context function_call_options",
                   "Grappler's model pruning stays on: lean gradients may hold more than planned")
        yield
        return
    entry = _unpruned.get(id(current))
    if entry is None or entry[0] is not current:
        config = config_pb2.ConfigProto()
        config.ParseFromString(current.config_proto_serialized)
        config.graph_options.rewrite_options.disable_model_pruning = True
        # The dependency optimizer re-wires control edges too: with oneDNN's kernels and bfloat16 it turned a
        # backward's creation-order chain (``run_in_creation_order``) into a cycle ("26 nodes in a cycle").
        config.graph_options.rewrite_options.dependency_optimization = rewriter_config_pb2.RewriterConfig.OFF
        entry = _unpruned[id(current)] = (current, context.FunctionCallOptions(
            executor_type=current.executor_type, config_proto=config))
    local.function_call_options = entry[1]
    try:
        yield
    finally:
        local.function_call_options = current


# ------------------------------------------------------------------------------------------- checkpoints
@written_for(*TENSORFLOW)
def write_checkpoint_state(directory: str, latest: str, paths: list[str], timestamps: list[float],
                           last_preserved_timestamp: float) -> bool:
    """Write a checkpoint folder's ``checkpoint`` state file listing ``paths`` (oldest first), as
    ``tf.train.CheckpointManager`` writes it (``checkpoint_management.update_checkpoint_state_internal``), so a
    manager prunes them. Absent: a warning, nothing written, False (old checkpoints are then kept, not pruned)."""
    try:
        from tensorflow.python.checkpoint.checkpoint_management import update_checkpoint_state_internal as update
    except ImportError:
        _warn_once("checkpoint_management.update_checkpoint_state_internal",
                   "checkpoints saved before a resume are not pruned")
        return False
    update(directory, latest, paths, save_relative_paths=True, all_model_checkpoint_timestamps=timestamps,
           last_preserved_timestamp=last_preserved_timestamp)
    return True


@written_for(*TENSORFLOW)
def checkpoint_state_parses(text: str) -> bool:
    """Whether ``text`` is a ``checkpoint`` state file TensorFlow can read (the ``CheckpointState`` proto's text
    format, ``tensorflow.python.checkpoint.checkpoint_management``). Absent: True (TensorFlow reads it itself)."""
    from google.protobuf import text_format

    try:
        from tensorflow.python.checkpoint.checkpoint_management import CheckpointState
    except ImportError:
        return True
    try:
        text_format.Merge(text, CheckpointState())
        return True
    except Exception:  # noqa: BLE001 - not the proto's text format
        return False
