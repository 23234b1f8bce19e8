"""Memory counted from a traced graph: each tensor's bytes from its shape and dtype, held from the op that makes it
to the last op that reads it, in the graph's order. Nothing runs, so the figure is the same in every process and
needs no device memory. Kernels' work buffers, which no shape says, are measured per op where a ``work`` function is
given (``sections.backend.workspace``); the allocator's rounding and fragmentation are left to a measured
correction (``sections.schedule.search``)."""

from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

# Ops whose output is a view of their input's buffer (TensorFlow forwards the buffer, no allocation).
ALIASES = frozenset({"Identity", "IdentityN", "Reshape", "Squeeze", "ExpandDims", "StopGradient", "Snapshot",
                     "PreventGradient", "EnsureShape", "CheckNumerics", "DebugIdentity"})
# Ops that make no buffer a step's peak counts: graph inputs (the caller holds them), constants, shapes.
NO_BUFFER = frozenset({"Placeholder", "Const", "VarHandleOp", "NoOp", "Shape", "ShapeN", "Size", "Rank",
                       "ReadVariableOp", "VariableShape"})
# Element-wise kernels that write into an input whose last reader they are, when it has the output's size
# (TensorFlow's ``forward_input_or_allocate_output``).
IN_PLACE = frozenset({"Relu", "Relu6", "Elu", "Selu", "Tanh", "Sigmoid", "Add", "AddV2", "Sub", "Mul", "RealDiv",
                      "Neg", "Square", "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "ReluGrad", "Relu6Grad", "EluGrad",
                      "SeluGrad", "TanhGrad", "SigmoidGrad", "BiasAdd", "Maximum", "Minimum", "SquaredDifference",
                      "LeakyRelu", "LeakyReluGrad", "Softplus", "SoftplusGrad", "AddN", "Reciprocal", "Abs", "Sign",
                      "Erf", "Pow", "DivNoNan", "Softsign", "Floor", "Round", "Select", "SelectV2", "MulNoNan",
                      "Sin", "Cos", "Softmax", "RsqrtGrad", "SqrtGrad", "ReciprocalGrad", "ClipByValue"})
# Ops that read only a tensor's shape, never its buffer.
SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank", "ZerosLike", "OnesLike"})
_NO_SIZE = (tf.resource, tf.variant, tf.string)


@dataclass(frozen=True)
class GraphMemory:
    """A traced function's memory beyond its inputs: ``peak`` (the most its own tensors hold at once, in graph
    order), ``kept`` (bytes of tensors made before ``split`` and read after it: what a forward leaves its backward),
    ``unsized`` (tensors whose shape was not fully known, not counted)."""

    peak: int
    kept: int = 0
    unsized: int = 0


def tensor_bytes(tensor) -> int | None:
    """Bytes of a graph tensor from its static shape and dtype; None where the shape is not fully known."""
    if tensor.dtype in _NO_SIZE:
        return 0
    if not tensor.shape.is_fully_defined():
        return None
    return int(tensor.shape.num_elements()) * tensor.dtype.size


def graph_memory(graph, split: int | None = None, work=None) -> GraphMemory:
    """Count ``graph`` (a ``FuncGraph``): ops run in creation order (a traced function's ops are created in an order
    that respects their inputs); a buffer lives from its op to its last reader (the function's outputs to the end);
    views share their input's buffer; element-wise kernels reuse a dying input of their output's size; ops the
    call would not run (``run_ops``) hold nothing. ``split``:
    the index of the first backward op, for ``kept``. ``work``: op -> the bytes its kernel allocates beside its
    inputs and outputs while it runs (``workspace.Workspaces``), held at that op only."""
    needed = run_ops(graph)
    ops = graph.get_operations()
    owner: dict = {}   # tensor name -> the buffer (a tensor name) it lives in
    size: dict = {}    # buffer -> bytes
    born: dict = {}    # buffer -> op index
    last: dict = {}    # buffer -> index of the last op reading it
    outside: set = set()  # views (through any chain of views) of buffers the caller holds: no bytes of ours
    unsized = 0
    for i, op in enumerate(ops):
        if op not in needed:
            continue
        for t in op.inputs:
            buf = owner.get(t.name)
            if buf is not None:
                last[buf] = i
        for k, t in enumerate(op.outputs):
            if op.type in NO_BUFFER:
                continue
            if op.type in ALIASES and op.inputs:
                src = op.inputs[min(k, len(op.inputs) - 1)] if op.type == "IdentityN" else op.inputs[0]
                if src.name in owner:
                    owner[t.name] = owner[src.name]
                    continue
                if src.op.type in NO_BUFFER or src.name in outside:  # a view of a graph input or a variable
                    outside.add(t.name)
                    continue
            nb = tensor_bytes(t)
            if nb is None:
                unsized += 1
                nb = 0
            owner[t.name], size[t.name], born[t.name], last[t.name] = t.name, nb, i, i
    for t in graph.outputs:
        buf = owner.get(t.name)
        if buf is not None:
            last[buf] = len(ops)
    allocs: dict = {}
    frees: dict = {}
    for buf, i in born.items():
        allocs.setdefault(i, []).append(buf)
    for buf, i in last.items():
        frees.setdefault(i, []).append(buf)
    live = peak = 0
    for i, op in enumerate(ops):
        if op not in needed:
            continue
        new = allocs.get(i, ())
        if new and op.type in IN_PLACE:
            dying = [owner[t.name] for t in op.inputs if owner.get(t.name) is not None and last[owner[t.name]] == i]
            for buf in new:
                match = next((d for d in dying if size[d] == size[buf]), None)
                if match is not None:
                    dying.remove(match)
                    live -= size[match]  # its buffer becomes the output's
                    frees[i].remove(match)
        live += sum(size[b] for b in new)
        peak = max(peak, live + (work(op) if work is not None else 0))
        live -= sum(size[b] for b in frees.get(i, ()))
    kept = 0
    if split is not None:
        kept = sum(size[b] for b in born if born[b] < split and last[b] >= split)
    return GraphMemory(peak, kept, unsized)


def run_ops(graph) -> set:
    """The ops a call of ``graph`` runs: those its outputs and control outputs depend on, and stateful ops with
    what they read. TensorFlow prunes the rest from a function's body before it runs (a forward output no gradient
    reads, the zeros a custom gradient ignores: one MobileNetV2 batch-norm block at batch 64 counted two 54 MiB
    tensors its run never made)."""
    stack = [t.op for t in graph.outputs] + list(getattr(graph, "control_outputs", ()))
    stack += [op for op in graph.get_operations() if op.op_def is not None and op.op_def.is_stateful]
    seen: set = set()
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
        stack.extend(op.control_inputs)
    return seen


def read_after(graph, names, split: int) -> int:
    """Bytes of the tensors named ``names`` (a block's input or output border in ``graph``) whose buffer an op at
    or after index ``split`` reads, through any view of it: what a block's backward needs of its borders."""
    needed = run_ops(graph)
    index = {op.name: i for i, op in enumerate(graph.get_operations()) if op in needed}
    total = 0
    for name in names:
        tensor = graph.get_tensor_by_name(name)
        while tensor.op.type in ALIASES and tensor.op.inputs:  # to the op that made the buffer
            tensor = tensor.op.inputs[0]
        views, read = [tensor], False
        while views and not read:
            t = views.pop()
            for op in t.consumers():
                if op.name not in index or op.type in SHAPE_ONLY:
                    continue
                if op.type in ALIASES:
                    views.extend(op.outputs)
                elif index[op.name] >= split:
                    read = True
        if read:
            total += tensor_bytes(tensor) or 0
    return total
