"""Planning under a memory budget: the pure planner's plan on measured block costs, corrected by dry steps (plans'
steps run with their state restored) at build and by measured steps in training."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Protocol

import tensorflow as tf

from .. import rules
from ..allocator import onednn_off
from ..backend.device import OutOfMemory, release
from ..backend.lean import lean_scope
from ..backend.memory import one_op_order
from ..backend.profile import (SectionProbe, gradient_bytes, probe_memo, probe_slice, profile_blocks,
                               rescaled)
from ..backend.structure import nbytes
from ..schedule.planner import DOES_NOT_FIT, NoPlanFits, Plan, least_peak, plan_measured
from ..schedule.program import Schedule
from .section_functions import Borders, Compiled
from .executor import DRY_NOISE, DryStep

__all__ = ["Calibrator", "DryRun", "Floor", "PlanCosts", "BudgetExceededError"]
log = logging.getLogger("sections")
MAX_REPLANS = 3  # corrections of the cost model by measured steps before a step over the budget stops
DRY_STEPS = 3  # at most this many steps at build (state restored after) measure what a plan's prediction leaves out
# Dry steps timed this close to the fastest count as ties, broken by fewer forward runs: one timed run per plan
# moves by 3-5% on a shared CPU (the notebook ResNet's 0.30 plan flipped between 3 and 4 sections between runs).
TIME_NOISE = 0.05


class BudgetExceededError(ValueError):
    """A step's measured peak went over ``memory_budget`` and no plan with corrected costs fits it."""


class Trials(Protocol):
    """What calibration runs plans on (the ``Engine``): the program compiled now, compiling a schedule and making
    it current, returning to one compiled earlier, and a dry step of the current one."""

    compiled: Compiled

    def adopt(self, schedule: Schedule) -> None: ...

    def restore(self, compiled: Compiled) -> None: ...

    def dry_step(self, batch) -> DryStep: ...


@dataclass(frozen=True)
class PlanCosts:
    """The figures the planner adds to the measured block costs: the network input's bytes, what lives through a
    whole step (variables, optimizer slots, the batch), and the gradients' cost (per block while held until the
    update, or None where the update runs in the backward) and the update's."""

    input_bytes: int
    base_bytes: int
    grad_bytes: list | None
    apply_bytes: int
    model_bytes: int = 0  # of base_bytes, the variables and optimizer slots (what does not grow with the batch)

    @classmethod
    def of(cls, network, optimizer, borders: Borders, in_backward: bool) -> "PlanCosts":
        """In the backward no section waits on a later one's gradients, and each update holds one section's
        (those are in its measured backward too): the update is counted with the largest block's."""
        if not getattr(optimizer, "built", False):
            optimizer.build(network.trainable_variables)
        base = sum(nbytes(v) for v in network.variables) + sum(nbytes(v) for v in optimizer.variables)
        apply = 2 * max((nbytes(v) for v in network.trainable_variables), default=0)  # about two of the largest
        grads = gradient_bytes(network)
        if in_backward:
            return cls(nbytes(borders.input_specs), base + borders.batch_bytes, None, apply + max(grads, default=0),
                       base)
        return cls(nbytes(borders.input_specs), base + borders.batch_bytes, grads, apply, base)


@dataclass(frozen=True)
class Floor:
    """The least memory a step at this batch needs under any plan (``least``, the model's prediction corrected by
    the dry steps' fixed cost), the part of it that does not grow with the batch (``fixed``: variables and optimizer
    slots), and the line a plan's prediction must stay under (``line``: the budget less the margin and spread).
    A batch whose floor is above its line has no plan; ``batch=max`` extrapolates the floor to the line."""

    least: int
    fixed: int
    line: int


@dataclass(frozen=True)
class DryRun:
    """One dry step of a plan: its peak, the fixed cost that makes the plan's prediction that peak, the compiled
    program that ran, and its seconds."""

    plan: Plan
    peak: int
    extra: int
    compiled: Compiled
    seconds: float
    spread: int = 0  # what this plan's measurements varied by (``Calibrator.plan_spread``)


def profile(network, batch, probe: int, real: int, meter, lean, budget_note: str) -> tuple[dict, list, bool]:
    """The per-block probe at ``probe`` examples; where the device has no memory for it, at half as many (down to
    one), its figures scaled to the real batch (an earlier engine's on this network, rescaled, where it probed a
    slice of the same shapes: ``ProbeMemo``). Returns the probe slice, the profiles and whether they were reused."""
    while True:
        small, _ = probe_slice(network, batch, probe)
        memo = probe_memo(network, small, lean)
        if memo.blocks is not None:  # an earlier engine on this network probed a slice of these shapes
            return small, rescaled(memo.blocks, memo.real, real), True
        # Said before it starts: on a large model the probes run for minutes before the first dry step is logged.
        log.info(f"planning: probing {len(network.blocks)} blocks at {probe} examples"
                 + (f" (figures scaled to {real})" if probe < real else ""))
        try:
            with lean_scope(lean):  # the blocks measured as the sections will run them
                memo.blocks, memo.real = profile_blocks(network, small, real, meter), real
                return small, memo.blocks, False
        except tf.errors.ResourceExhaustedError as err:
            release(err)
            if probe == 1:
                raise NoPlanFits(f"{budget_note}: one block's probe of one example ran out of the device's memory; "
                                 f"no plan can fit.", 0, None, 0) from None
            log.warning(f"the block probe at {probe} examples ran out of device memory; probing {probe // 2} and "
                        f"scaling to {real}")
            probe = probe // 2
            del small


class Calibrator:
    """The plan for ``budget`` bytes, from block profiles and a section probe, checked and corrected by dry steps
    (``calibrate``) and by measured steps (``replan_if_over``, ``replan_below``).

    ``plan`` is the plan in force (or the smallest plan tried when none fits: ``refusal`` says why); ``replans``
    the corrections made, in words."""

    def __init__(self, profiles: list, section_probe: SectionProbe, costs: PlanCosts, budget: int, budget_source: str,
                 lean, trials: Trials, resident: int = 0, device_limit: int | None = None):
        self.profiles, self.section_probe, self.costs, self.lean, self.trials = (profiles, section_probe, costs,
                                                                                 lean, trials)
        self.budget, self.budget_source = budget, budget_source
        self.device_limit = device_limit  # a hard limit's bytes (an allocation past it fails), else None
        self.replans: list[str] = []
        # Bytes a dry step measured beside the computed base (what the model leaves out); before the first, what
        # the device held beside the base when planning began (``resident``).
        self.fixed_extra = resident
        self.activation_scale = 1.0  # the planner's activation costs times this: corrected by measured steps
        self.dry_spread = 0  # the most a dry step's repeated runs differed (at least DRY_NOISE of its peak)
        self.measured_nothing = False  # a dry step read 0 bytes: nothing it allocated was counted
        self._plan_kept = False
        self._kept_over_budget = False  # a step over a budget taken from the device, within the device, was said
        # Time spent planning (the section probe's own: ``section_probe.seconds``); plain probes: ``try_plain``'s.
        self.seconds = {"block probe": 0.0, "plain probes": 0.0, "dry steps": 0.0}
        self.dry_steps = self.dry_ran_out = self.plain_probes = 0
        self.block_probe_reused = False  # the block figures came from an earlier engine's probe (``profile``)
        self.refusal: NoPlanFits | None = None
        try:
            self.plan = self.make_plan()
        except NoPlanFits as err:  # its smallest plan is dry-run before the refusal is told (Engine.build)
            self.plan, self.refusal = err.plan, err

    def make_plan(self, scale: float = 1.0, margin: float | None = None, budget: int | None = None) -> Plan:
        """The planner's plan on the measured costs, activations scaled by ``scale``; ``margin``: the planner's
        safety margin (its default where None); ``budget``: another than the calibrator's."""
        options = {} if margin is None else {"margin": margin}
        costs = self.costs
        with lean_scope(self.lean):  # blocks and sections are measured (lazily, here) as the sections will run
            return plan_measured(self.profiles, costs.input_bytes, budget or self.budget, self.section_probe,
                                 spread=self.section_probe.largest_spread, base_bytes=costs.base_bytes,
                                 extra_bytes=self.fixed_extra, activation_scale=scale, grad_bytes=costs.grad_bytes,
                                 apply_bytes=costs.apply_bytes, **options)

    def floor(self) -> Floor:
        """The least memory any plan at this batch is predicted to need, on the figures measured so far."""
        costs = self.costs
        least = least_peak(self.profiles, costs.input_bytes, costs.base_bytes,
                           activation_scale=self.activation_scale, measured=self.section_probe.measured,
                           grad_bytes=costs.grad_bytes, apply_bytes=costs.apply_bytes, extra_bytes=self.fixed_extra)
        line = int((1.0 - self.plan.margin) * self.budget) - self.run_spread()
        return Floor(least, costs.model_bytes, line)

    # ------------------------------------------------------------------ dry steps at build
    def calibrate(self, batch) -> None:
        """Dry steps: run plans' steps with their state restored after and keep the fastest one that fits.

        The planner composes a peak from what it measured of each section; a real step also holds what no section
        probe sees (the executor's buffers, kernel scratch, tensors the Python loop still references) and can
        hold less (sections measured alone keep more than they do inside a step). The gap between a dry step and
        its prediction joins the fixed cost (either way) and the schedule is planned again: a plan predicted too
        high makes room for a faster one, too low for a smaller one (unless the plan fits: less room finds no faster
        plan); each new schedule is dry-run too (up to ``DRY_STEPS``), and then the plan the model predicts fastest
        under the whole budget, without its safety
        margin (``try_bolder``), and where none fits, the plan nearest the model's floor (``try_floor``). A plan fits when its dry step plus the run-to-run spread is within the budget
        and, unless ops run in one order (``fits``), the dry step within ``1 - margin / 2`` of it; of those, the
        one whose dry step ran fastest (timed, not predicted: the planner's re-run time model ranks close plans
        wrongly; within ``TIME_NOISE``, the one re-running fewest forwards) runs, its prediction what its dry
        step measured (or the optimizer update's, if larger; a plan restored from earlier is dry-run again,
        ``choose``). When none fits, the refusal names the smallest dry step measured and the budget that would
        fit it. A dry step that reads 0 bytes (every allocation below the allocator's resolution) checks nothing:
        ``measured_nothing`` turns True."""
        runs: list[DryRun] = []
        log.info(f"planning: dry steps check the plan of {_sections(self.plan)}, predicted to hold "
                 f"{rules.human_bytes(self.plan.predicted_peak)} (budget {rules.human_bytes(self.budget)})")
        for _ in range(DRY_STEPS):
            measured, seconds, spread = self._measure(batch)
            if not measured:  # nothing counted: the plans fit on shapes alone
                self.measured_nothing = True
            self.fixed_extra = measured - (self.plan.predicted_peak - self.plan.extra_bytes)
            runs.append(DryRun(self.plan, measured, self.fixed_extra, self.trials.compiled, seconds, spread))
            fitting = [run for run in runs if self.fits(run.peak, run.spread)]
            if fitting and fitting[-1] is runs[-1] and self.fixed_extra >= self.plan.extra_bytes:
                # It fits, and its fixed cost came out no smaller: planning again (probing new sections, minutes on
                # a large model) can only find plans with less room, predicted slower than this one.
                break
            try:
                plan, refusal = self.make_plan(self.activation_scale), None
            except NoPlanFits as err:
                plan, refusal = err.plan, err
            done = fitting and not _reruns(fitting[-1].plan)  # nothing re-run: none is faster
            if done or (refusal is not None and fitting) or _ran(plan, runs):
                break
            self.plan, self.refusal = plan, refusal
            self.trials.adopt(plan.schedule)
        self.try_bolder(batch, runs)
        chosen = self.choose(batch, runs)
        if chosen is None and runs and self.try_floor(batch, runs):
            chosen = self.choose(batch, runs)
        if chosen is not None and self.try_plain(batch, chosen, runs):
            chosen = self.choose(batch, runs)
        if chosen is not None:
            self.fixed_extra, self.refusal = chosen.extra, None
            # Its step is what its dry step measured (the model's figure for it may be far above: the plan for the
            # whole budget is predicted without a correction from its own dry step), or the update, which no dry
            # step runs.
            self.plan = replace(chosen.plan, predicted_peak=max(chosen.peak, chosen.plan.apply_peak),
                                budget=self.budget, extra_bytes=self.fixed_extra)
            if len(runs) > 1:
                tried = ", ".join(f"{rules.human_bytes(r.peak)} (spread {rules.human_bytes(r.spread)}) in "
                                  f"{r.seconds:.2f} s ({_sections(r.plan)})" for r in runs)
                self.log_replan(f"dry steps measured {tried}; the fastest plan that fits the budget "
                                f"{rules.human_bytes(self.budget)} runs ({_sections(self.plan)})")
            return
        if not runs:  # no dry steps: the model's plan (or refusal) stands
            return
        smallest = min(runs, key=lambda run: run.peak)
        self.refusal = self._refusal(smallest)

    def _refusal(self, run: DryRun) -> NoPlanFits:
        plan, measured = run.plan, run.peak
        advised = self.advised(measured, run.spread)
        spread = rules.human_bytes(self.spread(run.spread))
        rule = (f"a plan runs when its dry step plus the {spread} by which its measurements differed is within "
                f"the budget (ops run in one order: steps repeat their dry step's peak); another process may "
                f"settle on another order, so the advice keeps "
                f"{rules.human_bytes(self.order_spread(run.spread))} above the dry step"
                if one_op_order() else
                f"a plan runs when its dry step plus the {spread} by which identical runs may differ is within "
                f"the budget and the dry step within {1 - plan.margin / 2:.0%} of it")
        return NoPlanFits(
            f"memory_budget={rules.human_bytes(self.budget)} ({self.budget} bytes"
            f"{'' if self.budget_source == 'given' else '; ' + self.budget_source}): no partition "
            f"fits; the smallest plan's dry step (run at build, its state restored) "
            f"{'ran out of the device memory, needing at least' if math.isinf(run.seconds) else 'measured'} "
            f"{rules.human_bytes(measured)} ({measured} bytes); {rule}: the smallest budget that fits is about "
            f"{rules.human_bytes(advised)}.",
            measured, plan, advised)

    def _measure(self, batch) -> tuple[int, float, int]:
        """The current plan's dry step: its peak, seconds and spread (``plan_spread``). Where the device has no
        memory for it, it reads as at least what was in use plus the failing request, over the budget, and at
        least the device's hard limit (a fragmented heap fails below its limit, but the plans it rules out are
        dry-run and measured)."""
        began = time.perf_counter()
        dry = self.trials.dry_step(batch)
        self.seconds["dry steps"] += time.perf_counter() - began
        self.dry_steps += 1
        if dry.ran_out:
            self.dry_ran_out += 1
            # What was in use plus the failing request can read far below what the plan needs (the request that
            # failed need not be the step's last), and a plan corrected by too little runs out again (each one
            # waits out the allocator's retry): the device's limit is the better bound where one is known.
            failed = max(dry.peak, self.budget + 1, self.device_limit or 0)
            log.info(f"a dry step of {_sections(self.plan)} ran out of device memory (at least "
                     f"{rules.human_bytes(failed)}): it does not fit")
            return failed, math.inf, 0
        self.dry_spread = max(self.dry_spread, dry.spread)
        log.info(f"a dry step of {_sections(self.plan)} measured {rules.human_bytes(dry.peak)} in {dry.seconds:.2f} s "
                 f"(budget {rules.human_bytes(self.budget)})")
        return dry.peak, dry.seconds, self.plan_spread(self.plan, dry.spread)

    def planning_seconds(self) -> float:
        """Seconds spent planning: the block probe, section probes and dry steps (re-plans in training included)."""
        return sum(self.seconds.values()) + self.section_probe.seconds

    def planning_summary(self) -> str:
        """Where planning's time went, in words (a section probe or dry step that runs out of device memory first
        waits out the allocator's retry: 10 s each in TensorFlow's BFC allocator)."""
        probe, t = self.section_probe, rules.human_seconds

        def ran_out(n: int) -> str:
            return f" ({n} out of device memory)" if n else ""

        reused = f" (and {probe.reused} reused from an earlier engine's)" if probe.reused else ""
        block = "reused" if self.block_probe_reused else t(self.seconds["block probe"])
        return (f"planned in {t(self.planning_seconds())}: block probe {block}, "
                f"{len(probe.measured) - probe.reused} section probes{ran_out(probe.ran_out)} {t(probe.seconds)}"
                f"{reused}, "
                + (f"{self.plain_probes} without lean gradients {t(self.seconds['plain probes'])}, "
                   if self.plain_probes else "")
                + f"{self.dry_steps} dry steps{ran_out(self.dry_ran_out)} {t(self.seconds['dry steps'])}")

    def plan_spread(self, plan: Plan, dry_spread: int) -> int:
        """What a plan's own measurements varied by: its dry step's two runs, and the probe's repeated runs of
        the sections it runs (relative to what this plan measures, not the largest spread of every section the
        planner probed: a large candidate section's op order must not hold back a plan that never runs it)."""
        spans = _spans(plan.schedule, len(self.profiles))
        return max([dry_spread, *(self.section_probe.spread.get(span, 0) for span in spans)])

    def choose(self, batch, runs: list[DryRun]) -> DryRun | None:
        """Of the dry-step runs that fit, the fastest (``fastest``), or None. One that is not the program run last
        has its functions restored and its dry step run again: after other plans' steps the heap lies otherwise,
        and the steps that follow repeat what it then holds (a restored plan's steps read 141 MiB over its dry
        step on ResNet50 at batch 256). The larger figure stands (in ``runs`` too); a plan that no longer fits
        gives way to the next fastest."""
        while True:
            fitting = [run for run in runs if self.fits(run.peak, run.spread)]
            if not fitting:
                return None
            run = fastest(fitting)
            if run.compiled is self.trials.compiled:
                return run
            self.trials.restore(run.compiled)
            self.plan = run.plan
            again, _, spread = self._measure(batch)
            if again > run.peak or spread > run.spread:
                at = next(i for i, r in enumerate(runs) if r is run)
                runs[at] = run = replace(run, peak=max(again, run.peak), extra=run.extra + max(0, again - run.peak),
                                         spread=max(spread, run.spread))
            if self.fits(run.peak, run.spread):
                return run

    def try_bolder(self, batch, runs: list[DryRun]) -> None:
        """One more dry step, of the plan the model predicts fastest under the whole budget (no safety margin),
        where it re-runs fewer forwards than every plan that fit so far. The margin covers the model's error, but
        a dry step measures the plan itself: where the model over-predicts (a large fused section keeps less than
        its probes add up to) the margin alone would run plans that re-run far more than the budget needs. A dry
        step the device has no memory for counts as not fitting."""
        fitting = [run for run in runs if self.fits(run.peak, run.spread)]
        if not runs or any(not _reruns(run.plan) for run in fitting):
            return
        try:
            bold = self.make_plan(self.activation_scale, margin=0.0)
        except NoPlanFits:
            return
        if _ran(bold, runs) or (
                fitting and sum(bold.forward_runs) >= min(sum(run.plan.forward_runs) for run in fitting)):
            return
        self._dry_run(batch, bold, runs)

    def try_floor(self, batch, runs: list[DryRun]) -> bool:
        """Where no plan dry-run so far fits: one more dry step, of the plan nearest the least memory the model
        reaches (it re-runs the most), unless one ran already. Plans a cut apart can hold alike (their peak lies
        where neither cuts), and the correction learnt from them need not lead there: on the small ResNet at 512
        on a 350 MiB device, plans of 5 and 6 sections read 332.6 and 332.7 MiB against a 332.5 MiB budget and
        the run was refused, where another process's plan re-running more held 265 MiB. False where none ran."""
        try:
            plan = self.make_plan(self.activation_scale, margin=0.0, budget=1)
        except NoPlanFits as err:
            plan = err.plan  # the fastest plan within the least memory reachable (no safety margin)
        if plan is None or _ran(plan, runs):
            return False
        self._dry_run(batch, plan, runs)
        return True

    def try_plain(self, batch, chosen: DryRun, runs: list[DryRun]) -> bool:
        """One more dry step, of the chosen plan with some sections plain (every layer's own Keras gradient: no
        lean attention re-making its scores, no layer re-run in the backward), of those where lean gradients keep
        less: whose probe without them measures no more than the plan's largest section with them (so the plan's
        peak should not move), or, for a section re-run in the backward, whose activations without them still fit
        the plan's line beside what the plan holds while it runs (the budget has room: lean gradients save memory
        the plan does not need, and cost time where kernels are slow; on the notebook ResNet at batch 2048 with
        oneDNN off one section ran 8.32 s lean and 7.43 s plain, with oneDNN on 4.0 s and 4.9 s). Added to ``runs``
        (whether it fits and is faster, ``choose`` decides); False where no section qualifies."""
        if not self.lean:
            return False
        spans = _spans(chosen.plan.schedule, len(self.profiles))
        with lean_scope(self.lean):
            lean_costs = [self.section_probe(*span) for span in spans]
        probe = self.section_probe
        plain_probe = SectionProbe(probe.network, probe.small, probe.real, probe.meter,
                                   memo=probe_memo(probe.network, probe.small, self.lean, plain=True))
        with lean_scope(False):
            plain_costs = [plain_probe(*span) for span in spans]
        plain_probe.release()
        self.plain_probes += len(plain_probe.measured) - plain_probe.reused
        self.seconds["plain probes"] += plain_probe.seconds
        ceiling = max((c for c in lean_costs if c != DOES_NOT_FIT), default=0)
        room = self._room_beside(chosen)
        plain = frozenset(i for i, (span, on, off) in enumerate(zip(spans, lean_costs, plain_costs))
                          if DOES_NOT_FIT not in (on, off) and on < off
                          and (off <= ceiling or self.activation_scale * off <= room.get(span, -1)))
        if not plain:
            return False
        plan = replace(chosen.plan, schedule=replace(chosen.plan.schedule, plain=plain))
        # Dry-run already (a re-plan after a step ran out starts from the plan in force): a second run out of
        # memory would wait out the allocator's retry again (a minute on the small ResNet at 512).
        if _ran(plan, runs):
            return False
        self._dry_run(batch, plan, runs)
        return True

    def _dry_run(self, batch, plan: Plan, runs: list[DryRun]) -> None:
        """Adopt ``plan``, run its dry step and add it to ``runs`` (its fixed cost: what the step held beyond the
        plan's prediction)."""
        self.plan = plan
        self.trials.adopt(plan.schedule)
        measured, seconds, spread = self._measure(batch)
        runs.append(DryRun(plan, measured, measured - (plan.predicted_peak - plan.extra_bytes), self.trials.compiled,
                           seconds, spread))

    def _room_beside(self, chosen: DryRun) -> dict:
        """Per span the chosen plan re-runs in the backward: the activation bytes its line leaves that span, beside
        what the plan holds while it runs (the planner's figure, its fixed cost taken from the dry step)."""
        plan = chosen.plan
        line = int((1.0 - plan.margin) * self.budget) - self.run_spread()
        fixed = chosen.extra - plan.extra_bytes
        return {span: line - (held + fixed) for span, held in zip(plan.leaves, plan.leaf_held)}

    # ------------------------------------------------------------------ the fit rule
    def run_spread(self, spread: int | None = None) -> int:
        """What a plan's measurements varied by (``plan_spread``: a dry-run plan's own); None: the most any
        section probe or dry step so far moved (a plan not dry-run, a step in training)."""
        if spread is not None:
            return spread
        return max(self.section_probe.largest_spread(), self.dry_spread)

    def order_spread(self, spread: int | None = None) -> int:
        """How far a step's peak may move between identical runs: ``run_spread``, and at least the largest block
        output (the executor's op order may keep one more activation alive; a few runs need not show it)."""
        largest = max((p.output_bytes for p in self.profiles or ()), default=0)
        return max(self.run_spread(spread), largest)

    def spread(self, spread: int | None = None) -> int:
        """What a step may hold beyond its plan's dry step: with ops on one inter-op thread (``one_op_order``) a
        compiled function runs them in one order every call, so ``run_spread``; else ``order_spread``."""
        return self.run_spread(spread) if one_op_order() else self.order_spread(spread)

    def ceiling(self, plan: Plan) -> float:
        """How close to its budget a step may come: the budget itself with one op order (steps repeat their dry
        step); else ``1 - margin / 2`` of it (the order may flip)."""
        return plan.budget if one_op_order() else (1 - plan.margin / 2) * plan.budget

    def fits(self, measured: int, spread: int | None = None) -> bool:
        """Whether a plan whose dry step measured ``measured`` bytes (its measurements varying by ``spread``) runs
        under the budget: the dry step plus the spread within the budget, the dry step within ``ceiling``."""
        return (measured + self.spread(spread) <= self.budget
                and measured <= self.ceiling(replace(self.plan, budget=self.budget)))

    def advised(self, measured: int, spread: int | None = None) -> int:
        """The smallest budget (whole MiB) that a plan whose dry step measured ``measured`` fits, in this run and
        in another: the fit rule's, with the order spread once (another process may settle on another op order,
        even with one thread), not once more on top of a dry step assumed that much higher."""
        need = max(measured + self.order_spread(spread), measured / (1 - self.plan.margin / 2))
        return math.ceil(need / 2**20) * 2**20

    # ------------------------------------------------------------------ corrections in training
    def replan_if_over(self, measured: int) -> Schedule | None:
        """Every step: a measured peak above the plan's prediction corrects the cost model and re-plans (up to
        ``MAX_REPLANS`` times); a step over the budget when no corrected plan fits stops training. A step above
        the prediction by no more than ``order_spread``, inside ``1 - margin / 2`` of the budget (with one op
        order: inside the budget), is the executor's op order, not a model error: no re-plan (each would recompile
        the sections). Returns the new schedule where it changed."""
        hb, old = rules.human_bytes, self.plan
        # Within the budget, a step over its dry step by no more than an op-order flip is noise, not a model error:
        # steps of some models (keras.applications ResNet50 on oneDNN) move by tens of MiB even on one thread.
        noise = self.order_spread() if measured <= self.ceiling(old) else 0
        if measured <= old.predicted_peak + noise:
            return None
        over_budget = measured > old.budget
        # A budget taken from a device of hard memory is that device less headroom: a step over it but within the
        # device fitted, and one that runs out is re-planned and run again (``replan_below``), so it goes on.
        within_device = (self.device_limit is not None and measured <= self.device_limit
                         and self.budget_source.startswith("the device's memory"))  # not a size or fraction asked
        scale = self.activation_scale * (measured - old.base_bytes) / max(1, old.predicted_peak - old.base_bytes)
        over = f"measured step peak {hb(measured)} exceeded the plan's prediction {hb(old.predicted_peak)}"
        keeps = (f"{over} and the budget {hb(old.budget)} but not the device's {hb(self.device_limit or 0)}; "
                 f"the plan stays (a step that runs out of memory is re-planned and run again)")
        if len(self.replans) >= MAX_REPLANS:
            if over_budget and within_device and not self._kept_over_budget:
                self._kept_over_budget = True
                log.warning(keeps)
            elif over_budget and not within_device:
                raise BudgetExceededError(f"{over} and the budget {hb(old.budget)} after {len(self.replans)} "
                                          f"corrections of the cost model; give a larger memory_budget") from None
            return None
        try:
            plan = self.make_plan(scale)
        except ValueError as err:
            if over_budget and within_device:
                if not self._kept_over_budget:
                    self._kept_over_budget = True
                    self.log_replan(f"{keeps}; with activation costs corrected by {scale:.3g} no plan fits")
                return None
            if over_budget:
                raise BudgetExceededError(f"{over} and the budget {hb(old.budget)}; with activation costs corrected "
                                          f"by {scale:.3g}: {err}") from None
            if not self._plan_kept:  # inside the budget all the same (the margin absorbed the error): it stays
                self._plan_kept = True
                self.log_replan(f"{over} but not the budget {hb(old.budget)}; with activation costs scaled by "
                                f"{scale:.3f} no plan fits inside the safety margin, so the plan stays")
            return None
        self.activation_scale, self.plan = scale, plan
        budget_note = f" (over the budget {hb(old.budget)})" if over_budget else ""
        self.log_replan(f"{over}{budget_note}; activation costs scaled by {scale:.3f} and re-planned: "
                        f"{len(old.schedule.starts) + 1} -> {len(plan.schedule.starts) + 1} sections, "
                        f"predicted peak {hb(plan.predicted_peak)}")
        return plan.schedule

    def replan_below(self, err: OutOfMemory, batch) -> None:
        """After a step ran out of memory: the budget comes down below what was in use when it failed (the
        allocator could hold no more there: its chunks, or a step heavier than its dry step), unless the failing
        request alone was larger than the device (no plan makes that fit: the budget stays); the plan is then
        dry-run again and re-planned, as at build."""
        total = err.device.total or self.budget
        if err.requested is None or err.requested < total:
            self.budget = min(self.budget, max(1, int(err.in_use * (1 - DRY_NOISE))))
        self.log_replan(f"a step ran out of device memory ({err}); re-planning under "
                        f"{rules.human_bytes(self.budget)} and running the step again from the state before it")
        self.calibrate(batch)
        if self.refusal is not None:
            refusal, self.refusal = self.refusal, None
            raise OutOfMemory(f"{err}; no plan fits below it: {refusal}", err.device, err.requested,
                              err.shape, err.in_use) from None

    def log_replan(self, message: str) -> None:
        self.replans.append(message)
        log.warning(message)


def fastest(runs: list[DryRun]) -> DryRun:
    """Of dry-step runs that fit, the one to keep: of those re-running nothing if any (the fastest by construction:
    a timing's noise must not say otherwise), else of all, those timed within ``TIME_NOISE`` of the fastest; of
    those, the one re-running fewest forwards, then with the most plain sections where oneDNN is off (the fewest
    where it is on), then faster, then smaller. A dry step's two runs do not separate lean from plain sections
    (their heaps settle over more runs): on the notebook ResNet at batch 2048 with oneDNN off they read 8.22 s lean
    and 8.25 s plain where steps run 8.32 s and 7.43 s; with oneDNN on, 4.55 s and 4.64 s where steps run 4.03 s
    and 4.95 s (its fused batch-norm kernel)."""
    quiet = [run for run in runs if not _reruns(run.plan)] or runs
    best = min(run.seconds for run in quiet)
    near = [run for run in quiet if run.seconds <= best * (1 + TIME_NOISE)]
    lean_faster = 1 if not onednn_off() else -1
    return min(near, key=lambda run: (sum(run.plan.forward_runs), lean_faster * len(run.plan.schedule.plain),
                                      run.seconds, run.peak))


def _ran(plan: Plan, runs: list[DryRun]) -> bool:
    """Whether ``plan``'s schedule was dry-run already."""
    return any(plan.schedule == run.compiled.schedule for run in runs)


def _reruns(plan: Plan) -> bool:
    """Whether a plan runs some section's forward more than once."""
    return max(plan.forward_runs, default=1) > 1


def _sections(plan: Plan) -> str:
    n, plain = plan.schedule.num_sections, len(plan.schedule.plain)
    return f"{n} section" + ("s" if n != 1 else "") + (f", {plain} plain" if plain else "")


def _spans(schedule: Schedule, blocks: int) -> list[tuple[int, int]]:
    """Each section's ``(start, stop)`` block span."""
    starts = (0, *schedule.starts, blocks)
    return list(zip(starts, starts[1:]))
