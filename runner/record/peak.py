"""What held a profiled step's peak: the allocations live at the moment of the peak, read from a profile.

TensorFlow's profiler traces each allocator's allocations (``MemoryAllocation`` / ``MemoryDeallocation``
events on the host plane: the op that asked, the tensor's shape, the allocator's bytes in use after it). Replaying
them in time order finds the moment of the largest bytes in use and what was live then; bytes in use at that
moment that no traced allocation accounts for were allocated before the profile began (variables, optimizer
slots, the batch, caches). With a BFC allocator (oneDNN off, or ``TF_CPU_ALLOCATOR_USE_BFC=true``; a GPU) that
peak is the allocator statistics' (``step_peak_bytes``). oneDNN's CPU allocator serves allocations under 256 KiB
from a pool of its own, which the trace does not show, and its statistics add that pool's peak to its BFC part's:
there the statistics read more than the trace by up to that pool's peak (measured, TensorFlow 2.21).
"""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from pathlib import Path

MiB = 2**20
_EVENTS = ("MemoryAllocation", "MemoryDeallocation")


@dataclass
class Held:
    """One place's live allocations at the peak: ``place`` the op without TensorFlow's numbering."""

    place: str
    region: str
    nbytes: int = 0  # the allocator's chunks (what its statistics count)
    requested: int = 0  # what the tensors asked for
    count: int = 0
    shapes: set = field(default_factory=set)


@dataclass
class PeakBreakdown:
    allocator: str
    peak: int  # the allocator's largest bytes in use over the profile
    before: int  # of it, allocated before the profile began
    held: list  # [Held], largest first
    statistics: int | None = None  # the allocator statistics' peak over the same steps, where known

    def untraced(self) -> str:
        """A sentence on what the statistics read beyond the trace, or ''."""
        if not self.statistics or self.statistics <= self.peak:
            return ""
        return (f"The allocator statistics read {self.statistics / MiB:.1f} MiB over the same steps: "
                f"{(self.statistics - self.peak) / MiB:.1f} MiB more than the trace shows (oneDNN's CPU allocator "
                f"serves allocations under 256 KiB from a pool the trace leaves out, and adds that pool's peak).")

    def table(self, top: int = 20) -> str:
        """Markdown: the places holding the most at the peak, then the rest in one row."""
        note = self.untraced()
        rows = [f"Peak {self.peak / MiB:.1f} MiB ({self.peak} bytes, {self.allocator}) in the profile's allocator "
                f"trace; held at that moment:" + (f" {note}" if note else ""), "",
                "| held by (op, region) | MiB | tensors | shapes |", "|---|---|---|---|",
                f"| allocated before the profile (variables, optimizer slots, the batch, caches) | "
                f"{self.before / MiB:.1f} | | |"]
        for h in self.held[:top]:
            shapes = ", ".join(sorted(h.shapes))
            rows.append(f"| {h.place} ({h.region}) | {h.nbytes / MiB:.1f} | {h.count} | "
                        f"{shapes if len(shapes) <= 80 else shapes[:77] + '...'} |")
        rest = self.held[top:]
        if rest:
            rows.append(f"| {len(rest)} other places | {sum(h.nbytes for h in rest) / MiB:.1f} | "
                        f"{sum(h.count for h in rest)} | |")
        slack = self.slack()
        if slack:
            rows += ["", f"Of the traced chunks, {slack / MiB:.1f} MiB is beyond what their tensors asked for (a BFC "
                         f"allocator hands a whole free chunk to a request of over half its size when less than "
                         f"128 MiB would be left)."]
        return "\n".join(rows) + "\n"

    def slack(self) -> int:
        """Bytes the live chunks hold beyond their tensors' requests (the allocator's rounding and unsplit
        chunks)."""
        return sum(h.nbytes - h.requested for h in self.held if h.requested)

    def headline(self, top: int = 3) -> str:
        """One line: the peak and its largest holders."""
        parts = [f"{h.place} {h.nbytes / MiB:.0f} MiB" for h in self.held[:top]]
        return (f"profiled peak {self.peak / MiB:.0f} MiB ({self.allocator}): {self.before / MiB:.0f} MiB from "
                f"before the profile; largest holders {', '.join(parts) or 'none'}")


def place(op: str | None) -> str:
    """``section_3/conv2d_12/Conv2D`` -> ``section/conv2d/Conv2D``: the same layer in every block reads alike."""
    return re.sub(r"_\d+(?=/|$)", "", op) if op else "?"


def _events(path: Path) -> list:
    """The allocator events of one ``.xplane.pb`` in time order, as ``(kind, {stat name: value})``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    found = []
    for plane in space.planes:
        kinds = {k: v.name for k, v in plane.event_metadata.items() if v.name in _EVENTS}
        if not kinds:
            continue
        names = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for ev in line.events:
                kind = kinds.get(ev.metadata_id)
                if kind is None:
                    continue
                stats = {}
                for s in ev.stats:
                    which = s.WhichOneof("value")
                    value = getattr(s, which) if which else None
                    stats[names.get(s.metadata_id)] = names.get(value) if which == "ref_value" else value
                found.append((line.timestamp_ns * 1000 + ev.offset_ps, kind, stats))
    found.sort(key=lambda e: e[0])
    return [(kind, stats) for _, kind, stats in found]


def breakdown(events: list, statistics: int | None = None) -> PeakBreakdown | None:
    """The allocator with the largest bytes in use, and what was live at its peak; None without events.
    ``statistics``: the allocator statistics' peak over the same steps (told beside the trace's)."""
    by_allocator = collections.defaultdict(list)
    for kind, stats in events:
        by_allocator[stats.get("allocator_name") or "?"].append((kind, stats))
    best = None
    for allocator, seq in by_allocator.items():
        live, top, snapshot = {}, -1, []
        for kind, stats in seq:
            if kind == "MemoryAllocation":
                live[stats.get("addr")] = stats
            else:
                live.pop(stats.get("addr"), None)
            in_use = stats.get("bytes_allocated") or 0
            if in_use > top:
                top, snapshot = in_use, list(live.values())
        if best is None or top > best[1]:
            best = (allocator, top, snapshot)
    if best is None:
        return None
    allocator, top, snapshot = best
    groups: dict = {}
    for stats in snapshot:
        key = (place(stats.get("tf_op")), stats.get("region_type") or "?")
        held = groups.setdefault(key, Held(*key))
        held.nbytes += stats.get("allocation_bytes") or 0
        held.requested += stats.get("requested_bytes") or 0
        held.count += 1
        held.shapes.add(stats.get("shape") or "?")
    held = sorted(groups.values(), key=lambda h: -h.nbytes)
    return PeakBreakdown(allocator, top, top - sum(h.nbytes for h in held), held, statistics)


def read(folder: Path, statistics: int | None = None) -> PeakBreakdown | None:
    """The breakdown of the newest profile under ``folder`` (a TensorBoard ``plugins/profile``), or None where
    it holds no profile or the profile traced no allocation (only small ones under oneDNN; an allocator that keeps
    no statistics traces nothing)."""
    files = sorted(Path(folder).glob("**/*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    return breakdown(_events(files[-1]), statistics) if files else None
