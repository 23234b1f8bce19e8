"""Gradient accumulation: one optimizer update per batch, from the gradients of its micro-batches.

``MicroBatched(trainer, micro_batch)`` wraps an ``Engine``, ``WholeGraph`` or ``RecomputeGrad`` before it is built.
It builds (and, with ``sections="auto"``, plans) the trainer for one micro-batch, and each ``train_step(batch)``
cuts the batch into ``ceil(batch / micro_batch)`` micro-batches of equal size (sizes differing by one where they
cannot be equal), runs the trainer's step on each without applying it, sums the gradients, each weighted by its
micro-batch's share of the batch (``size / batch``: the loss the update follows is the mean over the whole batch),
and applies them once: the optimizer steps once, its step count rises by one, the reported loss is the batch's.

For a model without batch statistics the update equals one step over the whole batch within float32 rounding.
Batch normalization is not such a model: each micro-batch is normalized by its own mean and variance, and the
moving averages update once per micro-batch. Dropout draws differ from one whole step's too (each micro-batch
draws its own masks). The engine's update moves to the end of the step (its gradients are held for the sum;
``apply_reason`` says so); the sums are variables made before planning, so the planner counts them.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import tensorflow as tf

from .. import rules
from ..backend.device import OutOfMemory
from ..backend.precision import unscale
from ..telemetry import StepReading
from .base import Trainer, _as_tensors
from .update import assign_in_place

REASON = "gradients are summed over {count} micro-batches (micro_batch={micro_batch}) and applied once per batch"


def micro_sizes(batch_size: int, micro_batch: int) -> list[int]:
    """The sizes of a batch's micro-batches: ``ceil(batch_size / micro_batch)`` of them, as equal as they can be
    (the larger first, differing by one at most), none above ``micro_batch``."""
    rules.check_micro_batch(micro_batch, batch_size)
    count = -(-batch_size // micro_batch)
    size, larger = divmod(batch_size, count)
    return [size + 1] * larger + [size] * (count - larger)


def weights(sizes: list[int]) -> list[float]:
    """Each micro-batch's share of the batch: what its mean loss (and gradient) counts for in the batch's mean."""
    total = sum(sizes)
    return [s / total for s in sizes]


class Parts(Sequence):
    """``batch`` cut along its first dimension into consecutive parts of ``sizes``, each sliced when it is read
    (so a step holds one micro-batch's copy at a time, as the dry steps that planned it did) and where its tensor
    lives (a host batch stays on the host until a step reads it)."""

    def __init__(self, batch: Mapping, sizes: list[int]):
        self.batch, self.sizes = batch, list(sizes)
        self.starts = [sum(self.sizes[:i]) for i in range(len(self.sizes))]

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> dict:
        a, b = self.starts[i], self.starts[i] + self.sizes[i]
        return {k: tf.nest.map_structure(lambda t: _rows(t, a, b), v) for k, v in self.batch.items()}


def split(batch: Mapping, sizes: list[int]) -> Parts:
    """``batch`` cut into micro-batches of ``sizes`` (``Parts``: each sliced when read)."""
    return Parts(batch, sizes)


def _rows(t, a: int, b: int):
    with tf.device(t.device or None):
        return t[a:b]


def _batch_size(batch: Mapping) -> int:
    return int(tf.nest.flatten(next(iter(batch.values())))[0].shape[0])


class MicroBatched:
    """A trainer whose step runs a batch as micro-batches of at most ``micro_batch`` examples and applies their
    summed gradients once (see the module's docstring). Everything else (``network``, ``optimizer``,
    ``evaluate``, ``describe``, ``plan``, ...) is the trainer's; ``trainer`` is the trainer itself.

    Under a ``tf.distribute`` strategy it is refused (micro-batches run on one device). Wrap the trainer before
    it is built: it is built for the micro-batch."""

    def __init__(self, trainer: Trainer, micro_batch: int):
        if not isinstance(trainer, Trainer):
            raise ValueError(f"MicroBatched wraps an Engine, WholeGraph or RecomputeGrad; got "
                             f"{type(trainer).__name__}.")
        rules.check_micro_batch(micro_batch)
        if trainer.replicas.distributed:
            raise ValueError("micro_batch: micro-batches run on one device; under a tf.distribute strategy each "
                             "replica already steps its share of the batch.")
        if trainer._built:
            raise ValueError("MicroBatched(trainer, ...): the trainer is built already; wrap it before its first "
                             "build or step, so that it is built (and planned) for the micro-batch.")
        self.trainer = trainer
        self.micro_batch = int(micro_batch)
        #: The sizes of the last batch's micro-batches.
        self.sizes: list[int] = []
        #: The batch the trainer was built for (its micro-batches: ``sizes``).
        self.batch_size: int | None = None
        self._sums: list | None = None  # one variable per trainable variable: the weighted sum of its gradients
        self._fns: dict = {}
        executor = getattr(trainer, "executor", None)
        if executor is not None and executor.apply_reason is None:  # the gradients are held for the sum
            executor.apply_reason = REASON.format(count="several", micro_batch=self.micro_batch)

    def __getattr__(self, name):
        if name == "trainer":  # before __init__ set it
            raise AttributeError(name)
        return getattr(self.trainer, name)

    # ------------------------------------------------------------------ build
    def build(self, batch: Mapping[str, tf.Tensor]) -> None:
        """Create the sums (variables the size of the trainable ones, made before the trainer plans, so planning
        and its dry steps count them) and build the trainer on the batch's first micro-batch."""
        trainer = self.trainer
        if self._sums is not None and trainer._built:
            return
        batch = _as_tensors(trainer.network, batch)
        first = split(batch, micro_sizes(_batch_size(batch), min(self.micro_batch, _batch_size(batch)))[:1])[0]
        if self._sums is None:
            trainer.network.build(first)  # the variables, so the sums can be made before planning
            self._sums = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False, name="gradient_sum")
                          for v in trainer.network.trainable_variables]
        trainer.build(first)
        self.batch_size = _batch_size(batch)
        self.sizes = micro_sizes(self.batch_size, min(self.micro_batch, self.batch_size))
        executor = getattr(trainer, "executor", None)
        if executor is not None and executor.apply_reason == REASON.format(count="several",
                                                                           micro_batch=self.micro_batch):
            executor.apply_reason = REASON.format(count=len(self.sizes), micro_batch=self.micro_batch)

    def describe_micro_batches(self) -> str:
        """What a step does, in words (after ``build``): the micro-batches, the sum, and what batch norm sees."""
        sizes, batch = self.sizes, self.batch_size
        cut = (f"{len(sizes)} of {sizes[0]}" if len(set(sizes)) == 1 else
               f"{len(sizes)} of {sizes[-1]}-{sizes[0]}")
        return (f"micro-batches: {cut} examples per batch of {batch} (micro_batch={self.micro_batch}): their "
                f"gradients, each weighted by its share of the batch, are summed and applied once per batch; batch "
                f"statistics are per micro-batch: batch norm normalizes each micro-batch by its own mean and "
                f"variance and updates its moving averages {len(sizes)} times per step, so the update equals one "
                f"step over {batch} examples (within rounding) only for a model without batch statistics")

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: Mapping[str, tf.Tensor], replan: bool = True) -> StepReading:
        """One training step over ``batch``: its micro-batches' gradients summed by their shares, one update.
        Returns a ``StepReading``: the batch's loss, each section's forward runs per micro-batch, the largest
        peaks of any micro-batch (and of the update). With ``sections="auto"`` on a device of hard memory, a step
        that runs out of memory is re-planned for the micro-batch and run again from the state before it, as the
        engine's own steps are (``replan=False``: it raises ``OutOfMemory``)."""
        trainer = self.trainer
        batch = _as_tensors(trainer.network, batch)
        self.build(batch)
        parts = self._parts(batch)
        calibrator = getattr(trainer, "calibrator", None)
        try:
            if not (replan and calibrator is not None and trainer.device_memory.hard):
                return self._step(parts)
            from .calibrate import replanning

            return replanning(trainer, lambda: self._step(parts), parts[0])
        except tf.errors.ResourceExhaustedError as err:
            raise OutOfMemory.from_error(err, trainer.meter, trainer.device_memory) from None

    def gradients(self, batch: Mapping[str, tf.Tensor], sizes: list[int] | None = None) -> tuple:
        """The batch's loss and gradients as a step sums them over its micro-batches (``sizes``: other cuts of
        the batch, e.g. the exactness check's), state updates included, not applied; unscaled, as
        ``Trainer.gradients``."""
        trainer = self.trainer
        batch = _as_tensors(trainer.network, batch)
        self.build(batch)
        parts = self._parts(batch, sizes)
        loss, present, _, _ = self._summed(parts)
        trainer.read_counters()
        grads = [None] * len(self._sums)
        for i, g in present.items():
            grads[i] = tf.identity(self._sums[i]) if g is None else g
        return tf.constant(loss), unscale(grads, trainer.optimizer)

    def _parts(self, batch, sizes=None) -> Parts:
        if sizes is None:  # the step's own cut (another, e.g. the exactness check's, is not kept)
            sizes = self.sizes = micro_sizes(_batch_size(batch), self.micro_batch)
        return split(batch, sizes)

    def _step(self, parts: Parts) -> StepReading:
        trainer = self.trainer
        loss, present, peaks, device_peaks = self._summed(parts)
        trainer.meter.reset()
        self._apply(present)
        applied = trainer.meter.peaks()
        device_peaks = {d: max(p, applied.get(d, 0)) for d, p in device_peaks.items()}
        reading = trainer._stats(tf.constant(loss), device_peaks, peaks)
        runs = [round(r / len(parts)) for r in reading.forward_runs]  # every micro-batch runs the same program
        reading = StepReading(reading.loss, runs, reading.peak_bytes, reading.step_peak_bytes,
                              reading.device_peak_bytes)
        calibrator = getattr(trainer, "calibrator", None)
        if calibrator is not None and reading.step_peak_bytes is not None:  # as the engine's own step
            schedule = calibrator.replan_if_over(reading.step_peak_bytes)
            if schedule is not None and schedule != trainer.schedule:
                trainer.adopt(schedule)
        return reading

    def _summed(self, parts: Parts):
        """Each micro-batch's gradients added into the sums, weighted by its share: the batch's loss, which
        gradients are present (``{index: None}`` for a dense sum in its variable, or the sparse sum itself),
        each section's largest backward peak (None: not measured per section) and each device's."""
        shares = weights(parts.sizes)
        total, present, peaks, device_peaks = 0.0, {}, None, {}
        for n, (part, share) in enumerate(zip(parts, shares)):
            loss, grads, section_peaks, step_peaks = self._one(part)
            total += share * float(loss)
            dense = [g if g is not None and not isinstance(g, tf.IndexedSlices) else None for g in grads]
            self._add(n == 0, dense, tf.constant(share, tf.float32))
            for i, g in enumerate(grads):
                if g is None:
                    continue
                if isinstance(g, tf.IndexedSlices):  # kept sparse, as one step over the batch would give it
                    g = tf.IndexedSlices(g.values * tf.cast(share, g.values.dtype), g.indices, g.dense_shape)
                    before = present.get(i)
                    present[i] = g if before is None else tf.IndexedSlices(
                        tf.concat([before.values, g.values], 0), tf.concat([before.indices, g.indices], 0),
                        g.dense_shape)
                else:
                    present[i] = None
            del grads, dense, part  # before the next micro-batch is sliced
            if section_peaks is not None:
                peaks = list(section_peaks) if peaks is None else [max(a, b) for a, b in zip(peaks, section_peaks)]
            for d, p in step_peaks.items():
                device_peaks[d] = max(device_peaks.get(d, 0), p)
        return total, present, peaks, device_peaks

    def _one(self, part):
        """One micro-batch's loss and gradients (of the loss as the step scales it), not applied, with its
        section peaks (None where the trainer has none) and device peaks."""
        trainer = self.trainer
        executor = getattr(trainer, "executor", None)
        if executor is not None and not executor.one_graph:
            cycle = executor.cycle(part)  # the update's gradients kept, none applied
            return cycle.loss, cycle.grads, cycle.peaks, cycle.step_peak
        trainer.meter.reset()
        loss, grads = trainer._gradients(part)
        return loss, grads, None, trainer.meter.peaks()

    def _add(self, first: bool, grads: list, share) -> None:
        key = "first" if first else "add"
        if key not in self._fns:
            self._fns[key] = tf.function(lambda gs, w: self._accumulate(first, gs, w), reduce_retracing=True)
        self._fns[key](grads, share)

    def _accumulate(self, first: bool, grads, share):
        for total, g in zip(self._sums, grads):
            if g is None:
                continue
            term = g * tf.cast(share, g.dtype)
            if first:
                total.assign(term)
            else:
                total.assign_add(term)

    def _apply(self, present: dict) -> None:
        """One update: the sums (and sparse sums) of the present gradients."""
        idx = tuple(sorted(present))
        sparse = [present[i] for i in idx if present[i] is not None]
        key = ("apply", idx)
        if key not in self._fns:
            variables = self.trainer.network.trainable_variables
            flags = [present[i] is not None for i in idx]  # which of them are sparse sums (passed in)

            def apply(sparse):
                it = iter(sparse)
                grads = [next(it) if present_sparse else self._sums[i].read_value()
                         for i, present_sparse in zip(idx, flags)]
                with assign_in_place(self.trainer.optimizer):
                    self.trainer.optimizer.apply_gradients(zip(grads, [variables[i] for i in idx]))

            self._fns[key] = tf.function(apply, reduce_retracing=True)
        self._fns[key](sparse)

    def trace_counts(self) -> dict[str, int]:
        counts = dict(self.trainer.trace_counts())
        for key, fn in self._fns.items():
            counts["micro_batch/" + (key if isinstance(key, str) else "apply")] = fn.experimental_get_tracing_count()
        return counts


def count(batch_size: int, micro_batch: int) -> int:
    """How many micro-batches a batch of ``batch_size`` is cut into."""
    return math.ceil(batch_size / micro_batch)
