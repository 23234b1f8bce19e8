"""The engine: a cached forward pass, then a section-wise backward pass from the last section to the first.

``Engine`` composes three parts: planning (``calibrate.Calibrator``: the plan under a budget, dry steps, re-plans),
compiling (``compile.compile_schedule``: a schedule's section functions) and running (``executor.Executor``: one
step of the compiled program, its memory readings, the update)."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, Sequence

from .. import rules
from ..allocator import kernel_crash_warning
from ..backend.device import OutOfMemory
from ..backend.static_cost import count_span, static_blocks
from ..backend.workspace import Workspaces
from ..network.network import Network
from ..schedule.policies import Recompute, resolve
from ..schedule.program import Schedule
from .base import Trainer, _as_tensors
from .calibrate import BudgetExceededError, Calibrator, PlanCosts, replanning
from .section_functions import Compiled, ReplayMismatchError, compile_schedule
from .executor import DryStep, Executor, WeightPenalty
from .measure import Measurer
from .remembered import plan_key
from .update import why_at_end

log = logging.getLogger("sections")

__all__ = ["Engine", "ReplayMismatchError", "BudgetExceededError", "OutOfMemory", "WeightPenalty"]


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
        probe_batch: no longer used (a warning says so): planning measures no block. Costs are counted from
            traces at the real batch, and dry steps run the real batch.
        device: where memory is measured (default ``GPU:0`` when there is a GPU, else ``CPU:0``; under a
            strategy, its replica devices).
        distribute: a ``tf.distribute`` strategy (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``) to run
            every section on each replica with its share of the global batch. Create the optimizer (and the
            model, if you build it yourself) under ``strategy.scope()``; ``batch`` stays the global batch.
        penalty: a ``WeightPenalty``: a term of the loss that reads only weights (weight regularizers), whose
            gradient the engine adds for the variables outside the last section (``SectionedModel`` passes Keras's).
        extra_state: a function returning variables the loss updates beside the network's state (Keras metrics
            under ``fit``); dry steps and a step run again after running out of memory restore them too.
        plan_store: ``sections="auto"``: a mapping (``get`` and item assignment) where chosen plans are kept under a
            key of what they depend on (``sections.step.remembered``): a plan found there for this set-up is
            read back, dry-run first and runs where it fits, so processes of one set-up run one
            plan; the plan chosen (and each re-plan) is written back. ``None``: every build searches afresh.

    Example:
        >>> engine = Engine(net, keras.optimizers.Adam(1e-3), sections=4)
        >>> stats = engine.train_step(batch)
        >>> stats["loss"], stats["forward_runs"], stats["peak_bytes"]
    """

    strategy = "sectioned"

    def __init__(self, network: Network, optimizer, sections: int | Sequence[str] | str = 1,
                 policy="recompute", jit_compile: bool = False, check: bool = False,
                 memory_budget: int | str | None = None, probe_batch: int | None = None, device: str | None = None,
                 distribute=None, one_graph: bool = False, lean: bool | str = True, apply: str = "auto",
                 penalty: WeightPenalty | None = None, extra_state: Callable[[], Sequence] = tuple,
                 plan_store=None):
        fixed = sections if isinstance(sections, Schedule) else None
        if fixed is not None:  # a schedule made earlier (plan_schedule, or by hand)
            sections, policy = fixed.num_sections, list(fixed.policies)
        super().__init__(network, optimizer, sections, policy, jit_compile, memory_budget, probe_batch, device,
                         distribute)
        self.lean = rules.check_lean(lean)
        apply = rules.check_apply(apply)
        one_graph = bool(one_graph)
        apply_reason = why_at_end(optimizer, self.replicas.distributed, one_graph)
        if apply == "at_end":
            apply_reason = "apply='at_end'"
        elif apply == "in_backward" and apply_reason is not None and optimizer is not None:
            raise ValueError(f"apply='in_backward' would not equal one update: {apply_reason}; use "
                             f"apply='at_end' or 'auto'.")
        sections = self.request.sections
        if one_graph and (check or sections == "auto" or fixed is not None):
            raise ValueError("one_graph=True compiles a fixed recompute partition into one step: it takes no "
                             "check mode, sections='auto' or Schedule.")
        if fixed is not None:  # a schedule made earlier (plan_schedule, or by hand)
            self.request = replace(self.request, schedule=fixed)
        elif sections != "auto":
            count = sections if isinstance(sections, int) else len(sections) + 1
            policies = [resolve(p) for p in rules.policies_for(policy, count)]
            if one_graph and any(type(p) is not Recompute for p in policies):
                raise ValueError(f"one_graph=True runs every section with policy 'recompute'; got "
                                 f"{[p.name for p in policies]}.")
            self.request = replace(self.request, policies=policies)
        #: Planning (``sections="auto"``; made at build), else None.
        self.calibrator: Calibrator | None = None
        self.plan_store, self.plan_key = plan_store, None  # remembered plans (``sections.step.remembered``)
        self._budget_given = memory_budget
        self.workspaces: Workspaces | None = None  # kernels' work buffers measured while planning
        #: Running: the compiled program's steps.
        self.executor = Executor(network, optimizer, self.replicas, self.meter, self._scale_loss, check=bool(check),
                                 jit_compile=self.jit_compile, apply_reason=apply_reason,
                                 one_graph=one_graph, penalty=penalty, extra_state=extra_state)

    # ------------------------------------------------------------------ what planning made (auto), read-only views
    @property
    def plan(self):
        return self.calibrator.plan if self.calibrator is not None else None

    @plan.setter
    def plan(self, plan) -> None:
        self.calibrator.plan = plan

    @property
    def memory_floor(self):
        """``sections="auto"``: the least memory any plan at this batch is predicted to need (a ``Floor``: its bytes,
        the part that does not grow with the batch, and the line plans must stay under); else None."""
        return self.calibrator.floor() if self.calibrator is not None else None

    @property
    def memory_budget(self) -> int | None:
        """The budget in bytes (``sections="auto"``; lowered where a step ran out of memory), else None."""
        return self.calibrator.budget if self.calibrator is not None else super().memory_budget

    @property
    def one_graph(self) -> bool:
        return self.executor.one_graph

    @property
    def apply_reason(self) -> str | None:
        """Why the update runs once after the whole backward (``None``: it runs section by section in it)."""
        return self.executor.apply_reason

    @property
    def schedule(self) -> Schedule | None:
        """The schedule in force (None before ``build``)."""
        return self.compiled.schedule if self.compiled is not None else None

    @property
    def replans(self) -> list[str]:
        """The plan's corrections by dry steps and measured steps, in words."""
        return self.calibrator.replans if self.calibrator is not None else []

    @property
    def planning_seconds(self) -> float | None:
        """Seconds ``sections="auto"`` spent planning (probes and dry steps), else None."""
        return self.calibrator.planning_seconds() if self.calibrator is not None else None

    @property
    def profiles(self):
        return self.calibrator.profiles if self.calibrator is not None else None

    @property
    def plan_remembered(self) -> bool | None:
        """True where the plan ``plan_store`` remembered for this set-up runs, False where it was tried and searched
        past, None where there was none (``sections.step.remembered``)."""
        return self.calibrator.from_record if self.calibrator is not None else None

    @property
    def dry_runs(self) -> list[dict]:
        """``sections="auto"``: each dry step's predicted and measured peak (bytes), sections, and verdict."""
        return self.calibrator.dry_runs if self.calibrator is not None else []

    # ------------------------------------------------------------------ partition
    def _settle(self, batch):
        request = self.request
        if request.schedule is not None:
            schedule = request.schedule
        elif request.policies is None:
            schedule = self._planned(batch)
        else:
            schedule = Schedule(tuple(self._starts()), tuple(request.policies))
        self.compiled = self.compile(schedule)

    def _planned(self, batch) -> Schedule:
        """The planner's schedule for ``sections="auto"`` (its refusal, if none fits, is told after dry steps)."""
        if not self.meter.available:
            from ..allocator import missing_statistics_advice

            raise ValueError(f"sections='auto' plans on measured memory, but the allocator of "
                             f"{', '.join(self.meter.devices)} keeps no statistics: {missing_statistics_advice()}.")
        costs = PlanCosts.of(self.network, self.optimizer, self.borders, self.apply_reason is None)
        # What the device holds beside the model, its optimizer and the batch (an input pipeline's buffers, where
        # they share the device): every step's peak includes it, so the first plan does too.
        resident = max(0, self.meter.settled() - costs.base_bytes)
        crash = kernel_crash_warning() if self.device_memory.device.upper().startswith("CPU") else None
        if crash:
            log.warning(crash)
        log.info(f"planning: counting {len(self.network.blocks)} blocks' memory from their traces at batch "
                 f"{self.borders.real_batch}")
        began = time.perf_counter()
        work = self.workspaces = Workspaces(self.meter, room=self.device_memory.total)
        profiles = static_blocks(self.network, self.borders, self.lean, work)
        measurer = Measurer(self.network, self.executor, self.compile, self.meter, self.lean)
        hint = None
        if self.plan_store is not None:
            hard = self.device_memory.hard or self.budget.source == "given"
            self.plan_key = plan_key(self.network, self.borders, self.optimizer,
                                     self.memory_budget if hard else repr(self._budget_given),
                                     self.device_memory.describe(), self.lean, self.jit_compile, self.apply_reason)
            hint = self.plan_store.get(self.plan_key)
        self.calibrator = Calibrator(profiles, costs, self.memory_budget, self.budget_source, self.lean, measurer,
                                     resident=resident,
                                     device_limit=self.device_memory.total if self.device_memory.hard else None,
                                     count_span=lambda s, t: count_span(self.network, self.borders, s, t, self.lean,
                                                                        work),
                                     workspaces=work, hint=hint)
        self.calibrator.seconds["model"] += time.perf_counter() - began
        return self.calibrator.plan.schedule

    def build(self, batch) -> None:
        """As ``Trainer.build``; with ``sections="auto"``, then dry steps (``Calibrator.calibrate``)."""
        if self._built:
            return
        super().build(batch)
        calibrator = self.calibrator
        if calibrator is None:
            return
        if self.meter.available and not self.replicas.distributed:
            calibrator.calibrate(self.replicas.split(dict(_as_tensors(self.network, batch))))
            self.below_resolution = self.below_resolution or calibrator.measured_nothing
        if calibrator.measurer.current is not None:
            self.compiled = calibrator.measurer.current
        log.info(calibrator.planning_summary())
        if calibrator.refusal is not None:
            self._built = False
            raise calibrator.refusal
        self._remember()

    def _remember(self) -> None:
        """Write the plan in force to ``plan_store`` (where one was given and a plan runs)."""
        record = self.calibrator.record() if self.plan_store is not None and self.plan_key else None
        if record is not None:
            self.plan_store[self.plan_key] = record

    # ------------------------------------------------------------------ compiling, and what calibration runs
    def compile(self, schedule: Schedule) -> Compiled:
        """``schedule``'s sections and their compiled functions (not made current: ``adopt``, ``restore``)."""
        return compile_schedule(self.network, self.borders, self.replicas, schedule, jit_compile=self.jit_compile,
                                scale_loss=self._scale_loss, lean=self.lean)

    def _prepare(self) -> None:
        self.executor.adopt(self.compiled)

    def adopt(self, schedule: Schedule) -> None:
        """Compile ``schedule`` and run it from now on."""
        self.restore(self.compile(schedule))

    def restore(self, compiled: Compiled) -> None:
        """Run a program compiled earlier from now on (no compiling again)."""
        self.compiled = compiled
        self.executor.adopt(compiled)

    def dry_step(self, batch) -> DryStep:
        """The current program's step run unapplied, its state restored (``Executor.dry_step``)."""
        return self.executor.dry_step(batch, self.read_counters)

    def _policy_label(self, section) -> str:
        label = "fused (last)" if section.index == len(self.sections) - 1 else section.policy
        return label + (", plain" if section.index in self.schedule.plain else "")

    # ------------------------------------------------------------------ the step
    def _step(self, batch):
        """One step. With ``sections="auto"`` on a device of fixed memory, a step that runs out of memory is
        re-planned below what it reached (dry steps, as at build) and run again from the state before it (saved
        on the host each step), so its loss is an uninterrupted run's; anywhere else it raises ``OutOfMemory``."""
        if not (self.calibrator is not None and self.device_memory.hard and not self.replicas.distributed):
            return self._run_step(batch)
        return replanning(self, lambda: self._run_step(batch), batch, self._take_up_replan)

    def _take_up_replan(self) -> None:
        self.compiled = self.calibrator.measurer.current
        self._remember()

    def _step_as_compiled(self, batch):
        return self._run_step(batch)

    def _run_step(self, batch):
        loss, peaks, device_peaks = self.executor.step(batch)
        stats = self._stats(loss, device_peaks, peaks)
        if self.calibrator is not None and stats["step_peak_bytes"] is not None:
            # The plan is per replica; replicas on logical CPU devices share one allocator (read as their total).
            sharing = max(1, len(self.replicas.devices()) // len(self.meter.devices))
            schedule = self.calibrator.replan_if_over(stats["step_peak_bytes"] // sharing)
            if schedule is not None and schedule != self.schedule:
                self.adopt(schedule)
                self._remember()
        return stats

    def _gradients(self, batch):
        return self.executor.gradients(batch)

    def flops(self) -> list[dict]:
        """Forward and backward FLOPs per section at the real batch (TensorFlow's cost analysis; traces each
        section once more, so call it once)."""
        from .flops import section_flops

        self._require_built()
        return section_flops(self.compiled, self.borders)

    def _trace_counts(self) -> dict[str, int]:
        return self.executor.trace_counts()
