"""A training step's readings as one typed record, and the names they are written under: the TensorBoard tags
(the runner's event files and ``SectionedModel``'s TensorBoard callback) and the memory figures of ``metrics.json``.
Named here once. Also what a caller reads of a trainer (``TrainerProtocol``: its step, its planning report), declared.
Plain Python: no TensorFlow at load."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, Protocol, Sequence, runtime_checkable

_MiB = 2.0**20

# TensorBoard tags (memory in MiB, the unit in the tag)
LOSS = "loss/train"
STEP_PEAK = "memory_MiB/step_peak"
SECTION_PEAK = "memory_MiB/section_{k}"
FORWARD_RUNS = "forward_runs/section_{k}"
DEVICE_PEAK = "memory_MiB/step_peak/{device}"
#: Regular expressions of the per-section tags (TensorBoard's custom-scalars layout).
SECTION_PEAK_TAGS = r"memory_MiB/section_\d+"
FORWARD_RUNS_TAGS = r"forward_runs/section_\d+"


def mib(value: int | None) -> float | None:
    return None if value is None else value / _MiB


@dataclass(frozen=True)
class StepReading(Mapping):
    """What one training step reports: its loss (averaged over replicas), each section's forward runs, each
    section's backward peak and the step's peak (bytes; ``None`` where nothing was measured: an allocator without
    statistics, or a reading of 0 bytes), and each device's step peak. Reads as a mapping too
    (``reading["loss"]``), by its field names."""

    loss: float
    forward_runs: list
    peak_bytes: list
    step_peak_bytes: int | None
    device_peak_bytes: dict

    def __getitem__(self, key: str):
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)

    def scalars(self) -> dict:
        """TensorBoard tag -> value: the loss, the step's peak (and each device's, with several), each section's
        peak and forward runs; ``None`` where not measured (a writer leaves those out)."""
        values = {LOSS: self.loss, STEP_PEAK: mib(self.step_peak_bytes)}
        devices = self.device_peak_bytes or {}
        if len(devices) > 1:  # replicas on devices with their own allocators: each one's step peak
            values.update({DEVICE_PEAK.format(device=d.replace(":", "_")): mib(p) for d, p in devices.items()})
        for k, (peak, runs) in enumerate(zip(self.peak_bytes, self.forward_runs)):
            values[SECTION_PEAK.format(k=k)] = mib(peak)
            values[FORWARD_RUNS.format(k=k)] = runs
        return values


_FIELDS = tuple(f.name for f in fields(StepReading))


def memory_figures(readings: Sequence[Mapping]) -> dict:
    """``metrics.json``'s memory figures over a run's steps: the largest step peak, the median of the steps after the
    first (identical steps can differ by a large allocation or two: op order on several threads varies), each
    section's largest peak, and the last step's forward runs per section."""
    peaks = [r["step_peak_bytes"] for r in readings if r["step_peak_bytes"] is not None]
    later = [r["step_peak_bytes"] for r in readings[1:] or readings if r["step_peak_bytes"] is not None]
    return {
        "step_peak_bytes": max(peaks, default=None),
        "median_step_peak_bytes": statistics.median(later) if later else None,
        "peak_bytes_per_section": [max((v for v in col if v is not None), default=None)
                                   for col in zip(*(r["peak_bytes"] for r in readings))],
        "forward_runs_per_section": list(readings[-1]["forward_runs"]) if readings else [],
    }


# ---------------------------------------------------------------------------------------------- what a caller reads
@runtime_checkable
class PlanReport(Protocol):
    """The planner's plan as a caller reads it (``sections.Plan``): the budget it was made under, its predicted peak,
    the margin kept, how many sections' activations were measured as one run, and the bytes a dry step measured
    beside the model's prediction."""

    budget: int
    predicted_peak: int
    margin: float
    measured_sections: int
    extra_bytes: int

    def summary(self) -> str: ...


@runtime_checkable
class FloorReport(Protocol):
    """The least memory any plan at a batch needs (``least``; ``measured``: by its dry step, else counted), the
    part not growing with the batch (``fixed``) and the line ``least`` must stay under for a plan to fit
    (``line``), bytes (``Engine.memory_floor``)."""

    least: int
    fixed: int
    line: int
    measured: bool


class ReplicasReport(Protocol):
    """How a trainer runs under ``tf.distribute``: the replicas in sync and the strategy (None: one device)."""

    count: int
    strategy: Any


class MeterReport(Protocol):
    """Where a trainer measures memory: whether the allocator keeps statistics, and on which devices."""

    available: bool
    devices: list


@runtime_checkable
class TrainerProtocol(Protocol):
    """What a caller (the runner) reads of a trainer: ``sections.Engine``, ``sections.WholeGraph`` and
    ``sections.RecomputeGrad`` (and ``sections.MicroBatched`` around one) each satisfy it (``tests/test_protocols.py``). A member a baseline lacks the meaning
    of is there with ``None``: ``plan``, ``memory_floor``, ``planning_seconds``, ``plan_remembered``, ``lean``, ``flops()``,
    ``micro_batch``, ``describe_micro_batches()``; ``sections.MicroBatched`` answers for the trainer it wraps."""

    strategy: str  # "sectioned", "whole", "recompute_grad"
    network: Any  # sections.Network
    optimizer: Any
    replicas: ReplicasReport
    meter: MeterReport
    device_memory: Any  # sections.DeviceMemory: total, source, hard, describe()
    memory_budget: int | None  # bytes (sections="auto"), else None
    budget_source: str | None
    memory_floor: FloorReport | None  # sections="auto", after build
    plan: PlanReport | None  # sections="auto", after build
    planning_seconds: float | None
    dry_runs: Sequence  # sections="auto": each dry step's {"sections", "predicted", "measured", "ran_out", "fits"}
    plan_remembered: bool | None  # sections="auto" with a plan_store: whether the remembered plan runs; else None
    memory_measured: bool
    memory_note: str | None  # why memory is not measured (None: it is)
    lean: bool | str | None  # None: a trainer without lean gradients
    apply_reason: str | None  # why the update runs once after the whole backward (None: in the backward)
    micro_batch: int | None  # sections.MicroBatched: the most examples a step runs at once (None: the whole batch)
    kernel_faults: str | None  # after build: a CPU kernel known to compute one of the model's gradients wrongly, in a line

    @property
    def sections(self) -> list: ...  # sections.Section each (empty before build)

    def build(self, batch: Mapping) -> None: ...

    def train_step(self, batch: Mapping, replan: bool = True) -> StepReading: ...

    def evaluate(self, batch: Mapping) -> dict: ...

    def describe(self) -> str: ...

    def describe_micro_batches(self) -> str | None: ...  # what a micro-batched step does, in words (else None)

    def flops(self) -> list | None: ...  # forward and backward FLOPs per section; None: not counted (baselines)
