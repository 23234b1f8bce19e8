"""Running: one step of a compiled program (the cached forward, the fused last section, the backward from the last
section to the first), the memory each section's backward reached, and the update."""

from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from ..backend.device import release, requested_bytes
from ..backend.relaxed import RelaxedFunction
from ..backend.replicas import local_size
from ..backend.structure import nbytes
from ..schedule.policies import KEEP_INPUT
from ..schedule.program import FORWARD, HOLD, LOSS, RESUME, kept_policy
from .section_functions import Compiled
from .update import apply_in_groups, assign_in_place, why_at_end

# The least a dry step's spread counts as, a fraction of its peak: with oneDNN off, steps read up to 0.2% (150 KiB
# on a 76 MiB step) over their dry step's two equal runs (kernel scratch of Eigen's thread pool).
DRY_NOISE = 0.005


@dataclass(frozen=True)
class WeightPenalty:
    """A term of the network's loss that reads only weights (Keras weight regularizers under ``fit``).

    The last section's loss includes it for every variable, but that section's backward differentiates only its
    own variables: the executor adds the term's gradient for the others (no activations needed), scaled as the
    step's loss is. ``loss(variables)`` returns the term for the given variables."""

    variables: tuple
    loss: Callable[[list], tf.Tensor]


@dataclass(frozen=True)
class Cycle:
    """One step's backward done: the loss, the gradients not yet applied (aligned with the trainable variables;
    None where applied in the backward or none), each section's backward peak and each device's step peak."""

    loss: object
    grads: list
    peaks: list
    step_peak: dict


@dataclass(frozen=True)
class DryStep:
    """A dry step's figures: its peak (bytes), its last run's seconds, by how much its kept runs differed, and
    whether the device ran out of memory (then ``peak`` is what was in use plus the failing request)."""

    peak: int
    seconds: float
    spread: int = 0
    ran_out: bool = False


def host_copy(variables: Sequence[tf.Variable]) -> list:
    """The variables' values as host arrays (NumPy: outside every device allocator), each at an address a CPU
    tensor may view without copying (``ALIGN``)."""
    return [_aligned(v.numpy()) for v in variables]


ALIGN = 64  # TensorFlow's largest alignment for a CPU tensor's buffer (a view of a less aligned one fails a check)


def _aligned(value: np.ndarray) -> np.ndarray:
    raw = np.empty(value.nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    out = raw[start:start + value.nbytes].view(value.dtype).reshape(value.shape)
    out[...] = value
    return out


def write_back(variables: Sequence[tf.Variable], saved: list) -> None:
    """Write ``host_copy``'s values back into the variables, each where it was on the device.

    A variable's buffer is let go first (assigned an empty value) and its saved value then copied onto the device
    by a kernel (``DeepCopy`` of a view of the host array on the CPU), which the allocator puts in the chunk just
    freed; the variable takes that buffer. The heap is left as the step found it and no more memory is needed than
    the variable held. Not a slice assignment: it switches a variable to copy-on-read for good, so every later read
    and update copies it (ResNet50V2's steps after planning read 433-468 MiB, against 414 with this); not a plain
    assignment either: it takes the new value's buffer wherever that was made, and the moved variables left the
    same plan's steps at 401-437 MiB as the copies landed. The young generations of Python's garbage are collected
    first (a reference cycle holding a read of a variable would keep its old buffer alive); a full collection
    took 0.25 s a call in a small process and several in the test suite's."""
    gc.collect(1)
    for v, value in zip(variables, saved):
        target = v.value if isinstance(getattr(v, "value", None), tf.Variable) else v  # a Keras variable's own
        handle = getattr(target, "handle", None) if isinstance(target, tf.Variable) else None
        if handle is None:  # a distributed variable: the strategy routes its assignment
            target.assign(_on_device(value, target))
            continue
        tf.raw_ops.AssignVariableOp(resource=handle, value=tf.zeros([0], target.dtype), validate_shape=False)
        copy = _on_device(value, target)
        tf.raw_ops.AssignVariableOp(resource=handle, value=copy, validate_shape=False)
        del copy


def _on_device(value: np.ndarray, target) -> tf.Tensor:
    """A new tensor of ``value`` on ``target``'s device, made by a kernel (running out there raises)."""
    device = getattr(target, "device", "") or ""
    if "GPU" not in device.upper() and "TPU" not in device.upper() and value.size and not value.ctypes.data % ALIGN:
        try:
            view = tf.experimental.dlpack.from_dlpack(value.__dlpack__())  # the host array itself, not copied
        except (TypeError, ValueError, BufferError, AttributeError, tf.errors.InvalidArgumentError):
            view = None  # a dtype DLPack does not carry
        if view is not None and view.dtype == target.dtype:
            with tf.device(device or None):
                return tf.raw_ops.DeepCopy(x=view)
    with tf.device(device or None):
        return tf.identity(tf.convert_to_tensor(value, target.dtype))


def apart(first: int, second: int) -> bool:
    """Whether two runs of one dry step differ by more than ``DRY_NOISE`` of the larger."""
    return abs(first - second) > DRY_NOISE * max(first, second)


class Executor:
    """Runs a ``Compiled`` program on a batch: one step's cycle, with the update at its end or section by section in
    the backward (``apply_reason`` None: ``in_backward``), or the whole step as one graph (``one_graph``).

    ``extra_state()``: variables the loss updates beside the network's state (Keras metrics under ``fit``), which a
    dry step restores with the rest; ``penalty``: a ``WeightPenalty`` whose gradient is added for the variables
    outside the last section."""

    def __init__(self, network, optimizer, replicas, meter, scale_loss, *, check: bool = False,
                 jit_compile: bool = False, apply_reason: str | None = "apply='at_end'", one_graph: bool = False,
                 penalty: WeightPenalty | None = None, extra_state: Callable[[], Sequence] = tuple):
        self.network, self.optimizer, self.replicas, self.meter = network, optimizer, replicas, meter
        self.scale_loss = scale_loss
        #: Why the update runs once after the whole backward (None: section by section in it).
        self.apply_reason = apply_reason
        self.check, self.jit_compile, self.one_graph = check, jit_compile, one_graph
        self.penalty, self.extra_state = penalty, extra_state
        self.trainable: list = []  # the network's trainable variables, once it is built (``adopt``)
        self._position: dict = {}
        self.compiled: Compiled | None = None
        self._fns: dict = {}  # the compiled update(s), one-graph step and penalty gradients

    @property
    def in_backward(self) -> bool:
        """Whether each section's update runs in the backward, as soon as its gradients are made."""
        return self.apply_reason is None

    # ------------------------------------------------------------------ the program
    def adopt(self, compiled: Compiled) -> None:
        """Run ``compiled`` from now on (its update functions made; the one-graph step once)."""
        if not self.trainable:
            self.trainable = self.network.trainable_variables
            self._position = {id(v): i for i, v in enumerate(self.trainable)}
        self.compiled = compiled
        # Sparse (embedding) gradients change length with the batch's shapes: their length is left unknown.
        update = lambda: RelaxedFunction(self.replicas.wrap(self._apply_gradients), self.jit_compile,  # noqa: E731
                                         batch_args=())
        fns = {"apply": self._fns.get("apply") or update()}
        # in the backward: one function per section (each updates its own variables: traced once)
        fns["parts"] = [update() for _ in compiled.sections] if self.in_backward else []
        if self.one_graph:
            fns["graph_step"] = self._fns.get("graph_step") or RelaxedFunction(
                self.replicas.wrap(self._graph_step), self.jit_compile, (0,))
            fns["graph_grads"] = self._fns.get("graph_grads") or RelaxedFunction(
                self.replicas.wrap(self.graph_cycle), self.jit_compile, (0,))
        # A re-plan moves the sections' borders: which variables each completes changes.
        outside = self._outside_last()
        fns["penalty_groups"] = {"all": outside, **{k: [v for v in outside if self._position[id(v)] in done]
                                                     for k, done in enumerate(map(set, compiled.complete))}}
        fns["penalty"] = {}
        self._fns = fns

    def step(self, batch) -> tuple:
        """One training step: ``(loss, section peaks or None, each device's step peak)``."""
        if self.one_graph:
            self.meter.reset()
            loss = self._fns["graph_step"](local_size(batch, self.replicas), batch)
            return loss, None, self.meter.peaks()
        if self.in_backward:
            cycle = self.cycle(batch, ready="apply")
            return cycle.loss, cycle.peaks, cycle.step_peak
        cycle = self.cycle(batch)
        self.meter.reset()
        self._fns["apply"](0, *_present(cycle.grads), False)
        apply_peaks = self.meter.peaks()
        return cycle.loss, cycle.peaks, {d: max(p, apply_peaks[d]) for d, p in cycle.step_peak.items()}

    def gradients(self, batch) -> tuple:
        """The loss and every trainable variable's gradient (None where none), not applied."""
        if self.one_graph:
            return self._fns["graph_grads"](local_size(batch, self.replicas), batch)
        cycle = self.cycle(batch)
        return cycle.loss, cycle.grads

    def cycle(self, batch, ready: str = "keep") -> Cycle:
        """One step's gradients: the schedule's program run in order (the cached forward pass, the fused last
        section, then the backward from the last section to the first, re-creating dropped input borders).

        ``ready``: what becomes of a variable's gradient once the backward has made all of it: ``"keep"`` (returned)
        or ``"apply"`` (applied there and freed: the update in the backward). ``kept[k]`` is what section k keeps
        for its backward, as ``(policy, what it kept)``.
        """
        compiled, meter = self.compiled, self.meter
        schedule, fns, sections = compiled.schedule, compiled.functions, compiled.sections
        last = len(sections) - 1
        views = compiled.views(batch)
        kept = [None] * (last + 1)
        snapshots = [None] * (last + 1)  # each section's state before its first run: every re-run replays it
        grads: list = [None] * len(self.trainable)
        peaks, step_peak, loss, upstream, expected = [0] * (last + 1), None, None, None, None
        h = batch[self.network.inputs]

        def measured(k):  # the window since the last reset is section k's backward
            device_peaks = meter.peaks()
            for d, p in device_peaks.items():
                step_peak[d] = max(step_peak[d], p)
            peaks[k] = max(device_peaks.values())
            meter.reset()

        meter.reset()
        for step in schedule.program:
            k = step.section
            if step.op == FORWARD:
                policy = kept_policy(schedule, step)
                if policy is None:
                    h, snapshots[k] = fns[k].forward(h, views[k], snapshots[k])
                else:
                    h, snapshots[k], keeps = policy.forward(fns[k], h, views[k], snapshots[k])
                    kept[k] = (policy, keeps)
                    del keeps
            elif step.op == LOSS:
                step_peak = meter.peaks()
                meter.reset()
                loss, upstream, var_grads = fns[k].fused(h, views[k])
                # Check mode keeps each section's input one section longer, to compare the re-run of the one before.
                expected = h if self.check else None
                h = None
                self._accumulate(grads, sections[k].variables, var_grads)
                del var_grads
                self._release(grads, k, ready)
                measured(k)
            elif step.op == RESUME:
                policy, keeps = kept[step.source]
                h = policy.resume_border(keeps)
                del keeps
            elif step.op == HOLD:
                kept[k], h = (KEEP_INPUT, h), None
            else:  # BACKWARD
                policy, keeps = kept[k]
                kept[k] = None
                upstream, var_grads = policy.backward(fns[k], keeps, views[k], upstream, snapshots[k],
                                                      expected if self.check else None)
                expected = policy.input_border(keeps) if self.check else None
                del keeps
                snapshots[k] = None
                self._accumulate(grads, sections[k].variables, var_grads)
                del var_grads
                self._release(grads, k, ready)
                measured(k)
        if ready == "apply":
            self.optimizer.iterations.assign_add(1)  # the step's one count (each partial update gave its own back)
        else:
            self._add_penalty(grads, "all")
        return Cycle(loss, grads, peaks, step_peak)

    # ------------------------------------------------------------------ dry steps
    def state_variables(self, with_update: bool) -> list:
        """What a step changes besides the counters: the network's state, ``extra_state()``, and with the update
        the trainable variables and the optimizer's."""
        state = [*self.network.non_trainable_variables, *self.extra_state()]
        return state + [*self.trainable, *self.optimizer.variables] if with_update else state

    def dry_step(self, batch, read_counters: Callable) -> DryStep:
        """A step's cycle run unapplied (its update parts run where the update is in the backward), twice, its
        state and counters restored after each: the larger peak and the last run's seconds (the first traces).
        Where the two runs differ by more than ``DRY_NOISE``, the first is set aside and a third runs: a first run
        of new functions meets another heap than later ones (on ResNet50 at batch 256 it read 25-110 MiB off,
        either way), and the steps after build repeat the later runs' figure. What the kept runs differ by (at
        least ``DRY_NOISE``) is the spread. The state is saved as host arrays (copies held on the CPU allocator
        filled the chunk allocator's gaps and read 68 MiB under the steps on ResNet50) and written back into the
        variables' own buffers."""
        state = self.state_variables(self.in_backward)
        saved = host_copy(state)
        peaks, seconds = [], 0.0
        while len(peaks) < 2 or (len(peaks) == 2 and apart(*peaks)):
            start = time.perf_counter()
            try:
                step_peak = self.cycle(batch, ready="apply" if self.in_backward else "keep").step_peak
            except tf.errors.ResourceExhaustedError as err:
                # The device has no memory for this plan: it reads as at least what was in use when the request
                # failed plus the request.
                request, _ = requested_bytes(err)
                release(err)
                failed = self.meter.peak() + (request or 0)
                write_back(state, saved)
                read_counters()
                return DryStep(failed, math.inf, 0, ran_out=True)
            seconds = time.perf_counter() - start
            write_back(state, saved)
            peaks.append(max(step_peak.values()))
        read_counters()
        kept = peaks[-2:]
        return DryStep(max(kept), seconds, max(max(kept) - min(kept), math.ceil(DRY_NOISE * max(kept))))

    # ------------------------------------------------------------------ the step as one graph (one_graph=True)
    def graph_cycle(self, batch):
        """``cycle`` traced into one graph (recompute everywhere). Section k's re-run reads its input border
        through an identity that waits for the gradient on its output: without that gate the executor (or
        Grappler's common-subexpression pass) would run or merge the re-run with the first forward, and keep
        every activation alive as a whole-graph step does."""
        compiled = self.compiled
        fns, sections, last = compiled.functions, compiled.sections, len(compiled.sections) - 1
        views = compiled.views(batch)
        h = batch[self.network.inputs]
        borders, snapshots = [], []
        for k in range(last):
            out, snapshot = fns[k].first_body(h, views[k])
            borders.append(h)
            snapshots.append(snapshot)
            h = out
            del out
        loss, upstream, var_grads = fns[last].fused_body(h, views[last])
        del h
        grads: list = [None] * len(self.trainable)
        self._accumulate(grads, sections[last].variables, var_grads, in_graph=True)
        for k in range(last - 1, -1, -1):
            gate = [g for g in tf.nest.flatten(upstream) if g is not None]
            with tf.control_dependencies(gate):
                border = tf.nest.map_structure(tf.identity, borders[k])
            if self.jit_compile:  # XLA ignores control dependencies: a data dependency instead (adds zero)
                border = _after(border, gate)
            borders[k] = None
            upstream, var_grads, _ = fns[k].rerun_backward_body(border, views[k], upstream, snapshots[k], None)
            self._accumulate(grads, sections[k].variables, var_grads, in_graph=True)
        outside = self._outside_last()
        if outside:
            self._accumulate(grads, outside, self._penalty_gradients(outside), in_graph=True)
        return loss, grads

    def _graph_step(self, batch):
        loss, grads = self.graph_cycle(batch)
        with assign_in_place(self.optimizer, not self.replicas.distributed):
            self.optimizer.apply_gradients([(g, v) for g, v in zip(grads, self.trainable) if g is not None])
        return loss

    # ------------------------------------------------------------------ gradients and the update
    def _accumulate(self, grads: list, variables: list, var_grads, in_graph: bool = False) -> None:
        """Add a section's variable gradients into ``grads``; ``in_graph``: inside one replica's traced step
        (one_graph), where no per-replica values need joining."""
        for v, g in zip(variables, var_grads):
            if g is None:
                continue
            i = self._position[id(v)]
            grads[i] = g if grads[i] is None else (add_gradients(grads[i], g) if in_graph else
                                                   self.replicas.add(add_gradients, grads[i], g))

    def _release(self, grads: list, k: int, ready: str) -> None:
        """With ``ready="apply"``, apply and free the gradients section ``k``'s backward completed (the penalty's
        first: before the variables are applied)."""
        if ready == "keep":
            return
        self._add_penalty(grads, k)
        done = tuple(i for i in self.compiled.complete[k] if grads[i] is not None)
        if done:
            self._fns["parts"][k](0, [grads[i] for i in done], done, True)
        for i in done:
            grads[i] = None

    def _apply_gradients(self, grads, idx, partial: bool):
        """The optimizer's update of the variables ``idx``; ``partial``: one of a step's several (its step count
        given back, so each reads the same count and the step counts once)."""
        if self.replicas.distributed:
            # Function arguments carry no device; the all-reduce places by its inputs' devices (each replica's).
            grads = [g if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in grads]
        pairs = list(zip(grads, [self.trainable[i] for i in idx]))
        per_variable = not self.replicas.distributed and why_at_end(self.optimizer) is None
        with assign_in_place(self.optimizer, not self.replicas.distributed):
            apply_in_groups(self.optimizer, pairs, [nbytes(v) for _, v in pairs] if per_variable else None, partial)

    def _outside_last(self) -> list:
        if self.penalty is None:
            return []
        last = {id(v) for v in self.compiled.sections[-1].variables}
        return [v for v in self.penalty.variables if id(v) not in last]

    def _add_penalty(self, grads: list, group) -> None:
        variables = self._fns["penalty_groups"].get(group)
        if not variables:
            return
        fns = self._fns["penalty"]
        if group not in fns:
            fns[group] = tf.function(self.replicas.wrap(lambda: self._penalty_gradients(variables)))
        self._accumulate(grads, variables, fns[group]())

    def _penalty_gradients(self, variables):
        with tf.GradientTape() as tape:
            scaled = self.scale_loss(self.penalty.loss(variables))
        return tape.gradient(scaled, variables)

    def trace_counts(self) -> dict[str, int]:
        counts = {}
        for f in self.compiled.functions:
            counts.update(f.trace_counts())
        counts["apply"] = self._fns["apply"].tracing_count()
        for k, part in enumerate(self._fns["parts"]):
            counts[f"apply/section_{k}"] = part.tracing_count()
        if self.one_graph:
            counts["step"] = self._fns["graph_step"].tracing_count()
        return counts


def add_gradients(a, b):
    """Two gradients of one variable summed (sparse ones joined)."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _present(grads: list):
    idx = tuple(i for i, g in enumerate(grads) if g is not None)
    return [grads[i] for i in idx], idx


def _after(border, gate):
    """``border`` with a data dependency on the first gate tensor (as ``tf.recompute_grad`` does under XLA)."""
    if not gate:
        return border
    elem = tf.cast(tf.reduce_max(tf.reshape(gate[0], [-1])[:1]), tf.bool)
    zero = tf.where(tf.equal(elem, elem), 0.0, float("nan"))
    return tf.nest.map_structure(
        lambda t: t + tf.cast(zero, t.dtype) if t.dtype.is_floating else t, border)
