"""Where a step applies the optimizer: once after the whole backward (``at_end``) or section by section inside it
(``in_backward``), each section's gradients applied as soon as its backward has made them and then freed.

Updating early is exact only for an optimizer that updates each variable from its own gradient, the learning rate
and the step count alone: Keras's built-in optimizers below, without a global gradient norm (``global_clipnorm``),
loss scaling (a ``LossScaleOptimizer`` skips the whole step on any non-finite gradient), gradient accumulation or
weight averaging (both act on every variable at once). ``Nadam`` is not one: it keeps a product over steps that
each ``apply`` call advances.

Either way the optimizer writes its slots in place (``assign_in_place``), and where its update is per variable it
updates them a group at a time (``size_groups``): TensorFlow runs every ready op, so one call's updates all start
together and hold their temporaries at once (ResNet50V2's Adam update held 98-103 MiB beyond its 90 MiB of
gradients, its largest variable 9 MiB).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

#: Keras optimizers whose update of a variable reads only its gradient, its slots, the learning rate and the
#: step count: applying them variable group by variable group within one step equals one apply.
PER_VARIABLE = ("SGD", "Adam", "AdamW", "Adamax", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Lion", "Lamb",
                "Adafactor")


def why_at_end(optimizer, distributed: bool = False, one_graph: bool = False) -> str | None:
    """Why ``optimizer`` must update once after the whole backward; ``None`` when section by section is exact."""
    kind = type(optimizer)
    if not (kind.__module__.startswith("keras.") and kind.__name__ in PER_VARIABLE):
        return (f"{kind.__name__} is not one of the Keras optimizers known to update each variable on its own "
                f"({', '.join(PER_VARIABLE)})")
    for attribute, what in (("global_clipnorm", "clips by the global norm of every gradient"),
                            ("use_ema", "averages every weight after the update"),
                            ("gradient_accumulation_steps", "accumulates every gradient over steps")):
        if getattr(optimizer, attribute, None):
            return f"the optimizer {what} ({attribute}={getattr(optimizer, attribute)!r})"
    if distributed:
        return "under tf.distribute the update all-reduces the gradients in one call"
    if one_graph:
        return "one_graph=True compiles the update into the step"
    return None


def size_groups(sizes: list[int]) -> list[list[int]]:
    """Consecutive indices packed so that each group's bytes stay within the largest size (a larger one alone): the
    update's temporaries are then a few of the largest variable's, whatever the number of variables."""
    cap = max(sizes, default=0)
    groups: list[list[int]] = []
    total = 0
    for i, size in enumerate(sizes):
        if not groups or total + size > cap:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += size
    return groups


def apply_in_groups(optimizer, pairs: list, sizes: list[int] | None, partial: bool) -> None:
    """``optimizer.apply_gradients(pairs)`` a ``size_groups`` group at a time inside a traced function (``sizes``
    None: one group), each group's gradients read only once the group before has written its variables; every
    group reads the same step count, which advances once (not at all where ``partial``: one of a step's several
    applies)."""
    groups = size_groups(sizes) if sizes is not None else [list(range(len(pairs)))]
    done: list = []
    for n, group in enumerate(groups):
        chunk = [pairs[i] for i in group]
        if done:
            with tf.control_dependencies(done):
                chunk = [(g if isinstance(g, tf.IndexedSlices) else tf.identity(g), v) for g, v in chunk]
        optimizer.apply_gradients(chunk)
        if partial or n < len(groups) - 1:
            optimizer.iterations.assign_sub(1)
        done = [tf.identity(v) for _, v in chunk]  # read after the writes (ordered per variable in a tf.function)


@contextlib.contextmanager
def assign_in_place(optimizer, enabled: bool = True):
    """Within it, ``optimizer.assign`` (Keras SGD's momentum, RMSprop's, Adadelta's, Ftrl's and Lion's slots) copies
    the new value into the variable's own buffer instead of handing the variable the value's buffer, as TensorFlow's
    ``AssignVariableOp`` does when the value has no other reader. Same values, bit for bit; but a slot that moves to
    a new buffer every step moves the heap's free chunks with it, and the allocator's peak with them: ResNet50 with
    SGD momentum read step peaks 142 MiB apart with one op order, 0 apart with this (BENCHMARKS.md, "Slots written in
    place"). Scalars and sparse values keep Keras's assignment; loss-scale wrappers' inner optimizers are patched too.
    ``enabled=False`` (distributed variables, whose assignment the strategy routes): Keras's assignment."""
    patched = []
    while enabled and optimizer is not None and "assign" not in vars(optimizer):
        original = optimizer.assign

        def assign(variable, value, original=original):
            target = getattr(variable, "value", variable)  # a Keras variable's tf.Variable
            if isinstance(value, tf.IndexedSlices) or not isinstance(target, tf.Variable) or not target.shape.rank:
                return original(variable, value)
            target[...].assign(tf.cast(value, target.dtype))  # ResourceStridedSliceAssign: writes the buffer

        optimizer.assign = assign
        patched.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    try:
        yield
    finally:
        for opt in patched:
            del opt.assign
