"""What every trainer shares (the engine and the baselines): arguments, build, partition, evaluation, reports."""

from __future__ import annotations

import logging
import warnings
import weakref

from dataclasses import dataclass
from typing import Mapping, Sequence

import tensorflow as tf

from .. import rules
from ..backend.device import Budget, OutOfMemory, device_memory, held_outside, resolve_budget
from ..backend.kernel_faults import wrong_gradient_warning
from ..backend.lean import lean_scope
from ..backend.memory import MemoryMeter, below_resolution
from ..backend.precision import unscale
from ..backend.profile import SPEC_BATCH, output_specs, probe_slice, shape_costs
from ..backend.replicas import Replicas, local_size, scale_for_replicas
from ..backend.structure import nbytes
from ..network.network import Network
from ..schedule.partition import Section, balanced_starts, format_table
from ..schedule.program import Schedule
from ..telemetry import StepReading
from .calibrate import check_variables_fit
from .section_functions import Borders, Compiled

log = logging.getLogger("sections")
_FAULTS = weakref.WeakKeyDictionary()  # network -> its kernel-fault line (None: none), found at its first build


class Trainer:
    """Base of ``Engine``, ``WholeGraph`` and ``RecomputeGrad``: the same arguments and public methods.

    Subclasses set ``strategy`` and implement ``_settle`` (the partition, compiled: ``compiled``), ``_prepare``
    (what runs it), ``_step`` and ``_gradients``.
    """

    strategy = "?"
    #: The planner's plan (``sections="auto"``), else None.
    plan = None
    #: ``sections="auto"``: the least memory any plan at this batch needs (``Floor``), else None.
    memory_floor = None
    #: Seconds ``sections="auto"`` spent planning, else None.
    planning_seconds: float | None = None
    #: ``sections="auto"``: each dry step's predicted and measured peak, sections and verdict; else none.
    dry_runs: tuple = ()
    #: ``sections="auto"`` with a ``plan_store``: True where the plan remembered for the set-up runs, False where
    #: it was tried and searched past; None: no record (and every other trainer).
    plan_remembered: bool | None = None
    #: Lean gradients (``Engine``'s ``lean``); None: a trainer without them (the baselines run Keras's own).
    lean: bool | str | None = None
    #: Why the update runs once after the whole backward (None: section by section in it).
    apply_reason: str | None = "a baseline trainer: one update after its whole step"
    #: The most examples a step runs at once (``MicroBatched``); None: the whole batch.
    micro_batch: int | None = None
    #: The partition compiled: sections, their counters and batch fields (and the engine's section functions).
    compiled: Compiled | None = None

    def __init__(self, network: Network, optimizer, sections: int | Sequence[str] | str = 1,
                 policy="recompute", jit_compile: bool = False, memory_budget: int | str | None = None,
                 probe_batch: int | None = None, device: str | None = None, distribute=None):
        if not isinstance(network, Network):
            raise ValueError(f"network must be a sections.Network; got {type(network).__name__}.")
        #: What ``build`` partitions by (``sections`` checked here, once).
        self.request = Request.of(network, sections, memory_budget, planner=self.strategy == "sectioned",
                                  probe_batch=probe_batch)
        self.network = network
        self.optimizer = optimizer
        self.jit_compile = bool(jit_compile)
        self.replicas = Replicas(distribute)
        self.meter = MemoryMeter(device or self.replicas.devices() or None)
        #: The device's memory: what a budget of None or a fraction reads, and what an out-of-memory stop names.
        self.device_memory = device_memory(self.meter.device)
        #: The budget (``sections="auto"``): bytes, and how they were reached; else None.
        self.budget: Budget | None = None
        if self.request.sections == "auto":
            self.budget = resolve_budget(memory_budget, self.device_memory, held_outside(self.meter))
        self._built = False
        #: Set at build where a kernel this process runs computes one of the model's gradients wrongly: the
        #: warning's line (``sections.backend.kernel_faults``); else None.
        self.kernel_faults: str | None = None
        #: Whether a step's reading was 0 bytes: nothing it allocated was counted (``memory_note`` says why).
        self.below_resolution = False

    @property
    def memory_budget(self) -> int | None:
        """The budget in bytes (``sections="auto"``), else None."""
        return self.budget.bytes if self.budget is not None else None

    @property
    def budget_source(self) -> str | None:
        """How the budget was reached: given; the device's memory less headroom; a fraction of it."""
        return self.budget.source if self.budget is not None else None

    # ------------------------------------------------------------------ build
    def build(self, batch: Mapping[str, tf.Tensor]) -> None:
        """Create variables (without running anything: no state moves), settle the partition, build the optimizer.

        Under a strategy ``batch`` is the global batch; variables are created in the strategy's scope and the
        partition is settled for one replica's share of the batch (what each replica runs).
        """
        if self._built:
            return
        batch = _as_tensors(self.network, batch)
        local = self.replicas.first_slice(dict(batch))
        with self.replicas.scope():
            self.network.build(local)
            self._say_kernel_faults()
            # Any engine, before eager work at the batch and before the slots are made: a device too small for
            # the variables and slots stops here in one line (VariablesDoNotFit)
            check_variables_fit(self.network, self.optimizer, self.meter.current(),
                                self.device_memory.total if self.device_memory.hard else None)
            small, real = probe_slice(self.network, local, SPEC_BATCH)
            with lean_scope(self.lean or False):  # lean attention: no n x n tensor in this eager run
                outputs, inputs = output_specs(self.network, small, real)
            #: What the borders hold (specs at the real batch), read without running a step.
            self.borders = Borders(small, real, inputs, outputs, nbytes(local))
            self._settle(local)
            self.replicas.check_owned(self.network.variables, self.optimizer)
            if not getattr(self.optimizer, "built", False):
                self.optimizer.build(self.network.trainable_variables)
        self._evaluators = (tf.function(self.replicas.wrap(self._evaluate_fn)), tf.function(self._evaluate_fn))
        self._prepare()
        self._built = True

    def _say_kernel_faults(self) -> None:
        """``kernel_faults``: the line where a CPU kernel this process runs computes one of the network's gradients
        wrongly, found once per network and warned once (a ``batch=max`` search builds many engines on one)."""
        if not self.device_memory.device.upper().startswith("CPU"):
            return
        if self.network not in _FAULTS:
            _FAULTS[self.network] = wrong_gradient_warning(self.network.layers)
            if _FAULTS[self.network]:
                log.warning(_FAULTS[self.network])
        self.kernel_faults = _FAULTS[self.network]

    @property
    def sections(self) -> list[Section]:
        """The sections of the partition in force (empty before ``build``)."""
        return list(self.compiled.sections) if self.compiled is not None else []

    def _starts(self) -> list[int]:
        """Where sections 1.. start: the boundaries named, else ``sections`` contiguous sections balanced by
        activation bytes counted from tensor shapes (the same cut on every run and machine, unlike measured
        memory)."""
        if self.request.starts is not None:
            return self.request.starts
        if self.request.sections == 1:
            return []
        b = self.borders
        costs = shape_costs(self.network, b.probe_slice, b.real_batch, b.input_specs, b.output_specs)
        return balanced_starts(costs, self.request.sections)

    # ------------------------------------------------------------------ steps
    def train_step(self, batch: Mapping[str, tf.Tensor], replan: bool = True) -> StepReading:
        """One training step; returns its ``sections.telemetry.StepReading``: loss, forward runs per section, peak
        bytes per section and for the step (under a strategy: ``batch`` is the global batch, forward runs are per
        replica, peaks are the largest replica device's, and ``device_peak_bytes`` has each device's). It reads as
        a dict too (``stats["loss"]``). ``replan=False``: a step that runs out of memory raises ``OutOfMemory``
        even where the engine would re-plan it and run it again (``sections="auto"`` on a device with a hard
        limit; a diagnostic re-run of the program as compiled)."""
        batch = _as_tensors(self.network, batch)
        self.build(batch)
        try:
            step = self._step if replan else self._step_as_compiled
            return step(self.replicas.split(dict(batch)))
        except tf.errors.ResourceExhaustedError as err:
            raise OutOfMemory.from_error(err, self.meter, self.device_memory) from None

    def _step_as_compiled(self, batch):
        """One step with no recovery from running out of memory (where ``_step`` has none, ``_step`` itself)."""
        return self._step(batch)

    def gradients(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, list]:
        """Loss and gradients (aligned with ``network.trainable_variables``; None where a variable gets none),
        computed as a step would, state updates included, but not applied. Both are unscaled: with a
        ``LossScaleOptimizer`` the step differentiates the scaled loss and these are divided by the scale."""
        batch = _as_tensors(self.network, batch)
        self.build(batch)
        loss, grads = self._gradients(self.replicas.split(dict(batch)))
        self.read_counters()
        if self.replicas.distributed:  # each replica's gradient of its scaled loss; their sum is the batch's
            loss, grads = tf.constant(self.replicas.mean(loss)), [self.replicas.sum(g) for g in grads]
        return loss, unscale(grads, self.optimizer)

    @property
    def memory_measured(self) -> bool:
        """Whether steps' memory is measured: the allocator keeps statistics and no step read below their
        resolution."""
        return self.meter.available and not self.below_resolution

    @property
    def memory_note(self) -> str | None:
        """Why memory is not measured, or None where it is."""
        if not self.meter.available:
            return "the allocator keeps no statistics"
        return below_resolution(self.meter.devices) if self.below_resolution else None

    def _stats(self, loss, device_peaks: dict, peaks: list | None = None) -> StepReading:
        """A step's report: the loss averaged over replicas, forward runs, per-section and per-device peaks
        (``None`` where the allocator keeps no statistics, and for a reading of 0 bytes: an allocator that counts
        reads no step as 0 unless it counted none of its allocations, as oneDNN's counts none under 256 KiB)."""
        if not self.meter.available:  # nothing measured: never reported as 0 bytes
            peaks, device_peaks = None, {d: None for d in device_peaks}
        else:
            if not max(device_peaks.values()):
                self.below_resolution = True
            device_peaks = {d: p or None for d, p in device_peaks.items()}
            peaks = [p or None for p in peaks] if peaks is not None else None
        return StepReading(loss=self.replicas.mean(loss), forward_runs=self.read_counters(),
                           peak_bytes=peaks if peaks is not None else [None] * len(self.sections),
                           step_peak_bytes=max((p for p in device_peaks.values() if p is not None), default=None),
                           device_peak_bytes=device_peaks)

    def _scale_loss(self, loss):
        """The loss whose gradients a step applies: the optimizer's own scaling (a ``LossScaleOptimizer``'s
        dynamic scale; its ``apply_gradients`` unscales), as Keras's ``train_step`` does."""
        loss = scale_for_replicas(loss)
        return self.optimizer.scale_loss(loss) if hasattr(self.optimizer, "scale_loss") else loss

    def describe_micro_batches(self) -> str | None:
        """What a micro-batched step does, in words (``MicroBatched``); None: one step over the whole batch."""
        return None

    def flops(self) -> list[dict] | None:
        """Forward and backward FLOPs per section (``Engine``); None: not counted (the baselines)."""
        return None

    def read_counters(self) -> list[int]:
        """Each section's forward runs since the last read, and the counters set back to zero."""
        return self.compiled.read_counters()

    def _evaluate_fn(self, batch):
        out = self.network.forward(batch, training=False)
        values = {"loss": self.network.loss(out, batch)}
        for name, fn in self.network.metrics.items():
            values[name] = fn(out, batch)
        return values

    def evaluate(self, batch: Mapping[str, tf.Tensor]) -> dict:
        """Loss and metrics in inference mode (no state changes)."""
        batch = _as_tensors(self.network, batch)
        self.build(batch)
        if self.replicas.distributed and local_size(batch, self.replicas) % self.replicas.count:
            # A batch the replicas cannot share equally (an evaluation set's remainder) runs on one device.
            return {k: float(v) for k, v in self._evaluators[1](dict(batch)).items()}
        values = self._evaluators[0](self.replicas.split(dict(batch)))
        return {k: self.replicas.mean(v) for k, v in values.items()}

    # ------------------------------------------------------------------ reports
    def _policy_label(self, section) -> str:
        return self.strategy

    def partition_rows(self) -> list[dict]:
        """The partition as table rows (nothing is measured to make it)."""
        self._require_built()
        rows = []
        for s in self.sections:
            rows.append({
                "section": s.index,
                "blocks": _span(s.block_names),
                "n_blocks": len(s.block_names),
                "params": s.num_parameters,
                "input_border": _fmt_specs(s.input_specs),
                "border_bytes": rules.human_bytes(s.input_bytes),
                "policy": self._policy_label(s),
            })
        return rows

    def describe(self) -> str:
        """The partition as a plain-text table (and the plan, when the planner made one)."""
        table = format_table(self.partition_rows())
        return table + ("\n" + self.plan.summary() if self.plan is not None else "")

    def trace_counts(self) -> dict[str, int]:
        """Traced graphs per compiled function (constant over steps of a fixed batch shape)."""
        self._require_built()
        return self._trace_counts()

    def _require_built(self) -> None:
        if not self._built:
            raise RuntimeError("Not built yet: call build(batch) or train_step(batch) first.")


@dataclass(frozen=True)
class Request:
    """What ``build`` partitions by: ``sections`` as checked (a count, boundary names or ``"auto"``), the block
    indices where sections start for boundary names (else None), and the policies of a fixed partition or a
    ``Schedule`` given (the engine's; both None: the planner's, or the baselines' own), and the planner's probe
    batch."""

    sections: int | list | str
    starts: list | None = None
    policies: list | None = None
    schedule: Schedule | None = None
    probe_batch: int | None = None  # examples the planner's block probe runs (None: the real batch)

    @classmethod
    def of(cls, network: Network, sections, memory_budget=None, planner: bool = True,
           probe_batch: int | None = None) -> "Request":
        """``sections`` checked, once, against every rule (``sections.rules``) and the network's blocks:
        its shape, ``memory_budget`` only with ``"auto"`` (``planner``: only the engine plans), a count no larger
        than the blocks, boundary names the network has, in order."""
        sections = rules.as_sections(sections)
        rules.check_sections_arg(sections, memory_budget, planner=planner)
        if memory_budget is not None:
            rules.parse_budget(memory_budget)  # its shape, before anything is measured
        if isinstance(sections, int):
            rules.check_section_count(sections, len(network.blocks), network.block_names)
        starts = network.boundary_starts(sections) if isinstance(sections, list) else None
        rules.check_probe_batch(probe_batch)
        if probe_batch is not None:
            warnings.warn(f"probe_batch={probe_batch} is no longer used: planning measures no block (costs are "
                          f"counted from traces at the real batch); drop it.", DeprecationWarning, stacklevel=4)
        return cls(sections, starts, probe_batch=probe_batch)


def _as_tensors(network, batch) -> dict:
    """The batch checked (a dict with every key the blocks read) and as tensors (NumPy arrays welcome)."""
    network.check_batch(batch)
    return {k: v if isinstance(v, (tf.Tensor, tf.distribute.DistributedValues)) else tf.nest.map_structure(
        tf.convert_to_tensor, v) for k, v in batch.items()}


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _fmt_specs(specs) -> str:
    leaves = tf.nest.flatten(specs)
    text = ", ".join("x".join(str(d) for d in t.shape.as_list()) for t in leaves)
    return text if len(leaves) == 1 else f"({text})"

