"""`batch=max`: the largest batch whose step fits the device, found by building the engine at trial batches.

A trial fits when the engine builds (with `sections=auto`, its dry steps find a plan under the budget) and one
step at that batch runs, state restored after, without running out of memory and within the budget (the device's
memory less headroom where none is given). Trials double from `START` (up to 8x where a step held far less than
the budget) until one does not fit (or the data's size is reached), then halve the gap until the smallest that
does not fit is within `TOLERANCE` of the largest that does. With `sections=auto` each trial also reports its
floor (the least memory any plan at its batch needs, `Engine.memory_floor`), which grows with the batch along a
line: the next trial aims just below where that line meets the budget (`predicted`): keras.applications ResNet50
on a 2 GiB device took 4 trials (doubling took 10 of 5-30 minutes each). Where the caller can check it, the best
trial's engine steps once more after the search (the later trials' failures can leave the device with less room:
keras.applications ResNet50 at batch 32 read 888 MiB in its trial and ran out of a 1 GiB device in its first
training step after five failed trials); a batch that no longer fits counts as not fitting, and the search goes on
below it.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from sections.rules import human_bytes

log = logging.getLogger("runner")

TOLERANCE = 0.1  # stop when the smallest batch that does not fit is within this fraction above the largest that does
MAX_TRIALS = 10
START = 32  # the first trial's batch (per replica)
AIM = 0.97  # a trial guided by the floors aims this far below the batch they predict, so that it likely fits


@dataclass(frozen=True)
class Trial:
    """One trial of the search: its batch, whether it fits, the peak bytes its step read (None: not measured), why
    it does not fit, its floor with `sections=auto` (`Engine.memory_floor`: `least`, `fixed`, `line` bytes; else
    None) and what the caller kept of it (its engine; the `Search` holds trials without it)."""

    batch: int
    fits: bool
    peak: int | None = None
    why: str = ""
    floor: Any = None
    kept: Any = field(default=None, compare=False, repr=False)


@dataclass
class Search:
    """The trials of a `batch=max` search (`Trial` records, without what they kept)."""

    replicas: int
    cap: int | None
    budget: int | None = None
    trials: list[Trial] = field(default_factory=list)
    floors: dict = field(default_factory=dict)  # batch -> its floor (`least`, `fixed`, `line` bytes), sections=auto

    def fitting(self) -> list[Trial]:
        """The trials that fit, less any batch that a later trial found no longer fits."""
        failed = {t.batch for t in self.trials if not t.fits}
        return [t for t in self.trials if t.fits and t.batch not in failed]

    def best(self):
        fitting = self.fitting()
        return max(fitting, key=lambda t: t.batch) if fitting else None

    def records(self) -> list:
        """The trials for `metrics.json`: batch, fits, peak bytes, why; with `sections=auto`, the floor's bytes and
        the line it was held against."""
        out = []
        for t in self.trials:
            floor = self.floors.get(t.batch)
            out.append({"batch": t.batch, "fits": t.fits, "peak_bytes": t.peak, "why": t.why,
                        **({"floor_bytes": floor.least, "line_bytes": floor.line} if floor is not None else {})})
        return out

    def describe(self) -> str:
        parts = [f"{t.batch} {'fits' if t.fits else 'does not'}" + (f" ({human_bytes(t.peak)})" if t.peak else "")
                 for t in self.trials]
        return ", ".join(parts)


def round_to(batch: float, replicas: int) -> int:
    return max(replicas, int(batch) // replicas * replicas)


def predicted(search: Search) -> float | None:
    """The batch whose floor meets its line, extrapolated along a straight line: through the two trials whose
    floors lie nearest their lines where two are known, else through one trial and the floor's fixed part (the
    variables and slots; what else does not grow with the batch counts as growing, so one trial errs low). None
    where a batch fitted whose floor was above its line: the floors mislead, and the search doubles and halves."""
    points = sorted(search.floors.items())
    fitted = {t.batch for t in search.fitting()}
    if not points or any(f.least > f.line for b, f in points if b in fitted):
        return None  # no floors, or floors that said a batch could not fit where it did: doubling and halving
    if len(points) >= 2:
        (b1, f1), (b2, f2) = sorted(points, key=lambda p: abs(p[1].line - p[1].least))[:2]
        slope = (f2.least - f1.least) / (b2 - b1)
    else:
        (b1, f1), = points
        slope = (f1.least - f1.fixed) / b1
    if slope <= 0:
        return None
    return b1 + (f1.line - f1.least) / slope


def _guided(search: Search, lo: int, hi: int | None, guess: float) -> int | None:
    """The next trial aimed by the floors' `guess`: `AIM` below it; where it lies within the tolerance above the
    largest batch that fits, the tolerance's edge (whose failing ends the search). Growing, at most 8x; between a
    batch that fits and one that does not, a guess outside the bracket's middle 80% bisects instead."""
    r = search.replicas
    if lo is None:  # nothing fitted yet: below the smallest that did not, where the guess is
        batch = round_to(AIM * guess, r)
        return batch if batch < hi else (round_to(hi / 2, r) if hi > r else None)
    if guess <= lo * (1 + TOLERANCE):
        batch = max(round_to(lo * (1 + TOLERANCE), r), lo + r)
    else:
        batch = max(round_to(AIM * guess, r), lo + r)
        if hi is not None and not lo + 0.1 * (hi - lo) <= batch <= hi - 0.1 * (hi - lo):
            batch = round_to((lo + hi) / 2, r)
    if hi is None:
        batch = min(batch, round_to(8 * lo, r))
        return min(batch, search.cap) if search.cap is not None else batch
    return batch if lo < batch < hi else None


def next_batch(search: Search) -> int | None:
    """The next trial's batch, or None when the search is done: twice the largest that fits (up to 8x where its
    step held far less than the budget) until one does not (at most the cap), then halfway between the largest that
    fits and the smallest that does not; where trials report floors, aimed by them (`_guided`)."""
    lo = max((t.batch for t in search.fitting()), default=None)
    hi = min((t.batch for t in search.trials if not t.fits), default=None)
    if lo is not None and search.cap is not None and lo >= search.cap:
        return None
    if lo is not None and hi is not None and (hi - lo <= search.replicas or hi <= lo * (1 + TOLERANCE)):
        return None
    guess = predicted(search)
    if guess is not None:
        return _guided(search, lo, hi, guess)
    if hi is None:  # grow: twice, or up to 8x where the last step held far less than the budget
        peak = search.trials[-1].peak
        factor = min(8.0, max(2.0, 0.9 * search.budget / peak)) if search.budget and peak else 2.0
        grown = round_to(factor * lo, search.replicas)
        return min(grown, search.cap) if search.cap is not None else grown
    if lo is None:  # shrink
        return round_to(hi / 2, search.replicas) if hi > search.replicas else None
    middle = round_to((lo + hi) / 2, search.replicas)
    return middle if lo < middle < hi else None


def largest_batch(try_batch, replicas: int, cap: int | None = None, budget: int | None = None, again=None):
    """Run trials `try_batch(b) -> Trial` until the search ends; returns the largest batch that fits (None when
    not even `replicas` examples do) with what its trial kept, and the `Search`.
    `again(best: Trial) -> Trial`: the best trial (with what it kept) checked once more after the others (None: not
    checked); where it no longer fits the search continues below it.
    The best trial's engine is held while later trials run (they then measure with its optimizer slots in
    memory, erring small) and trains: its plan is the one its dry steps measured (a plan made again at that
    batch after other trials may differ: the notebook ResNet's ran out of memory in its first step)."""
    search = Search(replicas, cap, budget)
    batch = round_to(min(START * replicas, cap or math.inf), replicas)
    kept = None
    while True:
        while batch is not None and len(search.trials) < MAX_TRIALS:
            trial = try_batch(batch)
            fits, why, floor, engine = trial.fits, trial.why, trial.floor, trial.kept
            search.trials.append(replace(trial, kept=None))
            if floor is not None:
                search.floors[batch] = floor
            guess = predicted(search)
            log.info(f"batch=max: batch {batch} {'fits' if fits else 'does not fit'}"
                     + (f" ({why})" if why else "")
                     + (f"; its floor {human_bytes(floor.least)} against {human_bytes(floor.line)}, the floors "
                        f"predict about {int(guess)}" if floor is not None and guess else ""))
            if fits:
                kept = None  # the smaller batch's engine is freed before the larger one is kept
                gc.collect()
                kept = engine
            del engine, trial
            gc.collect()
            batch = next_batch(search)
        best = search.best()
        if again is None or best is None or kept is None or best is search.trials[-1]:
            break  # nothing to check, or the best is the last trial: nothing ran after it
        checked = again(replace(best, kept=kept))
        if checked.fits:
            break
        why = f"{checked.why or 'it no longer fits'}, checked again after the later trials"
        search.trials.append(Trial(best.batch, False, checked.peak, why))
        log.warning(f"batch=max: batch {best.batch} does not fit any more ({why}); searching below it")
        kept = None
        gc.collect()
        batch = next_batch(search)
        if batch is None or len(search.trials) >= MAX_TRIALS:
            break
    best = search.best()
    return (best.batch if best else None, kept), search
