"""`batch=max`: the largest batch whose step fits the device, found by building the engine at trial batches.

A trial fits when the engine builds (with `sections=auto`, its dry steps find a plan under the budget) and one
step at that batch runs, state restored after, without running out of memory and within the budget (the device's
memory less headroom where none is given). Trials double from `START` (up to 8x where a step held far less than
the budget) until one does not fit (or the data's size is reached), then halve the gap until the smallest that
does not fit is within `TOLERANCE` of the largest that does. Where the caller can check it, the best trial's engine
steps once more after the search (the later trials' failures can leave the device with less room: keras.applications
ResNet50 at batch 32 read 888 MiB in its trial and ran out of a 1 GiB device in its first training step after five
failed trials); a batch that no longer fits counts as not fitting, and the search goes on below it.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass, field

log = logging.getLogger("runner")

TOLERANCE = 0.1  # stop when the smallest batch that does not fit is within this fraction above the largest that does
MAX_TRIALS = 10
START = 32  # the first trial's batch (per replica)


@dataclass
class Search:
    """The trials of a `batch=max` search: `(batch, fits, peak bytes or None, why)` each."""

    replicas: int
    cap: int | None
    budget: int | None = None
    trials: list = field(default_factory=list)

    def fitting(self) -> list:
        """The trials that fit, less any batch that a later trial found no longer fits."""
        failed = {t[0] for t in self.trials if not t[1]}
        return [t for t in self.trials if t[1] and t[0] not in failed]

    def best(self):
        fitting = self.fitting()
        return max(fitting, key=lambda t: t[0]) if fitting else None

    def describe(self) -> str:
        from sections.rules import human_bytes

        parts = [f"{b} {'fits' if ok else 'does not'}" + (f" ({human_bytes(p)})" if p else "")
                 for b, ok, p, _ in self.trials]
        return ", ".join(parts)


def round_to(batch: float, replicas: int) -> int:
    return max(replicas, int(batch) // replicas * replicas)


def next_batch(search: Search) -> int | None:
    """The next trial's batch, or None when the search is done: twice the largest that fits (up to 8x where its
    step held far less than the budget) until one does not (at most the cap), then halfway between the largest that fits and the smallest that does not."""
    lo = max((t[0] for t in search.fitting()), default=None)
    hi = min((t[0] for t in search.trials if not t[1]), default=None)
    if hi is None:  # grow: twice, or up to 8x where the last step held far less than the budget
        if search.cap is not None and lo >= search.cap:
            return None
        peak = search.trials[-1][2]
        factor = min(8.0, max(2.0, 0.9 * search.budget / peak)) if search.budget and peak else 2.0
        grown = round_to(factor * lo, search.replicas)
        return min(grown, search.cap) if search.cap is not None else grown
    if lo is None:  # shrink
        return round_to(hi / 2, search.replicas) if hi > search.replicas else None
    if hi - lo <= search.replicas or hi <= lo * (1 + TOLERANCE):
        return None
    middle = round_to((lo + hi) / 2, search.replicas)
    return middle if lo < middle < hi else None


def largest_batch(try_batch, replicas: int, cap: int | None = None, budget: int | None = None, again=None):
    """Run trials `try_batch(b) -> (fits, peak or None, why, kept)` until the search ends; returns the largest
    batch that fits (None when not even `replicas` examples do) with what its trial kept, and the `Search`.
    `again(kept) -> (fits, peak or None, why)`: the best trial checked once more after the others (None: not
    checked); where it no longer fits the search continues below it.
    The best trial's engine is held while later trials run (they then measure with its optimizer slots in
    memory, erring small) and trains: its plan is the one its dry steps measured (a plan made again at that
    batch after other trials may differ: the notebook ResNet's ran out of memory in its first step)."""
    search = Search(replicas, cap, budget)
    batch = round_to(min(START * replicas, cap or math.inf), replicas)
    kept = None
    while True:
        while batch is not None and len(search.trials) < MAX_TRIALS:
            fits, peak, why, engine = try_batch(batch)
            search.trials.append((batch, fits, peak, why))
            log.info(f"batch=max: batch {batch} {'fits' if fits else 'does not fit'}"
                     + (f" ({why})" if why else ""))
            if fits:
                kept = None  # the smaller batch's engine is freed before the larger one is kept
                gc.collect()
                kept = engine
            del engine
            gc.collect()
            batch = next_batch(search)
        best = search.best()
        if again is None or best is None or kept is None or best is search.trials[-1]:
            break  # nothing to check, or the best is the last trial: nothing ran after it
        fits, peak, why = again(kept)
        if fits:
            break
        why = f"{why or 'it no longer fits'}, checked again after the later trials"
        search.trials.append((best[0], False, peak, why))
        log.warning(f"batch=max: batch {best[0]} does not fit any more ({why}); searching below it")
        kept = None
        gc.collect()
        batch = next_batch(search)
        if batch is None or len(search.trials) >= MAX_TRIALS:
            break
    best = search.best()
    return (best[0] if best else None, kept), search
