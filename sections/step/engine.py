"""The engine: a cached forward pass, then a section-wise backward pass from the last section to the first."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Sequence

import numpy as np
import tensorflow as tf

from .. import rules
from ..backend.device import OutOfMemory, release, requested_bytes
from ..backend.profile import SectionProbe, gradient_bytes, probe_slice, profile_blocks
from ..backend.lean import lean_scope
from ..backend.memory import one_op_order
from ..backend.relaxed import RelaxedFunction
from ..backend.replicas import local_size
from ..backend.structure import nbytes
from ..network.network import Network
from ..schedule.planner import NoPlanFits, plan_measured
from ..schedule.policies import KEEP_INPUT, Recompute, resolve
from ..schedule.program import FORWARD, HOLD, LOSS, RESUME, Schedule, kept_policy
from .base import Trainer, _as_tensors, add_gradients
from .compile import ReplayMismatchError, SectionFunctions
from .update import assign_in_place, why_at_end

__all__ = ["Engine", "ReplayMismatchError", "BudgetExceededError", "OutOfMemory"]
log = logging.getLogger("sections")
MAX_REPLANS = 3  # corrections of the cost model by measured steps before a step over the budget stops
DRY_STEPS = 3  # at most this many steps at build (state restored after) measure what a plan's prediction leaves out
# Dry steps timed this close to the fastest count as ties, broken by fewer forward runs: one timed run per plan
# moves by 3-5% on a shared CPU (the notebook ResNet's 0.30 plan flipped between 3 and 4 sections between runs).
TIME_NOISE = 0.05
# The least a dry step's spread counts as, a fraction of its peak: with oneDNN off, steps read up to 0.2% (150 KiB
# on a 76 MiB step) over their dry step's two equal runs (kernel scratch of Eigen's thread pool).
DRY_NOISE = 0.005


class BudgetExceededError(ValueError):
    """A step's measured peak went over ``memory_budget`` and no plan with corrected costs fits it."""


class Engine(Trainer):
    """Trains a ``Network`` section by section, exactly like one whole-graph step.

    Args:
        network: the chain of blocks and its loss.
        optimizer: a Keras 3 optimizer; one update per step, over every section's gradients (see ``apply``).
        sections: an int (that many contiguous sections balanced by activation bytes counted from shapes),
            a list of boundary names (a block name: a section starts there; a Keras model's layer name: a section
            ends with it), ``"auto"`` (the planner picks boundaries, policies
            and which borders to keep under ``memory_budget``), or a ``Schedule``.
        policy: a policy name (``"recompute"``, ``"store"``, ``"recreate"``), a ``sections.Policy``, or one
            per section.
        jit_compile: compile the section functions with XLA.
        check: compare each re-run's output with its first run and raise on a mismatch.
        memory_budget: for ``sections="auto"``: bytes, a size like ``"2GiB"``, or a fraction of the device's memory
            (``0.8``, ``"80%"``); default (None) the device's memory (``sections.device_memory``: a GPU's, or a CPU
            allocator's ``TF_CPU_BFC_MEM_LIMIT_IN_MB``, else physical memory) less ``HEADROOM``. On a device with a
            hard limit, a step that runs out of memory is re-planned and run again from the state before it.
        one_graph: compile the whole step (forward, every section's re-run and backward, the optimizer) into one
            ``tf.function``, each re-run gated on the gradient from the section after it (so it cannot be hoisted
            into the first forward) and replaying that section's state snapshot, as the sectioned cycle does.
            Borders and upstream gradients are then graph intermediates the executor frees when spent, and it
            may overlap independent work across sections. Every section ``recompute`` (no ``store``,
            ``recreate`` or planner), no ``check``; ``peak_bytes`` per section reads ``None`` (only the step's
            peak is measured).
        lean: run batch normalization (training mode), leaky ReLU and softplus layers with gradients that keep
            less (``sections.backend.lean``): the same forward ops, the same math, equal within rounding; ``False``:
            every layer's own Keras gradient (bit-identical to a whole-graph step where the graphs match);
            ``"recompute"``: lean, and a convolution or dense layer whose input a batch norm made (directly or
            through a ReLU) keeps nothing of it: its backward re-makes the input from what the batch norm keeps,
            running at most one more producer layer (lower peaks inside blocks, more forward work).
        apply: ``"in_backward"``: apply each section's gradients as soon as its backward made them (and free
            them), so no step holds every gradient at once; the same update as one apply (same step count,
            learning rate and math per variable) for Keras's per-variable optimizers (``sections.step.update``),
            an error for others. ``"at_end"``: one apply after the whole backward. ``"auto"`` (default):
            ``in_backward`` where it is exact, else ``at_end`` (``apply_reason`` says why).
        probe_batch: examples the planner's per-block probe runs (``sections="auto"`` only); default: the real
            batch (one replica's share), so its memory and time are measured, not scaled from a small slice.
        device: where memory is measured (default ``GPU:0`` when there is a GPU, else ``CPU:0``; under a
            strategy, its replica devices).
        distribute: a ``tf.distribute`` strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``) to run
            every section on each replica with its share of the global batch. Create the optimizer (and the
            model, if you build it yourself) under ``strategy.scope()``; ``batch`` stays the global batch.

    Example:
        >>> engine = Engine(net, keras.optimizers.Adam(1e-3), sections=4)
        >>> stats = engine.train_step(batch)
        >>> stats["loss"], stats["forward_runs"], stats["peak_bytes"]
    """

    strategy = "sectioned"

    def __init__(self, network: Network, optimizer, sections: int | Sequence[str] | str = 1,
                 policy="recompute", jit_compile: bool = False, check: bool = False,
                 memory_budget: int | str | None = None, probe_batch: int | None = None, device: str | None = None,
                 distribute=None, one_graph: bool = False, lean: bool | str = True, apply: str = "auto"):
        sections = rules.as_sections(sections)
        fixed = sections if isinstance(sections, Schedule) else None
        if fixed is not None:  # a schedule made earlier (plan_schedule, or by hand)
            sections, policy = fixed.num_sections, list(fixed.policies)
        super().__init__(network, optimizer, sections, policy, jit_compile, memory_budget, probe_batch, device,
                         distribute)
        self.check = bool(check)
        self.one_graph = bool(one_graph)
        self.lean = rules.check_lean(lean)
        self.apply = rules.check_apply(apply)
        #: Why the update runs once after the whole backward (``None``: it runs section by section in it).
        self.apply_reason = why_at_end(optimizer, self.replicas.distributed, self.one_graph)
        if self.apply == "at_end":
            self.apply_reason = "apply='at_end'"
        elif self.apply == "in_backward" and self.apply_reason is not None and optimizer is not None:
            raise ValueError(f"apply='in_backward' would not equal one update: {self.apply_reason}; use "
                             f"apply='at_end' or 'auto'.")
        if self.one_graph and (check or sections == "auto" or fixed is not None):
            raise ValueError("one_graph=True compiles a fixed recompute partition into one step: it takes no "
                             "check mode, sections='auto' or Schedule.")
        self._fixed = fixed
        if sections != "auto":
            count = sections if isinstance(sections, int) else len(sections) + 1
            self._policies = [resolve(p) for p in rules.policies_for(policy, count)]
            if self.one_graph and any(type(p) is not Recompute for p in self._policies):
                raise ValueError(f"one_graph=True runs every section with policy 'recompute'; got "
                                 f"{[p.name for p in self._policies]}.")
        self.profiles = None
        self.schedule: Schedule | None = None
        self.replans: list[str] = []
        self._activation_scale = 1.0  # the planner's activation costs times this: corrected by measured steps
        self._plan_kept = False
        self.fixed_extra = 0  # bytes a dry step measured beside the computed base (what the model leaves out)
        self._refusal: NoPlanFits | None = None
        self._dry_spread = 0  # the most a dry step's repeated runs differed (at least DRY_NOISE of its peak)
        # Variables the loss updates beside the network's state (Keras metrics under fit): dry steps restore them.
        self.dry_state = lambda: ()

    # ------------------------------------------------------------------ partition
    def _settle(self, batch):
        if self._fixed is not None:
            schedule = self._fixed
        elif self._sections_arg == "auto":
            if not self.meter.available:
                from ..allocator import missing_statistics_advice

                raise ValueError(f"sections='auto' plans on measured memory, but the allocator of "
                                 f"{', '.join(self.meter.devices)} keeps no statistics: "
                                 f"{missing_statistics_advice()}.")
            real = self._probe[1]
            small, self.profiles = self._profile(batch, self.probe_batch or real, real)
            self.section_probe = SectionProbe(self.network, small, real, self.meter)
            try:
                self.plan = self._plan()
            except NoPlanFits as err:  # its smallest plan is dry-run before the refusal is told (build)
                self.plan, self._refusal = err.plan, err
            schedule = self.plan.schedule
        else:
            starts = self._starts if self._starts is not None else self._balanced_starts(self._sections_arg)
            schedule = Schedule(tuple(starts), tuple(self._policies))
        self.schedule = schedule
        return list(schedule.starts), [p.name for p in schedule.policies]

    def _profile(self, batch, probe: int, real: int):
        """The per-block probe at ``probe`` examples; where the device has no memory for it, at half as many (down
        to one), its figures scaled to the real batch. Returns the probe slice and the profiles."""
        while True:
            small, _ = probe_slice(self.network, batch, probe)
            try:
                with lean_scope(self.lean):  # the blocks measured as the sections will run them
                    return small, profile_blocks(self.network, small, real, self.meter)
            except tf.errors.ResourceExhaustedError as err:
                release(err)
                if probe == 1:
                    raise NoPlanFits(f"memory_budget={rules.human_bytes(self.memory_budget)} "
                                     f"({self.budget_source}): one block's probe of one example ran out of the "
                                     f"device's memory ({self.device_memory.describe()}); no plan can fit.",
                                     0, None, 0) from None
                log.warning(f"the block probe at {probe} examples ran out of device memory; probing "
                            f"{probe // 2} and scaling to {real}")
                self.probe_batch = probe = probe // 2
                del small

    def _plan(self, scale: float = 1.0, margin: float | None = None):
        probe = self.section_probe
        options = {} if margin is None else {"margin": margin}
        with lean_scope(self.lean):  # blocks and sections are measured (lazily, here) as the sections will run
            return plan_measured(self.profiles, nbytes(self._input_specs), self.memory_budget, probe,
                                 spread=probe.largest_spread, base_bytes=self._base_bytes(),
                                 extra_bytes=self.fixed_extra, activation_scale=scale, **self._gradient_costs(),
                                 **options)

    def build(self, batch) -> None:
        """As ``Trainer.build``; with ``sections="auto"``, then dry steps (``_calibrate``)."""
        if self._built:
            return
        super().build(batch)
        if self.plan is None:
            return
        if self.meter.available and not self.replicas.distributed:
            self._calibrate(self.replicas.split(dict(_as_tensors(self.network, batch))))
        self.section_probe.release()  # planning is done (also before each dry step): a re-plan re-computes them
        if self._refusal is not None:
            self._built = False
            raise self._refusal

    def _calibrate(self, batch) -> None:
        """Dry steps: run plans' steps with their state restored after and keep the fastest one that fits.

        The planner composes a peak from what it measured of each section; a real step also holds what no section
        probe sees (the executor's buffers, kernel scratch, tensors the Python loop still references) and can
        hold less (sections measured alone keep more than they do inside a step). The gap between a dry step and
        its prediction joins the fixed cost (either way) and the schedule is planned again: a plan predicted too
        high makes room for a faster one, too low for a smaller one; each new schedule is dry-run too (up to
        ``DRY_STEPS``), and then the plan the model predicts fastest under the whole budget, without its safety margin
        (``_try_bolder``). A plan fits when its dry step plus the run-to-run spread is within the budget and, unless
        ops run in one order (``_fits``), the dry step within ``1 - margin / 2`` of it; of those, the one whose dry step ran fastest
        (timed, not predicted: the planner's re-run time model ranks close plans wrongly; within ``TIME_NOISE``, the
        one re-running fewest forwards) runs, its prediction what
        its dry step measured (or the optimizer update's, if larger; a plan restored from earlier is dry-run again,
        ``_choose``). When none fits, the refusal names the smallest dry step measured and the
        budget that would fit it. A dry step that reads 0 bytes (every allocation below the allocator's resolution)
        checks nothing: ``memory_measured`` turns False and ``memory_note`` says why."""
        # (plan, measured peak, the fixed cost that makes its prediction the measurement, state, seconds)
        runs: list = []
        for _ in range(DRY_STEPS):
            measured, seconds = self._dry_step(batch)
            if not measured:  # nothing counted: the plans fit on shapes alone; memory_note says so
                self.below_resolution = True
            self.fixed_extra = measured - (self.plan.predicted_peak - self.plan.extra_bytes)
            runs.append((self.plan, measured, self.fixed_extra, self._compiled(), seconds))
            fitting = [run for run in runs if self._fits(run[1])]
            try:
                plan, refusal = self._plan(self._activation_scale), None
            except NoPlanFits as err:
                plan, refusal = err.plan, err
            done = fitting and not _reruns(fitting[-1][0])  # nothing re-run: none is faster
            if done or (refusal is not None and fitting) or any(plan.schedule == run[3][0] for run in runs):
                break
            self.plan, self._refusal = plan, refusal
            self._adopt(plan.schedule)
        self._try_bolder(batch, runs)
        chosen = self._choose(batch, runs)
        if chosen is not None:
            plan, measured, self.fixed_extra, state, _ = chosen
            self._refusal = None
            # Its step is what its dry step measured (the model's figure for it may be far above: the plan for the
            # whole budget is predicted without a correction from its own dry step), or the update, which no dry
            # step runs.
            self.plan = replace(plan, predicted_peak=max(measured, plan.apply_peak), budget=self.memory_budget,
                                extra_bytes=self.fixed_extra)
            if len(runs) > 1:
                tried = ", ".join(f"{rules.human_bytes(m)} in {t:.2f} s ({_sections(p)})" for p, m, _, _, t in runs)
                self._log_replan(f"dry steps measured {tried}; the fastest plan that fits the budget "
                                 f"{rules.human_bytes(self.memory_budget)} runs ({_sections(plan)})")
            return
        if not runs:  # no dry steps: the model's plan (or refusal) stands
            return
        plan, measured = min(runs, key=lambda run: run[1])[:2]
        advised = self._advised(measured)
        rule = (f"a plan runs when its dry step plus the {rules.human_bytes(self._spread())} by which its runs "
                f"differed is within the budget (ops run in one order: steps repeat their dry step's peak)"
                if one_op_order() else
                f"a plan runs when its dry step plus the {rules.human_bytes(self._spread())} by which identical runs "
                f"may differ is within the budget and the dry step within {1 - plan.margin / 2:.0%} of it")
        self._refusal = NoPlanFits(
            f"memory_budget={rules.human_bytes(self.memory_budget)} ({self.memory_budget} bytes"
            f"{'' if self.budget_source == 'given' else '; ' + self.budget_source}): no partition "
            f"fits; the smallest plan's dry step (run at build, its state restored) measured "
            f"{rules.human_bytes(measured)} "
            f"({measured} bytes); {rule}, and another run's dry step may read "
            f"{rules.human_bytes(self._order_spread())} higher: the smallest budget that fits is about "
            f"{rules.human_bytes(advised)}.",
            measured, plan, advised)

    def _choose(self, batch, runs: list):
        """Of the dry-step runs that fit, the fastest (``_fastest``), or None. One that is not the schedule run
        last has its functions restored and its dry step run again: after other plans' steps the heap lies
        otherwise, and the steps that follow repeat what it then holds (a restored plan's steps read 141 MiB over
        its dry step on ResNet50 at batch 256). The larger figure stands (in ``runs`` too); a plan that no longer
        fits gives way to the next fastest."""
        while True:
            fitting = [run for run in runs if self._fits(run[1])]
            if not fitting:
                return None
            run = _fastest(fitting)
            plan, measured, extra, state, seconds = run
            if state[0] is self.schedule:
                return run
            self._restore(state)
            self.plan = plan
            again, _ = self._dry_step(batch)
            if again > measured:
                runs[next(i for i, r in enumerate(runs) if r is run)] = run = (
                    plan, again, extra + again - measured, state, seconds)
            if self._fits(run[1]):
                return run

    def _try_bolder(self, batch, runs: list) -> None:
        """One more dry step, of the plan the model predicts fastest under the whole budget (no safety margin),
        where it re-runs fewer forwards than every plan that fit so far. The margin covers the model's error, but
        a dry step measures the plan itself: where the model over-predicts (a large fused section keeps less than
        its probes add up to) the margin alone would run plans that re-run far more than the budget needs. A dry
        step the device has no memory for counts as not fitting."""
        fitting = [run for run in runs if self._fits(run[1])]
        if not runs or any(not _reruns(run[0]) for run in fitting):
            return
        try:
            bold = self._plan(self._activation_scale, margin=0.0)
        except NoPlanFits:
            return
        if any(bold.schedule == run[3][0] for run in runs) or (
                fitting and sum(bold.forward_runs) >= min(sum(run[0].forward_runs) for run in fitting)):
            return
        self.plan = bold
        self._adopt(bold.schedule)
        measured, seconds = self._dry_step(batch)
        runs.append((bold, measured, measured - (bold.predicted_peak - bold.extra_bytes), self._compiled(), seconds))

    def _run_spread(self) -> int:
        """The most the probe's sections or a dry step's two runs moved."""
        return max(self.section_probe.largest_spread(), self._dry_spread)

    def _order_spread(self) -> int:
        """How far a step's peak may move between identical runs: ``_run_spread``, and at least the largest block
        output (the executor's op order may keep one more activation alive; a few runs need not show it)."""
        largest = max((p.output_bytes for p in self.profiles or ()), default=0)
        return max(self._run_spread(), largest)

    def _spread(self) -> int:
        """What a step may hold beyond its plan's dry step: with ops on one inter-op thread (``one_op_order``) a
        compiled function runs them in one order every call, so ``_run_spread``; else ``_order_spread``."""
        return self._run_spread() if one_op_order() else self._order_spread()

    def _ceiling(self, plan) -> float:
        """How close to its budget a step may come: the budget itself with one op order (steps repeat their dry
        step); else ``1 - margin / 2`` of it (the order may flip)."""
        return plan.budget if one_op_order() else (1 - plan.margin / 2) * plan.budget

    def _fits(self, measured: int) -> bool:
        """Whether a plan whose dry step measured ``measured`` bytes runs under the budget: the dry step plus the
        spread within the budget, the dry step within ``_ceiling``."""
        return (measured + self._spread() <= self.memory_budget
                and measured <= self._ceiling(replace(self.plan, budget=self.memory_budget)))

    def _advised(self, measured: int) -> int:
        """The smallest budget (whole MiB) that a plan whose dry step measured ``measured`` fits in another run:
        another process may settle on another op order (even with one thread), so its dry step may read up to the
        order spread higher."""
        again = measured + self._order_spread()
        need = max(again + self._order_spread(), again / (1 - self.plan.margin / 2))
        return math.ceil(need / 2**20) * 2**20

    def _compiled(self) -> tuple:
        """What ``_adopt`` makes for the current schedule, to return to it without compiling again."""
        return (self.schedule, self.sections, self._counters, self._fields, self._fns, self._apply, self._complete,
                self._apply_parts, getattr(self, "_graph_train", None), getattr(self, "_graph_grads", None))

    def _restore(self, state: tuple) -> None:
        (self.schedule, self.sections, self._counters, self._fields, self._fns, self._apply, self._complete,
         self._apply_parts, self._graph_train, self._graph_grads) = state

    def _dry_step(self, batch) -> tuple[int, float]:
        """A step's cycle run unapplied, twice, state (batch-norm statistics, seeds, ``dry_state()``) and counters
        restored after each: the larger peak and the last run's seconds (the first traces). Where the two runs
        differ by more than ``DRY_NOISE``, the first is set aside and a third runs: a first run of new functions
        meets another heap than later ones (on ResNet50 at batch 256 it read 25-110 MiB off, either way), and the
        steps after build repeat the later runs' figure. What the kept runs differ by (at least ``DRY_NOISE``)
        is the spread the fit rule leaves.
        The section probe's cached borders are dropped first: training will not hold them (a later plan re-computes
        the ones it needs). Where the update runs in the backward, its parts run too (their temporaries fall
        inside the backward). The state is saved as host arrays (NumPy: outside every device allocator, so the
        measured heap is the step's own; copies held on the CPU allocator filled the chunk allocator's gaps and
        read 68 MiB under the steps on ResNet50) and written back into the variables' own buffers."""
        self.section_probe.release()
        state = [*self.network.non_trainable_variables, *self.dry_state()]
        applied = self.apply_reason is None
        if applied:
            state += [*self._trainable, *self.optimizer.variables]
        saved = [v.numpy().copy() for v in state]
        peaks, seconds = [], 0.0
        while len(peaks) < 2 or (len(peaks) == 2 and _apart(*peaks)):
            start = time.perf_counter()
            try:
                _, _, _, step_peak = self._cycle(batch, ready="apply" if applied else "keep")
            except tf.errors.ResourceExhaustedError as err:
                # The device has no memory for this plan: it reads as at least what was in use when the request
                # failed plus the request, and over the budget (a fragmented heap fails below its limit).
                request, _ = requested_bytes(err)
                release(err)
                failed = max(self.meter.peak() + (request or 0), self.memory_budget + 1)
                self._restore_state(state, saved)
                self._read_counters()
                log.info(f"a dry step of {_sections(self.plan)} ran out of device memory (at least "
                         f"{rules.human_bytes(failed)}): it does not fit")
                return failed, math.inf
            seconds = time.perf_counter() - start
            self._restore_state(state, saved)
            peaks.append(max(step_peak.values()))
        self._read_counters()
        kept = peaks[-2:]
        self._dry_spread = max(self._dry_spread, max(kept) - min(kept), math.ceil(DRY_NOISE * max(kept)))
        return max(kept), seconds

    @staticmethod
    def _restore_state(state: list, saved: list) -> None:
        for v, value in zip(state, saved):
            value = tf.convert_to_tensor(value, v.dtype)
            v.assign(value)  # held here: TensorFlow copies it into the variable's buffer instead of adopting it
            del value

    def _adopt(self, schedule: Schedule) -> None:
        """Sections, counters and compiled functions for a new schedule."""
        self.schedule = schedule
        self._make_sections(list(schedule.starts), [p.name for p in schedule.policies])
        self._counters = self._make_counters()
        self._fields = [self.network.fields_for(s.start, s.stop, list(self._probe[0])) for s in self.sections]
        self._compile()

    def _base_bytes(self) -> int:
        """Memory alive through a whole step: variables, the optimizer's own variables (slots) and the batch."""
        if not getattr(self.optimizer, "built", False):
            self.optimizer.build(self.network.trainable_variables)
        variables = sum(nbytes(v) for v in self.network.variables)
        slots = sum(nbytes(v) for v in self.optimizer.variables)
        return variables + slots + self._batch_bytes

    def _apply_bytes(self) -> int:
        """The optimizer update's temporaries beside every gradient: about two of the largest variable."""
        return 2 * max((nbytes(v) for v in self.network.trainable_variables), default=0)

    def _gradient_costs(self) -> dict:
        """The planner's gradient figures: each block's gradients, held from its backward until the update. Updated
        in the backward, no section waits on a later one's, and each update holds one section's gradients (those
        are in its measured backward too): the update is counted with the largest block's."""
        grads = gradient_bytes(self.network)
        if self.apply_reason is None:
            return {"grad_bytes": None, "apply_bytes": self._apply_bytes() + max(grads, default=0)}
        return {"grad_bytes": grads, "apply_bytes": self._apply_bytes()}

    def _compile(self) -> None:
        self._fns = [SectionFunctions(self.network, s, c, self.jit_compile, scale_loss=self._scale_loss,
                                      replicas=self.replicas, lean=self.lean)
                     for s, c in zip(self.sections, self._counters)]
        # Sparse (embedding) gradients change length with the batch's shapes: their length is left unknown.
        self._apply = RelaxedFunction(self.replicas.wrap(self._apply_gradients), self.jit_compile, batch_args=())
        self._complete = self._complete_after()
        # apply="in_backward": one function per section (each updates its own variables: traced once)
        self._apply_parts = [RelaxedFunction(self.replicas.wrap(self._apply_gradients), self.jit_compile, batch_args=())
                             for _ in self.sections] if self.apply_reason is None else []
        if self.one_graph:
            self._graph_train = RelaxedFunction(self.replicas.wrap(self._graph_step), self.jit_compile, (0,))
            self._graph_grads = RelaxedFunction(self.replicas.wrap(self._graph_cycle), self.jit_compile, (0,))

    def _complete_after(self) -> list[tuple[int, ...]]:
        """Per section, the variables (indices into the trainable ones) whose gradient is whole once its backward
        has run: those of no earlier section (the backward runs from the last section to the first)."""
        first = {}
        for section in self.sections:
            for v in section.variables:
                first.setdefault(self._var_index.get(id(v)), section.index)
        first.pop(None, None)  # non-trainable
        return [tuple(sorted(i for i, k in first.items() if k == section.index)) for section in self.sections]

    def _policy_label(self, section) -> str:
        return "fused (last)" if section.index == len(self.sections) - 1 else section.policy

    # ------------------------------------------------------------------ the step
    def _step(self, batch) -> dict:
        """One step. With ``sections="auto"`` on a device of fixed memory, a step that runs out of memory is
        re-planned below what it reached (dry steps, as at build) and run again from the state before it (saved
        on the host each step), so its loss is an uninterrupted run's; anywhere else it raises ``OutOfMemory``."""
        if not (self.plan is not None and self.device_memory.hard and not self.replicas.distributed):
            return self._run_step(batch)
        state = [*self.network.variables, *self.dry_state(), *self.optimizer.variables]
        saved = [v.numpy().copy() for v in state]
        for attempt in range(MAX_REPLANS + 1):
            try:
                return self._run_step(batch)
            except tf.errors.ResourceExhaustedError as failed:
                err = OutOfMemory.from_error(failed, self.meter, self.device_memory)
                del failed
                self._restore_state(state, saved)
                self._read_counters()
                if attempt == MAX_REPLANS:
                    raise
                self._replan_below(err, batch)
        raise AssertionError("unreachable")

    def _replan_below(self, err: "OutOfMemory", batch) -> None:
        """After a step ran out of memory: the budget comes down below what was in use when it failed (the
        allocator could hold no more there: its chunks, or a step heavier than its dry step), unless the failing
        request alone was larger than the device (no plan makes that fit: the budget stays); the plan is then
        dry-run again and re-planned, as at build."""
        hb = rules.human_bytes
        total = err.device.total or self.memory_budget
        if err.requested is None or err.requested < total:
            self.memory_budget = min(self.memory_budget, max(1, int(err.in_use * (1 - DRY_NOISE))))
        self._log_replan(f"a step ran out of device memory ({err}); re-planning under "
                         f"{hb(self.memory_budget)} and running the step again from the state before it")
        self._calibrate(batch)
        if self._refusal is not None:
            refusal, self._refusal = self._refusal, None
            raise OutOfMemory(f"{err}; no plan fits below it: {refusal}", err.device, err.requested,
                              err.shape, err.in_use) from None

    def _run_step(self, batch) -> dict:
        if self.one_graph:
            self.meter.reset()
            loss = self._graph_train(local_size(batch, self.replicas), batch)
            return self._stats(loss, self.meter.peaks())
        if self.apply_reason is None:
            loss, _, peaks, device_peaks = self._cycle(batch, ready="apply")
        else:
            loss, grads, peaks, step_peak = self._cycle(batch)
            self.meter.reset()
            self._apply(0, *self._present(grads), False)
            apply_peaks = self.meter.peaks()
            device_peaks = {d: max(p, apply_peaks[d]) for d, p in step_peak.items()}
        stats = self._stats(loss, device_peaks, peaks)
        if self.plan is not None and stats["step_peak_bytes"] is not None:
            # The plan is per replica; replicas on logical CPU devices share one allocator (read as their total).
            sharing = max(1, len(self.replicas.devices()) // len(self.meter.devices))
            self._replan_if_over(stats["step_peak_bytes"] // sharing)
        return stats

    def _gradients(self, batch):
        if self.one_graph:
            return self._graph_grads(local_size(batch, self.replicas), batch)
        loss, grads, _, _ = self._cycle(batch)
        return loss, grads

    # ------------------------------------------------------------------ the step as one graph (one_graph=True)
    def _graph_cycle(self, batch):
        """``_cycle`` traced into one graph (recompute everywhere). Section k's re-run reads its input border
        through an identity that waits for the gradient on its output: without that gate the executor (or
        Grappler's common-subexpression pass) would run or merge the re-run with the first forward, and keep
        every activation alive as a whole-graph step does."""
        fns, last = self._fns, len(self.sections) - 1
        views = self._views(batch)
        h = batch[self.network.inputs]
        borders, snapshots = [], []
        for k in range(last):
            out, snapshot = fns[k]._first(h, views[k])
            borders.append(h)
            snapshots.append(snapshot)
            h = out
            del out
        loss, upstream, var_grads = fns[last]._fused(h, views[last])
        del h
        grads: list = [None] * len(self._trainable)
        self._accumulate(grads, self.sections[last].variables, var_grads, in_graph=True)
        for k in range(last - 1, -1, -1):
            gate = [g for g in tf.nest.flatten(upstream) if g is not None]
            with tf.control_dependencies(gate):
                border = tf.nest.map_structure(tf.identity, borders[k])
            if self.jit_compile:  # XLA ignores control dependencies: a data dependency instead (adds zero)
                border = _after(border, gate)
            borders[k] = None
            upstream, var_grads, _ = fns[k]._rerun_backward(border, views[k], upstream, snapshots[k], None)
            self._accumulate(grads, self.sections[k].variables, var_grads, in_graph=True)
        return loss, grads

    def _graph_step(self, batch):
        loss, grads = self._graph_cycle(batch)
        with assign_in_place(self.optimizer, not self.replicas.distributed):
            self.optimizer.apply_gradients([(g, v) for g, v in zip(grads, self._trainable) if g is not None])
        return loss

    def _cycle(self, batch, ready: str = "keep"):
        """One step's gradients: the schedule's program run in order (the cached forward pass, the fused last
        section, then the backward from the last section to the first, re-creating dropped input borders).

        ``ready``: what becomes of a variable's gradient once the backward has made all of it: ``"keep"`` (returned)
        or ``"apply"`` (applied there and freed: ``apply="in_backward"``). ``kept[k]`` is what section k keeps for
        its backward, as ``(policy, what it kept)``.
        """
        schedule, fns, meter = self.schedule, self._fns, self.meter
        last = len(self.sections) - 1
        views = self._views(batch)
        kept = [None] * (last + 1)
        snapshots = [None] * (last + 1)  # each section's state before its first run: every re-run replays it
        grads: list = [None] * len(self._trainable)
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
                self._accumulate(grads, self.sections[k].variables, var_grads)
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
                self._accumulate(grads, self.sections[k].variables, var_grads)
                del var_grads
                self._release(grads, k, ready)
                measured(k)
        if ready == "apply":
            self.optimizer.iterations.assign_add(1)  # the step's one count (each partial update gave its own back)
        return loss, grads, peaks, step_peak

    def _release(self, grads: list, k: int, ready: str) -> None:
        """With ``ready="apply"``, apply and free the gradients section ``k``'s backward completed."""
        if ready == "keep":
            return
        done = tuple(i for i in self._complete[k] if grads[i] is not None)
        if done:
            self._apply_parts[k](0, [grads[i] for i in done], done, True)
        for i in done:
            grads[i] = None

    def _replan_if_over(self, measured: int) -> None:
        """Every step: a measured peak above the plan's prediction corrects the cost model and re-plans (up to
        ``MAX_REPLANS`` times); a step over the budget when no corrected plan fits stops training. A step above
        the prediction by no more than ``_order_spread``, inside ``1 - margin / 2`` of the budget (with one op
        order: inside the budget), is the executor's op order, not a model error: no re-plan (each would recompile
        the sections)."""
        hb, old = rules.human_bytes, self.plan
        # Within the budget, a step over its dry step by no more than an op-order flip is noise, not a model error:
        # steps of some models (keras.applications ResNet50 on oneDNN) move by tens of MiB even on one thread.
        noise = self._order_spread() if measured <= self._ceiling(old) else 0
        if measured <= old.predicted_peak + noise:
            return
        over_budget = measured > old.budget
        scale = self._activation_scale * (measured - old.base_bytes) / max(1, old.predicted_peak - old.base_bytes)
        over = f"measured step peak {hb(measured)} exceeded the plan's prediction {hb(old.predicted_peak)}"
        if len(self.replans) >= MAX_REPLANS:
            if over_budget:
                raise BudgetExceededError(f"{over} and the budget {hb(old.budget)} after {len(self.replans)} "
                                          f"corrections of the cost model; give a larger memory_budget") from None
            return
        try:
            plan = self._plan(scale)
        except ValueError as err:
            if over_budget:
                raise BudgetExceededError(f"{over} and the budget {hb(old.budget)}; with activation costs corrected "
                                          f"by {scale:.3g}: {err}") from None
            if not self._plan_kept:  # inside the budget all the same (the margin absorbed the error): it stays
                self._plan_kept = True
                self._log_replan(f"{over} but not the budget {hb(old.budget)}; with activation costs scaled by "
                                 f"{scale:.3f} no plan fits inside the safety margin, so the plan stays")
            return
        self._activation_scale, self.plan = scale, plan
        budget_note = f" (over the budget {hb(old.budget)})" if over_budget else ""
        self._log_replan(f"{over}{budget_note}; activation costs scaled by {scale:.3f} and re-planned: "
                         f"{len(old.schedule.starts) + 1} -> {len(plan.schedule.starts) + 1} sections, "
                         f"predicted peak {hb(plan.predicted_peak)}")
        if plan.schedule != self.schedule:
            self._adopt(plan.schedule)

    def _log_replan(self, message: str) -> None:
        self.replans.append(message)
        log.warning(message)

    def _accumulate(self, grads: list, variables: list, var_grads, in_graph: bool = False) -> None:
        """Add a section's variable gradients into ``grads``; ``in_graph``: inside one replica's traced step
        (one_graph), where no per-replica values need joining."""
        for v, g in zip(variables, var_grads):
            if g is None:
                continue
            i = self._var_index[id(v)]
            grads[i] = g if grads[i] is None else (add_gradients(grads[i], g) if in_graph else
                                                   self.replicas.add(add_gradients, grads[i], g))

    def _present(self, grads: list):
        idx = tuple(i for i, g in enumerate(grads) if g is not None)
        return [grads[i] for i in idx], idx

    def _apply_gradients(self, grads, idx, partial: bool):
        """The optimizer's update of the variables ``idx``; ``partial``: one of a step's several (its step count
        given back, so each reads the same count and the step counts once)."""
        if self.replicas.distributed:
            # Function arguments carry no device; the all-reduce places by its inputs' devices (each replica's).
            grads = [g if isinstance(g, tf.IndexedSlices) else tf.identity(g) for g in grads]
        with assign_in_place(self.optimizer, not self.replicas.distributed):
            self.optimizer.apply_gradients(zip(grads, [self._trainable[i] for i in idx]))
        if partial:
            self.optimizer.iterations.assign_sub(1)

    def flops(self) -> list[dict]:
        """Forward and backward FLOPs per section at the real batch (TensorFlow's cost analysis; traces each
        section once more, so call it once)."""
        from .flops import section_flops

        self._require_built()
        return section_flops(self)

    def _trace_counts(self) -> dict[str, int]:
        counts = {}
        for f in self._fns:
            counts.update(f.trace_counts())
        counts["apply"] = self._apply.tracing_count()
        for k, part in enumerate(self._apply_parts):
            counts[f"apply/section_{k}"] = part.tracing_count()
        if self.one_graph:
            counts["step"] = self._graph_train.tracing_count()
        return counts


def _fastest(runs: list) -> tuple:
    """Of dry-step runs ``(plan, peak, extra, state, seconds)`` that fit, the one to keep: one re-running nothing
    if any (the fastest by construction: a timing's noise must not say otherwise); else, of those timed within
    ``TIME_NOISE`` of the fastest, the one re-running fewest forwards (then faster, then smaller)."""
    quiet = [run for run in runs if not _reruns(run[0])]
    if quiet:
        return min(quiet, key=lambda run: (run[4], run[1]))
    best = min(run[4] for run in runs)
    near = [run for run in runs if run[4] <= best * (1 + TIME_NOISE)]
    return min(near, key=lambda run: (sum(run[0].forward_runs), run[4], run[1]))


def _apart(first: int, second: int) -> bool:
    """Whether two runs of one dry step differ by more than ``DRY_NOISE`` of the larger."""
    return abs(first - second) > DRY_NOISE * max(first, second)


def _reruns(plan) -> bool:
    """Whether a plan runs some section's forward more than once."""
    return max(plan.forward_runs, default=1) > 1


def _sections(plan) -> str:
    n = plan.schedule.num_sections
    return f"{n} section" + ("s" if n != 1 else "")


def _after(border, gate):
    """``border`` with a data dependency on the first gate tensor (as ``tf.recompute_grad`` does under XLA)."""
    if not gate:
        return border
    elem = tf.cast(tf.reduce_max(tf.reshape(gate[0], [-1])[:1]), tf.bool)
    zero = tf.where(tf.equal(elem, elem), 0.0, float("nan"))
    return tf.nest.map_structure(
        lambda t: t + tf.cast(zero, t.dtype) if t.dtype.is_floating else t, border)

