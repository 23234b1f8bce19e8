"""`batch=max`: the largest batch whose step fits the device, found by building the engine at trial batches.

A trial fits when the engine builds (with `sections=auto`, its dry steps find a plan under the budget) and one
step at that batch runs, state restored after, without running out of memory and within the budget (the device's
memory less headroom where none is given). Trials double from `START` (up to 8x where a step held far less than
the budget) until one does not fit (or the data's size is reached), then halve the gap until the smallest that
does not fit is within `TOLERANCE` of the largest that does. With `sections=auto` each trial also reports its
floor (the least memory any plan at its batch needs, as its dry step measured it: `Engine.memory_floor`), which
grows with the batch along a line: the next trial aims just below where that line meets the budget (`predicted`):
keras.applications ResNet50 on a 2 GiB device took 4 trials (doubling took 10 of 5-30 minutes each). Where the caller can check it, the best
trial's engine steps once more after the search (the later trials' failures can leave the device with less room:
keras.applications ResNet50 at batch 32 read 888 MiB in its trial and ran out of a 1 GiB device in its first
training step after five failed trials); a batch that no longer fits counts as not fitting, and the search goes on
below it.

Each trial is logged as it begins ("trial N: batch B") and ends (its verdict and seconds), and appended to the run
folder's `batch_max_trials.jsonl` as it ends (`runner.platform.journal`): `resume=` of a folder whose search was
stopped continues from those trials (`earlier`), building again the engine of a batch that fitted there. A signal
between trials stops the search (`runner.platform.stops.check`).
"""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from runner.platform import stops
from runner.platform.journal import TRIALS, append_trial
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
    plan: str = field(default="", compare=False)  # the plan its engine ran ("4 sections: recompute, ...")
    seconds: float | None = field(default=None, compare=False)  # how long the trial took (None: not timed)


@dataclass(frozen=True)
class RecordedFloor:
    """A floor read back from `batch_max_trials.jsonl` (the engine's `Floor`: `least`, `fixed`, `line` bytes)."""

    least: int
    fixed: int
    line: int


def trial_record(number: int, trial: Trial, replicas: int) -> dict:
    """One line of `batch_max_trials.jsonl`."""
    floor = trial.floor
    return {"trial": number, "batch": trial.batch, "fits": trial.fits, "peak_bytes": trial.peak, "why": trial.why,
            "plan": trial.plan, "seconds": trial.seconds, "replicas": replicas,
            **({"floor_bytes": floor.least, "fixed_bytes": floor.fixed, "line_bytes": floor.line}
               if floor is not None else {})}


def recorded(records: list[dict], replicas: int) -> tuple[list[Trial], str]:
    """The trials of a stopped search's records, and a line saying what the search does with them."""
    if not records:
        return [], "the stopped search recorded no trial; starting it again"
    other = {r.get("replicas", replicas) for r in records} - {replicas}
    if other:
        return [], (f"the stopped search's trials were made with {', '.join(map(str, sorted(other)))} replica(s), "
                    f"this run has {replicas}; starting it again")
    trials = []
    for r in records:
        floor = (RecordedFloor(r["floor_bytes"], r.get("fixed_bytes") or 0, r["line_bytes"])
                 if isinstance(r.get("floor_bytes"), int) and isinstance(r.get("line_bytes"), int) else None)
        trials.append(Trial(r["batch"], r["fits"], r.get("peak_bytes"), r.get("why") or "", floor,
                            plan=r.get("plan") or "", seconds=r.get("seconds")))
    shown = ", ".join(f"{t.batch} {'fits' if t.fits else 'does not'}" for t in trials)
    return trials, f"continuing the stopped search from its {len(trials)} recorded trial(s): {shown}"


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
        return max(reversed(fitting), key=lambda t: t.batch) if fitting else None  # the latest of equal batches

    def records(self) -> list:
        """The trials for `metrics.json`: batch, fits, peak bytes, why, plan, seconds; with `sections=auto`, the
        floor's bytes and the plan limit it was held against (`line_bytes`)."""
        out = []
        for t in self.trials:
            floor = self.floors.get(t.batch)
            out.append({"batch": t.batch, "fits": t.fits, "peak_bytes": t.peak, "why": t.why, "plan": t.plan,
                        "seconds": t.seconds,
                        **({"floor_bytes": floor.least, "line_bytes": floor.line} if floor is not None else {})})
        return out

    @property
    def seconds(self) -> float:
        """The search's time: its trials' seconds, those of a stopped session's included."""
        return round(sum(t.seconds or 0.0 for t in self.trials), 3)

    def describe(self) -> str:
        parts = [f"{t.batch} {'fits' if t.fits else 'does not'}" + (f" ({human_bytes(t.peak)})" if t.peak else "")
                 for t in self.trials]
        return ", ".join(parts)


def round_to(batch: float, replicas: int) -> int:
    return max(replicas, int(batch) // replicas * replicas)


def predicted(search: Search) -> float | None:
    """The batch whose floor meets its line, extrapolated along a straight line: the least-squares line through
    the trials' floors where two batches have one (measured floors move by tens of MiB with the allocator's
    chunks: MobileNetV2's read 185 MiB at batch 32 and 240 at 35, so a line through two neighbours can point
    anywhere), else through one trial and the floor's fixed part (the variables and slots; what else does not grow
    with the batch counts as growing, so one trial errs low). None where a batch fitted whose floor was above its
    line: the floors mislead, and the search doubles and halves. A trial whose least-memory plan ran out reports
    no floor (a lower bound near the device's size at every batch drew a flat line, and the search crept up by
    the tolerance to its trial limit)."""
    points = sorted(search.floors.items())
    fitted = {t.batch for t in search.fitting()}
    if not points or any(f.least > f.line for b, f in points if b in fitted):
        return None  # no floors, or floors that said a batch could not fit where it did: doubling and halving
    line = min(f.line for _, f in points)
    if len({b for b, _ in points}) >= 2:
        slope, intercept = statistics.linear_regression([b for b, _ in points], [f.least for _, f in points])
    else:
        (b1, f1), = points
        slope = (f1.least - f1.fixed) / b1
        intercept = f1.least - slope * b1
    if slope <= 0:
        return None
    return (line - intercept) / slope


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


def announce(model: str, engine: str, budget: int, source: str, auto: bool, cap: int | None, replicas: int) -> None:
    """The search's header: what is searched, on which device and budget, how, and the training set's cap."""
    log.info(f"batch=max: searching the largest batch whose step fits: model {model}, engine {engine}; budget "
             f"{human_bytes(budget)} ({source})")
    how = ("each trial plans its batch (sections=auto: the plan's dry steps must stay under the plan limit, the "
           "budget less the planner's margin; a trial's floor is the least memory any plan at its batch needs, and "
           "the floors aim the next trial)" if auto else
           "each trial builds the engine at its batch and runs two steps (state restored after), which must run "
           "and stay within the budget")
    log.info(f"batch=max: {how}; trials double from {START * replicas} until one does not fit, then halve the gap "
             f"to within {TOLERANCE:.0%}, at most {MAX_TRIALS} trials")
    if cap is not None:
        log.info(f"batch=max: at most the training set's size, {cap} examples (a larger batch would repeat examples "
                 f"within a step)")


def plan_of(engine) -> str:
    """A trial's plan in a few words: its sections and their policies."""
    policies = [str(s.policy) for s in engine.sections]
    if policies and set(policies) == {"whole"}:
        return "one whole-graph step"  # engine=whole: its sections are the model's, run as one graph
    return f"{len(policies)} section{'s' if len(policies) != 1 else ''}: {', '.join(policies)}"


def start_search(folder: Path | None, cfg, said: str | None, keep: bool) -> None:
    """Before the first trial: the run folder's `config.yaml` (with `batch: max`), so that a search killed before
    any checkpoint is a folder `resume=` continues; and what a resumed search does with the trials recorded."""
    if folder is None:
        return
    from omegaconf import OmegaConf

    from runner.platform.files import write_atomic

    write_atomic(Path(folder) / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    if said:
        log.info(f"batch=max: resume: {said} ({Path(folder) / TRIALS})")
    if not keep:  # a search started again: its trials start afresh
        (Path(folder) / TRIALS).unlink(missing_ok=True)


def _verdict(trial: Trial, guess: float | None) -> str:
    floor = trial.floor
    return ("fits" if trial.fits else "does not fit") + (f" ({trial.why})" if trial.why else "") \
        + (f" in {trial.seconds:.1f} s" if trial.seconds is not None else "") \
        + (f"; peak {human_bytes(trial.peak)}" if trial.peak else "") + (f"; plan {trial.plan}" if trial.plan else "") \
        + (f"; floor {human_bytes(floor.least)}, plan limit {human_bytes(floor.line)}" if floor is not None else "") \
        + (f"; the floors predict about {int(guess)}" if floor is not None and guess else "")


def _run_trial(try_batch, batch: int, search: Search, folder: Path | None, note: str = "") -> Trial:
    """One trial: said as it begins and ends, timed, added to the search and to the run folder's trial file."""
    stops.check()
    number = len(search.trials) + 1
    log.info(f"batch=max: trial {number}: batch {batch}" + (f" ({note})" if note else ""))
    began = time.perf_counter()
    trial = try_batch(batch)
    trial = replace(trial, seconds=round(time.perf_counter() - began, 3))
    search.trials.append(replace(trial, kept=None))
    if trial.floor is not None:
        search.floors[batch] = trial.floor
    if folder is not None:
        append_trial(folder, trial_record(number, trial, search.replicas))
    log.info(f"batch=max: trial {number}: batch {batch} {_verdict(trial, predicted(search))}")
    return trial


def largest_batch(try_batch, replicas: int, cap: int | None = None, budget: int | None = None, again=None,
                  folder: Path | None = None, earlier: list[Trial] = ()):
    """Run trials `try_batch(b) -> Trial` until the search ends; returns the largest batch that fits (None when
    not even `replicas` examples do) with what its trial kept, and the `Search`.
    `again(best: Trial) -> Trial`: the best trial (with what it kept) checked once more after the others (None: not
    checked); where it no longer fits the search continues below it.
    `folder`: each trial is appended to its `batch_max_trials.jsonl` as it ends. `earlier`: the trials a stopped
    search recorded there, taken as run (the engine of the best of them is built again by one more trial).
    The best trial's engine is held while later trials run (they then measure with its optimizer slots in
    memory, erring small) and trains: its plan is the one its dry steps measured (a plan made again at that
    batch after other trials may differ: the notebook ResNet's ran out of memory in its first step)."""
    search = Search(replicas, cap, budget)
    for trial in earlier:
        search.trials.append(trial)
        if trial.floor is not None:
            search.floors[trial.batch] = trial.floor
    batch = next_batch(search) if search.trials else round_to(min(START * replicas, cap or math.inf), replicas)
    kept, kept_batch = None, None
    while True:
        while batch is not None and len(search.trials) < MAX_TRIALS:
            trial = _run_trial(try_batch, batch, search, folder)
            if trial.fits:
                kept = None  # the smaller batch's engine is freed before the larger one is kept
                gc.collect()
                kept, kept_batch = trial.kept, batch
            del trial
            gc.collect()
            stops.check()  # a signal that landed in a finalizer as the trial's engine was freed
            batch = next_batch(search)
        best = search.best()
        if best is None:
            break
        if best.batch != kept_batch:  # it fitted in a stopped session: its engine is built again
            trial = _run_trial(try_batch, best.batch, search, folder, "recorded as fitting by the stopped search; "
                               "its engine is built again")
            if trial.fits:
                kept, kept_batch = trial.kept, trial.batch
            del trial
            gc.collect()
            stops.check()
            batch = next_batch(search) if kept_batch != best.batch else None
            continue
        if again is None or kept is None or best is search.trials[-1]:
            break  # nothing to check, or the best is the last trial: nothing ran after it
        began = time.perf_counter()
        checked = again(replace(best, kept=kept))
        if checked.fits:
            break
        why = f"{checked.why or 'it no longer fits'}, checked again after the later trials"
        failed = Trial(best.batch, False, checked.peak, why, seconds=round(time.perf_counter() - began, 3))
        search.trials.append(failed)
        if folder is not None:
            append_trial(folder, trial_record(len(search.trials), failed, replicas))
        log.info(f"batch=max: batch {best.batch} does not fit any more ({why}); searching below it")
        kept, kept_batch = None, None
        gc.collect()
        stops.check()
        batch = next_batch(search)
        if batch is None or len(search.trials) >= MAX_TRIALS:
            break
    best = search.best()
    return (best.batch if best else None, kept if best is not None and best.batch == kept_batch else None), search
