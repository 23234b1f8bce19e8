"""A training step's readings as one typed record, and the names they are written under: the TensorBoard tags
(the runner's event files and ``SectionedModel``'s TensorBoard callback) and the memory figures of ``metrics.json``.
Named here once. Plain Python: no TensorFlow at load."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, fields
from typing import Iterator, Mapping, Sequence

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
