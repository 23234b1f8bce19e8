"""`batch=max`: the largest batch whose step fits the device, found by building the engine at trial batches.

A trial fits when the engine builds (with `sections=auto`, its dry steps find a plan under the budget) and one
step at that batch runs, state restored after, without running out of memory and within the budget (the device's
memory less headroom where none is given). Trials grow by the room the last one left (at most 4x), shrink by
what a refused one measured, then halve the gap until it is within `TOLERANCE` of the largest that fits.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass, field

log = logging.getLogger("runner")

TOLERANCE = 0.05  # stop when the smallest batch that does not fit is within this fraction above the largest that does
MAX_TRIALS = 10
START = 32  # the first trial's batch (per replica)


@dataclass
class Search:
    """The trials of a `batch=max` search: `(batch, fits, peak bytes or None, why)` each."""

    replicas: int
    cap: int | None
    trials: list = field(default_factory=list)

    def best(self):
        fitting = [t for t in self.trials if t[1]]
        return max(fitting, key=lambda t: t[0]) if fitting else None

    def describe(self) -> str:
        from sections.rules import human_bytes

        parts = [f"{b} {'fits' if ok else 'does not'}" + (f" ({human_bytes(p)})" if p else "")
                 for b, ok, p, _ in self.trials]
        return ", ".join(parts)


def round_to(batch: float, replicas: int) -> int:
    return max(replicas, int(batch) // replicas * replicas)


def next_batch(search: Search, budget: int, base: int) -> int | None:
    """The next trial's batch, or None when the search is done."""
    fits = [t for t in search.trials if t[1]]
    fails = [t for t in search.trials if not t[1]]
    lo = max((t[0] for t in fits), default=None)
    hi = min((t[0] for t in fails), default=None)
    last = search.trials[-1]
    if hi is None:  # grow
        if search.cap is not None and lo >= search.cap:
            return None
        room = (budget - base) / max(1, (last[2] or budget) - base) if last[2] else 2.0
        grown = round_to(lo * min(4.0, max(1.25, room * 0.95)), search.replicas)
        grown = max(grown, lo + search.replicas)
        return min(grown, search.cap) if search.cap is not None else grown
    if lo is None:  # shrink
        if hi <= search.replicas:
            return None
        need = fails[-1][2] if fails[-1][0] == hi else None
        ratio = (budget - base) / max(1, need - base) if need and need > base else 0.5
        return round_to(hi * min(0.9, max(0.1, ratio * 0.95)), search.replicas)
    if hi - lo <= search.replicas or hi <= lo * (1 + TOLERANCE):
        return None
    middle = round_to((lo + hi) / 2, search.replicas)
    return middle if lo < middle < hi else None


def largest_batch(try_batch, replicas: int, cap: int | None, budget: int, base: int):
    """Run trials `try_batch(b) -> (fits, peak or None, why, kept)` until the search ends; returns the largest
    batch that fits with what its trial kept (its engine), and the `Search`. None when not even `replicas`
    examples fit."""
    search = Search(replicas, cap)
    batch = round_to(min(START * replicas, cap or math.inf), replicas)
    kept = {}
    while batch is not None and len(search.trials) < MAX_TRIALS:
        fits, peak, why, engine = try_batch(batch)
        search.trials.append((batch, fits, peak, why))
        log.info(f"batch=max: batch {batch} {'fits' if fits else 'does not fit'}"
                 + (f" ({why})" if why else ""))
        if fits:
            kept = {batch: engine}  # only the largest that fits is kept; the others are freed
        del engine
        gc.collect()
        batch = next_batch(search, budget, base)
    best = search.best()
    return (best[0], kept.get(best[0])) if best else (None, None), search
