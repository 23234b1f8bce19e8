"""Planning under a memory budget: the pure planner on costs counted from traces (each block's, then each section a
candidate plan runs, traced whole), a line fitted to what dry steps measured, and the search
(``sections.schedule.search``) that says which plan to dry-run, which runs, or why none fits."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace

import tensorflow as tf

from .. import rules
from ..backend.device import OutOfMemory, VariablesDoNotFit
from ..backend.profile import gradient_bytes
from ..backend.structure import nbytes
from ..schedule.planner import NoPlanFits, Plan, plan_schedule
from ..schedule.search import Candidate, DryStep, Point, Refuse, Run, Search, Try, decide
from .executor import DRY_NOISE, host_copy, write_back
from .measure import Measurer
from .section_functions import Borders

__all__ = ["Calibrator", "Floor", "PlanCosts", "BudgetExceededError"]
log = logging.getLogger("sections")
# Policies the planner weighs besides re-running: none. A kept tape (``store``) holds what TensorFlow's recording of
# a compiled call saves, not what the section's trace counts (MobileNetV2, 10 blocks at batch 64: 254 MiB held
# against 180 counted, and its backward 534 MiB against a re-run's 355): plans are built from what can be counted.
UNITS = ()
COUNT_ROUNDS = 4  # solves per candidate plan, each tracing the sections the last one chose and had not counted
MAX_REPLANS = 3  # corrections by measured steps in training before a step over the budget stops


class BudgetExceededError(ValueError):
    """A step's measured peak went over ``memory_budget`` and no plan with corrected costs fits it."""


@dataclass(frozen=True)
class PlanCosts:
    """The figures the planner adds to the block costs: the network input's bytes, what lives through a whole step
    (variables, optimizer slots, the batch), and the gradients' cost (per block while held until the update, or
    None where the update runs in the backward) and the update's."""

    input_bytes: int
    base_bytes: int
    grad_bytes: list | None
    apply_bytes: int
    model_bytes: int = 0  # of base_bytes, the variables and optimizer slots (what does not grow with the batch)
    update: tuple | None = None  # in the backward: each block's gradient bytes, the update's temporaries

    @classmethod
    def of(cls, network, optimizer, borders: Borders, in_backward: bool) -> "PlanCosts":
        """In the backward no section waits on a later one's gradients, and each update holds one section's: each
        section is counted with its own gradients and the update's temporaries beside them (``update``), the
        whole step with the largest block's."""
        if not getattr(optimizer, "built", False):
            optimizer.build(network.trainable_variables)
        base = sum(nbytes(v) for v in network.variables) + sum(nbytes(v) for v in optimizer.variables)
        apply = 2 * max((nbytes(v) for v in network.trainable_variables), default=0)  # about two of the largest
        grads = gradient_bytes(network)
        if in_backward:
            return cls(nbytes(borders.input_specs), base + borders.batch_bytes, None, apply + max(grads, default=0),
                       base, (tuple(grads), apply))
        return cls(nbytes(borders.input_specs), base + borders.batch_bytes, grads, apply, base)


def slots_per_variable(optimizer) -> int:
    """How many variable-sized slots the optimizer keeps per trainable variable (Adam 2, SGD with momentum 1),
    read from a copy of it built on one small variable: nothing of the real optimizer is built."""
    import keras
    import numpy as np

    try:
        probe = type(optimizer).from_config(optimizer.get_config())
        variable = keras.Variable(np.zeros((3, 5), "float32"))
        probe.build([variable])
    except Exception:  # noqa: BLE001 - an optimizer that cannot be copied so: counted as none
        return 0
    return sum(1 for v in probe.variables if tuple(v.shape) == (3, 5))


def check_variables_fit(network, optimizer, in_use: int, limit: int | None) -> None:
    """Before the optimizer's slots are made: refuse in one line (``VariablesDoNotFit``) where the model's variables
    and those slots cannot fit the device at all (making them there fails inside a kernel, which can end the process,
    and leaves the optimizer half built)."""
    if limit is None or getattr(optimizer, "built", False):
        return
    sizes = [nbytes(v) for v in network.trainable_variables]
    weights, slots = sum(sizes), slots_per_variable(optimizer)
    # Each slot is made from a zeros tensor of its size, held beside it while it is copied in.
    need = in_use + slots * weights + (max(sizes, default=0) if slots else 0)
    if need > limit:
        hb = rules.human_bytes
        raise VariablesDoNotFit(f"the optimizer's {slots} slot(s) per variable ({hb(slots * weights)} for {hb(weights)} of "
                         f"trainable variables), one more of the largest while a slot is made, and the {hb(in_use)} already in use "
                         f"need {hb(need)}, more than the "
                         f"device's {hb(limit)}: no partition of the step can fit; a device with more memory, or an "
                         f"optimizer with fewer slots (SGD), is needed.", what="optimizer")


@dataclass(frozen=True)
class Floor:
    """The least memory a step at this batch needs under any plan (``least``: measured where the least-memory plan
    was dry-run, else counted), the part of it that does not grow with the batch (``fixed``: variables and optimizer
    slots), and the line ``least`` must stay under for a plan to fit (``line``: for a measured floor the budget less
    what runs varied by, as a dry step is held; for a counted one the line predictions are held under). A batch
    whose floor is above its line has no plan; ``batch=max`` extrapolates it."""

    least: int
    fixed: int
    line: int
    measured: bool = False  # ``least`` is the least-memory plan's dry step (else its count)


class Calibrator:
    """The plan for ``budget`` bytes: candidates from the pure planner on ``profiles`` (counted, not measured),
    chosen by ``search.decide`` on measurements ``measurer`` makes (``calibrate``), corrected by measured steps in
    training (``replan_if_over``, ``replan_below``).

    ``plan`` is the plan in force (or the least-memory plan when none fits: ``refusal`` says why); ``replans``
    the corrections made in training, in words; ``dry_runs`` each dry step's predicted and measured peak."""

    def __init__(self, profiles: list, costs: PlanCosts, budget: int, budget_source: str, lean, measurer: Measurer,
                 resident: int = 0, device_limit: int | None = None, count_span=None, workspaces=None,
                 hint: dict | None = None):
        self.profiles, self.costs, self.lean, self.measurer = profiles, costs, lean, measurer
        self.hint = hint  # a plan remembered for this set-up (``record``), tried first by ``calibrate``
        self.from_record: bool | None = None  # whether the plan in force came from ``hint`` (None: no hint given)
        self.workspaces = workspaces  # kernels' work buffers the counts measured (``backend.workspace``), or None
        self.count_span = count_span  # (s, t) -> blocks s..t-1's activation bytes from their own trace
        self.counted: dict = {}  # (s, t) -> those bytes, for every section a candidate plan ran
        self.budget, self.budget_source = budget, budget_source
        self.device_limit = device_limit
        self.search = Search(budget, costs.base_bytes + resident, resident=resident)
        self.replans: list[str] = []
        self.runs_again = 0  # steps that ran out with the bytes free and ran again on their plan (``replanning``)
        self.ran_again_last = False  # the last step that ran needed that second run
        self.dry_runs: list[dict] = []  # {"sections", "predicted", "measured", "ran_out", "fits"} per dry step
        self.measured_nothing = False
        self.refusal: NoPlanFits | None = None
        self.seconds = {"model": 0.0}
        self._plans: dict = {}
        self._kept_over = False
        self.seconds["count"] = 0.0
        began = time.perf_counter()
        self.plan = self._least_plan()
        self.seconds["model"] += time.perf_counter() - began - self.seconds["count"]

    # ------------------------------------------------------------------ the pure planner's candidates
    def _solve(self, budget: int) -> Plan:
        """``plan_schedule`` at ``budget`` (NoPlanFits as it raises), its sections' costs counted from their own
        traces: the planner composes a section from its blocks' figures, the plan's sections are then traced as
        they run and the plan solved again, until its sections are all counted (at most ``COUNT_ROUNDS``)."""
        costs = self.costs
        for round_ in range(COUNT_ROUNDS):
            try:
                plan, refusal = plan_schedule(self.profiles, costs.input_bytes, budget, base_bytes=costs.base_bytes,
                                              margin=0.0, units=UNITS, grad_bytes=costs.grad_bytes,
                                              apply_bytes=costs.apply_bytes, measured=self.counted,
                                              update=costs.update), None
            except NoPlanFits as err:
                plan, refusal = err.plan, err
            new = [span for span in plan.leaves if span not in self.counted]
            if self.count_span is None or not new or round_ == COUNT_ROUNDS - 1:
                break
            began = time.perf_counter()
            for s, t in new:
                self.counted[(s, t)] = self.count_span(s, t)
            self.seconds["count"] += time.perf_counter() - began
        if refusal is not None:
            raise refusal
        return plan

    def _raw(self, room: int) -> Plan | None:
        """The planner's fastest plan whose modelled bytes beyond the base stay within ``room`` (None: none)."""
        room = max(int(room), 0)
        if room not in self._plans:
            try:
                self._plans[room] = self._solve(self.costs.base_bytes + room)
            except NoPlanFits:
                self._plans[room] = None
        return self._plans[room]

    def _least_plan(self) -> Plan:
        """The plan the model puts least memory on (most re-running)."""
        if "least" not in self._plans:
            try:
                self._plans["least"] = self._solve(1)
            except NoPlanFits as err:
                self._plans["least"] = err.plan
        return self._plans["least"]

    def _candidate(self, plan: Plan) -> Candidate:
        return Candidate(plan.schedule, plan.predicted_peak - plan.base_bytes,
                         plan.rerun_seconds + 1e-9 * plan.schedule.num_sections)

    def _plan_of(self, candidate: Candidate) -> Plan:
        least = self._least_plan()
        if least.schedule == candidate.key:
            return least
        return next(p for p in self._plans.values() if p is not None and p.schedule == candidate.key)

    def _within(self, room: int) -> Candidate | None:
        plan = self._raw(room)
        return self._candidate(plan) if plan is not None else None

    def _least(self) -> Candidate:
        return self._candidate(self._least_plan())

    def running_least(self) -> bool:
        """Whether the plan in force is the least-memory plan (no plan holds less)."""
        return self.plan.schedule == self._least_plan().schedule

    # ------------------------------------------------------------------ figures
    def spread(self) -> int:
        """What repeated runs of a dry step varied by (at least ``DRY_NOISE`` of the budget's line)."""
        spreads = [s.spread for s in self.search.steps if not s.ran_out]
        return max(spreads, default=0)

    def predicted(self, plan: Plan) -> int:
        return self.search.predict(self._candidate(plan))

    def floor(self) -> Floor:
        """The least memory any plan at this batch needs, no more than the plan in force measured: the least-memory
        plan's dry step where it ran (it runs first), else its count. Measured, because the count leaves out what
        the process holds beside the model (the runner's input pipeline: 30-75 MiB on MobileNetV2 at 96 px) and
        what kernels and the allocator add (1.3x the count there): ``batch=max`` aimed by counted floors tried
        batch 97 where 58 was the largest that fitted."""
        plan = self._least_plan()
        key = self._candidate(plan).key
        dry = [s.peak for s in self.search.steps if s.candidate.key == key and not s.ran_out]
        if dry:
            least = min(max(dry), self.plan.predicted_peak) if self.refusal is None else max(dry)
            return Floor(least, self.costs.model_bytes, self.budget - self.spread(), measured=True)
        least = min(plan.predicted_peak, self.plan.predicted_peak)
        return Floor(least, self.costs.model_bytes, int(self.search.line(self.spread())))

    # ------------------------------------------------------------------ planning at build
    def calibrate(self, batch) -> None:
        """Follow ``search.decide``: dry-run what it says to try, run what it says runs, or refuse. No block is
        measured first: one block's measurement over its count (1.8x on the small ResNet, its kernels' work
        buffers) drew a line that missed whole sections by 40% (MobileNetV2), where sections counted from their own
        traces came within 10% of their dry steps."""
        hb = rules.human_bytes
        log.info(f"planning: {len(self.profiles)} blocks, budget {hb(self.budget)} ({self.budget_source}); the "
                 f"model's line: {self.search.fit().describe()}; at most {self.search.max_steps} dry steps"
                 + ("; a plan remembered for this set-up first" if self.hint is not None else ""))
        if self.hint is not None:
            hint, self.hint = self.hint, None
            self.from_record = self._try_record(hint, batch)
            if self.from_record:
                return
        while True:
            move = decide(self.search, self._within, self._least, self.spread())
            if isinstance(move, Try):
                self._dry_run(move.candidate, batch, move.why)
                continue
            if isinstance(move, Run):
                if not self.search.fits(move.step):
                    hb = rules.human_bytes
                    log.warning(f"planning: the least-memory plan measured {hb(move.step.peak)}, within the budget "
                                f"{hb(self.budget)}, but its runs varied by {hb(move.step.spread)}: it runs, and a "
                                f"step of it may run out of memory (no smaller plan exists)")
                self._adopt(move.step)
                return
            self._refuse(move)
            return

    def _try_record(self, hint: dict, batch) -> bool:
        """Dry-run the plan ``hint`` records (``record``) and adopt it where it fits; False (said in one line) where
        the record describes no plan of these blocks or its dry step does not fit: the search goes on, that dry step
        counted among the search's."""
        plan = self._remade(hint)
        if plan is None:
            log.info("planning: the remembered record does not describe a plan of these blocks; searching")
            return False
        # Its prediction: what its dry step measured in the run that chose it (the count alone leaves out the
        # allocator's share, which no dry step of this process has measured yet).
        measured = hint.get("dry_step")
        self._dry_run(self._candidate(plan), batch, "the plan remembered for this set-up",
                      predicted=measured if isinstance(measured, int) and measured > 0 else None)
        step = self.search.steps[-1]
        if self.search.fits(step):
            self._adopt(step)
            return True
        log.info("planning: the remembered plan does not fit in this process; searching")
        return False

    def _remade(self, hint: dict) -> Plan | None:
        """The recorded plan (``remembered.plan_of``), or None where the record does not describe a plan of these
        blocks. Not solved again: a plan's counts include kernels' work buffers measured in the process, which
        moved the least-memory plan's count by 4% between two processes of MobileNetV2, and another count can
        make another plan at the same room."""
        from .remembered import plan_of

        plan = plan_of(hint, len(self.profiles), self.budget, self.costs.base_bytes)
        if plan is not None:
            self._plans["remembered"] = plan
        return plan

    def record(self) -> dict | None:
        """The plan in force as plain data (``remembered.record_of``); None where no plan runs (a refusal)."""
        from .remembered import record_of

        if self.refusal is not None:
            return None
        schedule = self.plan.schedule
        dry = max((s.peak for s in self.search.steps if s.candidate.key == schedule), default=None)
        # The planner's own plan, not the one in force: adopting it set its prediction to what its dry step read,
        # and a record of that as its count would read, in the next process's fit, as a count with no excess.
        return record_of(self._plan_of(self._candidate(self.plan)), dry)

    def _dry_run(self, candidate: Candidate, batch, why: str, predicted: int | None = None) -> None:
        plan = self._plan_of(candidate)
        line = self.search.fit().describe() if predicted is None else "as measured where it was chosen"
        predicted = self.search.predict(candidate) if predicted is None else predicted
        dry = self.measurer.dry_step(plan.schedule, batch)
        peak = dry.peak
        if dry.ran_out:  # at least the device's limit (a fragmented heap fails below it)
            peak = max(peak, self.budget + 1, self.device_limit or 0)
        # A dry step that read 0 bytes (every allocation below the allocator's resolution) measured nothing.
        self.measured_nothing = not dry.ran_out and not peak
        spread = max(dry.spread, math.ceil(DRY_NOISE * peak)) if not dry.ran_out else 0
        step = DryStep(candidate, peak, spread, dry.ran_out, predicted)
        self.search.steps.append(step)
        fits = self.search.fits(step)
        self.dry_runs.append({"sections": plan.schedule.num_sections, "predicted": predicted, "measured": peak,
                              "ran_out": dry.ran_out, "fits": fits, "seconds": dry.seconds if not dry.ran_out else None})
        hb = rules.human_bytes
        result = (f"ran out of device memory (at least {hb(peak)})" if dry.ran_out else
                  f"measured {hb(peak)}" + (f" (spread {hb(spread)})" if spread else ""))
        verdict = ("fits" if fits else "is within, but not with its spread," if self.search.fits(step, spread=False)
                   else "does not fit")
        log.info(f"planning: dry step {len(self.search.steps)} of {_sections(plan)} ({why}; "
                 f"{line}): predicted "
                 f"{hb(predicted)}, {result}; {verdict} the budget {hb(self.budget)}")

    def _adopt(self, step: DryStep) -> None:
        plan = self._plan_of(step.candidate)
        self.measurer.use(plan.schedule)
        self.measurer.forget()
        # What its dry step held beyond its count (the allocator's chunks, kernels' buffers; below it: negative).
        self.plan = replace(plan, predicted_peak=max(step.peak, plan.apply_peak), budget=self.budget,
                            extra_bytes=step.peak - plan.predicted_peak, margin=self.search.margin())
        self.refusal = None

    def _refuse(self, move: Refuse) -> None:
        hb = rules.human_bytes
        step = move.step
        plan = self._least_plan()
        self.plan = replace(plan, budget=self.budget)
        if step is None:
            figure = self.predicted(plan)
            said = f"its prediction is {hb(figure)}"
        else:
            figure = step.peak
            said = (f"its dry step ran out of the device's memory, needing at least {hb(figure)}" if step.ran_out
                    else f"its dry step measured {hb(figure)}")
        advised = math.ceil((figure + self.spread()) / 2**20) * 2**20
        source = "" if self.budget_source == "given" else "; " + self.budget_source
        self.refusal = NoPlanFits(
            f"memory_budget={hb(self.budget)} ({self.budget} bytes{source}): no partition fits; the least-memory "
            f"plan ({_sections(plan)}, every section re-run) was dry-run at build (its state restored) and "
            f"{said}{', over the budget' if step is not None and not step.ran_out else ''}: the smallest "
            f"budget that fits is about {hb(advised)}.", figure, plan, advised,
            lower_bound=step is not None and step.ran_out)

    # ------------------------------------------------------------------ reports
    def planning_seconds(self) -> float:
        return sum(self.seconds.values()) + sum(self.measurer.seconds.values())

    def planning_summary(self) -> str:
        t = rules.human_seconds
        m = self.measurer
        ran_out = f" ({m.ran_out} out of device memory)" if m.ran_out else ""
        work = self.workspaces
        measured = (f" (of which {len(work.cache)} kernels' work buffers measured {t(work.seconds)})"
                    if work is not None and work.cache else "")
        return (f"planned in {t(self.planning_seconds())}: costs counted from traces {t(self.seconds['model'])}, "
                f"{len(self.counted)} sections traced whole {t(self.seconds['count'])}{measured}, {m.dry_steps} dry "
                f"steps{ran_out} {t(m.seconds['dry steps'])}")

    # ------------------------------------------------------------------ corrections in training
    def replan_if_over(self, measured: int) -> Plan | None:
        """Every step: a measured peak above the plan's prediction by more than the spread joins the fit's points;
        over the budget, the plan is re-planned on the refitted line (up to ``MAX_REPLANS`` times), and a step over
        the budget when none fits stops training (unless the budget was taken from a device of hard memory and
        the step stayed within the device: then the plan stays; a step that runs out is re-planned and run again).
        Returns the new plan's schedule where it changed."""
        hb, old = rules.human_bytes, self.plan
        if measured <= old.predicted_peak + max(self.spread(), math.ceil(DRY_NOISE * measured)):
            return None
        self.search.blocks.append(Point(self._candidate(old).modelled if old.schedule else 0,
                                        measured - self.search.base))
        if measured <= self.budget:
            self.plan = replace(old, predicted_peak=measured)
            return None
        over = (f"measured step peak {hb(measured)} exceeded the plan's prediction {hb(old.predicted_peak)} and "
                f"the budget {hb(self.budget)}")
        within_device = (self.device_limit is not None and measured <= self.device_limit
                         and self.budget_source.startswith("the device's memory"))
        if len(self.replans) >= MAX_REPLANS:
            if within_device:
                if not self._kept_over:
                    self._kept_over = True
                    log.warning(f"{over} but not the device's {hb(self.device_limit)}; the plan stays")
                return None
            raise BudgetExceededError(f"{over} after {len(self.replans)} corrections; give a larger memory_budget")
        candidate = self._within(self.search.fit().room(self.search.line(self.spread()) - self.search.base))
        if candidate is None or candidate.key == old.schedule:
            if within_device:
                if not self._kept_over:
                    self._kept_over = True
                    self.log_replan(f"{over} but not the device's {hb(self.device_limit)}; no smaller plan is "
                                    f"predicted to fit, so the plan stays (a step that runs out is re-planned)")
                return None
            raise BudgetExceededError(f"{over}; with the model refitted to it no plan fits") from None
        plan = self._plan_of(candidate)
        self.plan = replace(plan, predicted_peak=self.search.predict(candidate), budget=self.budget)
        self.log_replan(f"{over}; refitted and re-planned: {len(old.schedule.starts) + 1} -> "
                        f"{plan.schedule.num_sections} sections, predicted peak {hb(self.plan.predicted_peak)}")
        return plan.schedule

    def replan_below(self, err: OutOfMemory, batch) -> None:
        """After a step ran out of memory: the budget comes down and the search runs again (new dry steps). Where
        the device lacked the bytes, below what was in use when it failed (unless the failing request alone was
        larger than the device); where it had them in pieces (``in_pieces``), below the running plan's measured
        peak: the plan is too close to the allocator's edge, and what was in use says nothing of the plans below it
        (MobileNetV2 at 0.5: a 56.3 MiB request failed with 243.1 MiB in use on 382 MiB, and a budget of 241.9 MiB
        refused the least-memory plan, which had measured 285.2 and then ran on a second try)."""
        total = err.device.total or self.budget
        if in_pieces(err):
            self.budget = min(self.budget, max(1, int(self.plan.predicted_peak * (1 - DRY_NOISE))))
        elif err.requested is None or err.requested < total:
            self.budget = min(self.budget, max(1, int(err.in_use * (1 - DRY_NOISE))))
        self.log_replan(f"a step ran out of device memory ({err}); re-planning under "
                        f"{rules.human_bytes(self.budget)} and running the step again from the state before it")
        self.search = Search(self.budget, self.search.base, list(self.search.blocks), [],
                             self.search.max_steps, self.search.resident)
        self.calibrate(batch)
        if self.refusal is not None:
            refusal, self.refusal = self.refusal, None
            raise OutOfMemory(f"{err}; no plan fits below it: {refusal}", err.device, err.requested,
                              err.shape, err.in_use) from None

    def log_replan(self, message: str) -> None:
        self.replans.append(message)
        log.warning(message)


def replanning(trainer, run, plan_batch, adopted=lambda: None):
    """``run()`` with the state saved before it: where it runs out of memory, the state is written back,
    ``trainer.calibrator`` re-plans below what it reached (dry steps on ``plan_batch``), ``adopted()`` takes up the
    new plan, and it runs again, up to ``MAX_REPLANS`` times; then ``OutOfMemory`` (read as it failed). The first
    time it runs out with the memory free in pieces (``in_pieces``), it runs again on the same plan first, unless the
    step before needed that too and a plan with less memory exists."""
    state = [*trainer.network.variables, *trainer.executor.extra_state(), *trainer.optimizer.variables]
    saved = host_copy(state)
    calibrator = trainer.calibrator
    attempt, again = 0, True
    while True:
        try:
            out = run()
            calibrator.ran_again_last = not again
            return out
        except tf.errors.ResourceExhaustedError as failed:
            err = OutOfMemory.from_error(failed, trainer.meter, trainer.device_memory)
            del failed
            write_back(state, saved)
            trainer.read_counters()
            # A plan that needed a second run on the step before too sits at the allocator's edge: each such step
            # pays TensorFlow's wait (10 s) and a second run, so a plan with less memory is searched for, where
            # there is one (MobileNetV2 at 0.5: steps 3 to 6 each ran out once and then ran).
            at_edge = calibrator.ran_again_last and not calibrator.running_least()
            if again and in_pieces(err) and not at_edge:
                # The bytes fitted and the allocator's free chunks did not: no reason to call the plan too large
                # (lowering the budget to what was in use refused the plan that was running). Where a chunk lands
                # moves from step to step (slack over the same requests 56.7, 26.4 and 4.3 MiB in three steps of
                # one process), so the step runs once more as it is before anything is re-planned.
                again = False
                calibrator.runs_again += 1
                if calibrator.runs_again == 1 or calibrator.runs_again % 100 == 0:  # a run may meet it every step
                    log.warning(f"a step ran out of device memory ({err}), though that much was free in pieces; "
                                f"running the step again from the state before it, on the same plan "
                                f"({calibrator.runs_again} step(s) so far; said again every 100th)")
                continue
            calibrator.ran_again_last = again = False  # once a step re-plans, it runs again on the new plan only
            if attempt == MAX_REPLANS:
                raise err from None
            attempt += 1
            calibrator.replan_below(err, plan_batch)
            adopted()


def in_pieces(err: OutOfMemory) -> bool:
    """Whether the failing request and the step's peak until then fit the device together: the allocator failed
    for want of a free chunk that large, not of bytes."""
    total = err.device.total
    return bool(total and err.requested is not None and err.in_use + err.requested <= total)


def _sections(plan: Plan) -> str:
    n = plan.schedule.num_sections
    return f"{n} section" + ("s" if n != 1 else "")

