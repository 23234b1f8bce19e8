"""Which plan to dry-run next, which one runs, and when to refuse: plain Python over recorded measurements.

The cost model counts each block's bytes from its trace (exact shapes at the real batch); what it cannot see
(the allocator's chunks and rounding, what the process holds beside the step) is fitted from measurements as bytes
over the count: each dry step (and a training step over its prediction) gives a point ``(modelled, measured)`` in
bytes beyond the base (variables, optimizer slots, the batch), and ``fit`` takes the most cautious excess they
show near a plan's count. The least-memory plan's dry step comes
first (a refusal rests on it); then the fastest plan the corrected count puts under the budget with a margin (after
one ran out, at most halfway to the least-memory plan), chosen for a room on a ladder the counts alone fix
(``rung``), reached without what the device held beside the model (an input pipeline's buffers, which differ by
process) and stepped down only where the plan's own count is over the room; a plan runs when its dry step, plus
what its repeated runs differed by, is within the budget. At most ``DRY_STEPS`` dry steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

DRY_STEPS = 3
# A plan is tried when its prediction is this far below the budget: a dry step that runs out of memory costs the
# allocator's retries (10 s per failing request on TensorFlow's BFC allocator; a minute or more a step).
MARGIN = 0.10
# Figures below this say more about the allocator's rounding than about the model (oneDNN's CPU allocator counts
# nothing under 256 KiB; a small net's block read 3x its count at batch 16 and less at 64): not fitted.
RESOLUTION = 2**20
# The rooms a plan is chosen for: the least-memory plan's count times RUNG**k. The measured correction moves by
# process (the same plan read 200.6-219.0 MiB in three processes: the allocator's heap differs by its history), and
# the fastest plan within a room that moves with it differs too (ResNet: three processes, three partitions); a room
# from this ladder changes only where the correction crosses a rung. A wider rung is steadier and gives up more room
# (1/RUNG at most; time against room is flat here: 4 and 8 sections within 2-7% at 0.5 of whole's peak).
RUNG = 2**0.5


@dataclass(frozen=True)
class Point:
    """One measurement: the model's bytes beyond the base and what was measured beyond it; ``ran_out``: the device
    had no memory for it (``measured`` is then a lower bound)."""

    modelled: int
    measured: int
    ran_out: bool = False


@dataclass(frozen=True)
class Fit:
    """``measured ~ modelled + excess(modelled)`` (bytes beyond the base), from measured points ``knots``
    (``(modelled, excess)``, ascending): a plan's excess is its nearest point's, the larger of the two around it
    between points, the last one's past the last. No points: the count itself."""

    knots: tuple = ()
    kind: str = "the model alone"

    def excess(self, modelled: int) -> int:
        if not self.knots:
            return 0
        below = [e for m, e in self.knots if m <= modelled]
        above = [e for m, e in self.knots if m >= modelled]
        return max(([below[-1]] if below else []) + ([above[0]] if above else []))

    def predict(self, modelled: int) -> int:
        return int(modelled + self.excess(modelled))

    def room(self, bytes_: float) -> int:
        """The most bytes a plan may model for every prediction up to it to stay within ``bytes_``."""
        if bytes_ <= 0:
            return 0
        edges = [0, *(m for m, _ in self.knots), math.inf]
        room = 0
        for lo, hi in zip(edges, edges[1:]):  # between two points the excess is one number
            reach = bytes_ - self.excess((lo + hi) / 2 if math.isfinite(hi) else lo + 1)
            if reach < hi:
                return int(max(room, reach))
            room = hi
        return int(room)

    def describe(self) -> str:
        from ..rules import human_bytes

        if not self.knots:
            return f"{self.kind}: measured = counted"
        return f"{self.kind}: measured = " + ", ".join(
            f"counted {'+' if e >= 0 else '-'} {human_bytes(abs(e))} at {human_bytes(m)}" for m, e in self.knots)


def fit(points: Sequence[Point]) -> Fit:
    """Of points of at least ``RESOLUTION`` bytes, each plan's excess of measured over counted bytes (an
    out-of-memory point's lower bound included; the largest where one plan was measured more than once), read by
    ``Fit`` from the points nearest a plan's count. An excess in bytes, not a ratio: what the count cannot see is
    mostly fixed by the model, not by the plan (the allocator's chunks around the largest tensors, what the process
    holds beside the step, work buffers of the largest kernels), and a ratio taken on the least-memory plan
    scaled it with the plan: chosen plans came 15-20% over their dry steps on ResNet and EfficientNetB0 (3 of 7
    zoo plannings over 10%); in bytes, 7 of 7 within 10% in one run each (conv nets and transformers), 14 of 16
    over repeated processes (the same plan reads up to 20% apart by process). The excess is not one
    number either: the least-memory plan (many small sections) read 1.48x its count on GPT-2 and a 2-section plan
    0.81x, so past the largest point its own excess holds. A line through two points was tried and failed (two
    points 5% apart in count drew ``2.73 x counted - 344 MiB`` on MobileNetV2, which put the next plan 17% off)."""
    usable = [p for p in points if p.modelled >= RESOLUTION and p.measured >= RESOLUTION]
    if not usable:
        return Fit()
    excess: dict = {}
    for p in usable:
        excess[p.modelled] = max(excess.get(p.modelled, -math.inf), p.measured - p.modelled)
    kind = "one measurement" if len(usable) == 1 else f"{len(excess)} measured plans"
    return Fit(tuple(sorted(excess.items())), kind)


@dataclass(frozen=True)
class Candidate:
    """A plan the pure planner made: a key naming its schedule, its modelled bytes beyond the base, and its
    forward work (re-runs included: less is faster)."""

    key: object
    modelled: int
    work: float


@dataclass(frozen=True)
class DryStep:
    """A candidate's dry step: the peak measured (absolute bytes), what its repeated runs differed by, whether it
    ran out of memory, and the fit's prediction before it ran."""

    candidate: Candidate
    peak: int
    spread: int
    ran_out: bool
    predicted: int


@dataclass
class Search:
    """The search's record: the budget, the base, the block measurements and the dry steps so far."""

    budget: int
    base: int
    blocks: list = field(default_factory=list)  # Points from measured blocks
    steps: list = field(default_factory=list)   # DryStep records
    max_steps: int = DRY_STEPS
    resident: int = 0  # of ``base``, what the device held beside the model (an input pipeline's buffers): read

    def points(self) -> list[Point]:
        return [*self.blocks, *(Point(s.candidate.modelled, s.peak - self.base, s.ran_out) for s in self.steps)]

    def fit(self) -> Fit:
        return fit(self.points())

    def margin(self) -> float:
        return MARGIN

    def line(self, spread: int = 0) -> float:
        """The most a candidate's prediction (absolute bytes) may reach to be tried."""
        return (1.0 - self.margin()) * self.budget - spread

    def predict(self, candidate: Candidate) -> int:
        return self.base + self.fit().predict(candidate.modelled)

    def fits(self, step: DryStep, spread: bool = True) -> bool:
        """Measured within the budget with what its runs varied by (``spread=False``: without it)."""
        return not step.ran_out and step.peak + (step.spread if spread else 0) <= self.budget

    def tried(self, candidate: Candidate | None) -> bool:
        return candidate is not None and any(s.candidate.key == candidate.key for s in self.steps)

    def best(self) -> DryStep | None:
        """Of the dry steps that fit, the least work (then the smaller peak): the plan that runs."""
        fitting = [s for s in self.steps if self.fits(s)]
        return min(fitting, key=lambda s: (s.candidate.work, s.peak)) if fitting else None


@dataclass(frozen=True)
class Try:
    candidate: Candidate
    why: str


@dataclass(frozen=True)
class Run:
    step: DryStep


@dataclass(frozen=True)
class Refuse:
    step: DryStep | None  # the least-memory plan's dry step (None: nothing could be dry-run)


def rung(room: float, floor: int) -> int:
    """The largest room on the ladder ``floor * RUNG**k`` (k >= 0) that is not above ``room``; ``room`` itself where
    it is below ``floor`` or ``floor`` is nothing."""
    if floor <= 0 or room < floor:
        return int(room)
    return int(floor * RUNG**_rungs(room, floor))


def _rungs(room: float, floor: int) -> int:
    """How many rungs above ``floor`` the room reaches (``room >= floor > 0``)."""
    return math.floor(math.log(room / floor, RUNG) + 1e-9)


def decide(search: Search, plan_within: Callable[[int], Candidate | None], least: Callable[[], Candidate],
           spread: int = 0) -> Try | Run | Refuse:
    """The next move: ``plan_within(bytes)``: the planner's fastest candidate whose modelled bytes stay within that
    many (None where none does); ``least()``: its least-memory candidate. ``spread``: what repeated measurements
    varied by so far.

    The least-memory plan is measured first: it is the plan most likely to fit, a refusal must rest on it anyway,
    and what the count cannot see (the allocator's whole chunks, kernels' buffers: 10-57% over the count on the
    first plans of four models, and the same plan 302-407 MiB in different processes) is measured where running
    out is least likely. Where it does not fit, nothing does. Where it fits, the fastest plan the corrected count
    puts within the budget's line is tried next, the room snapped down to the ladder (``rung``): the correction
    differs by process, the ladder does not; after a plan runs out, one at most halfway from the least-memory plan
    to it. Of the plans that fit, the fastest runs; the least-memory plan runs where it measured within the budget
    even if its spread would put it over (``Run`` of its step: the caller can tell by ``search.fits``)."""
    floor = least()
    if not search.tried(floor):
        return Try(floor, "the least-memory plan first: measured where it is most likely to fit")
    best = search.best()
    if best is None:
        # A refusal rests on the least-memory plan not fitting: measured within the budget, it runs though what
        # its runs varied by would put it over (the spread keeps the search from choosing plans near the budget;
        # it is no reason to refuse the only plan left). Whole-graph `batch=max` trials ask the same of a step.
        last = _least_step(search, least)
        if last is not None and search.fits(last, spread=False):
            return Run(last)
        return Refuse(last)
    if len(search.steps) >= search.max_steps:
        return Run(best)
    room = search.fit().room(search.line(spread) - search.base)
    steady = room + search.resident
    ran_out = [s.candidate.modelled for s in search.steps if s.ran_out]
    if ran_out:
        # A plan that ran out measured a lower bound only: the line through it need not rule out plans nearly as
        # large. The next one lies at most halfway from the least-memory plan to the smallest that ran out.
        cap = floor.modelled + (min(ran_out) - floor.modelled) // 2
        room, steady = min(room, cap), min(steady, cap)
    target = _on_the_ladder(room, steady, floor.modelled, plan_within)
    if target is not None and not search.tried(target) and target.work < best.candidate.work:
        why = ("the fastest plan the measured correction puts within the budget" if not ran_out else
               "a plan at most halfway from the least-memory plan to the one that ran out")
        return Try(target, why)
    return Run(best)


def _on_the_ladder(room: int, steady: int, floor: int, plan_within: Callable[[int], Candidate | None]):
    """The fastest plan for the highest rung within ``steady`` (the room without what the device held beside the
    model, which differs by process: the notebook ResNet's input pipeline held one batch more in one process of
    three, and the rung it reached moved with it), stepping down while that plan's count is over ``room``. A process
    with less room then runs a slower plan only where the faster plan's own count, not the rung, is what no
    longer fits."""
    if floor <= 0 or steady < floor:
        return plan_within(room)
    for reach in (int(floor * RUNG**k) for k in range(_rungs(steady, floor), -1, -1)):
        target = plan_within(reach)
        if target is not None and target.modelled <= room:
            return target
    return plan_within(room)


def _least_step(search: Search, least: Callable[[], Candidate]) -> DryStep | None:
    floor = least()
    mine = [s for s in search.steps if s.candidate.key == floor.key]
    if mine:
        return mine[-1]
    return min(search.steps, key=lambda s: s.peak) if search.steps else None
