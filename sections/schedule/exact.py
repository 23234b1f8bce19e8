"""The exact optimum for small chains under the planner's cost model, by a search that shares nothing with it.

``exact_schedule`` is a uniform-cost search (A*, with the forward work every block not yet done still needs as
its bound) over the operations of one training step on a chain of ``n`` blocks. It exists to check the
planner (``planner.plan_schedule``, a dynamic program in memory slots), so it re-derives every cost from the
same inputs (per-block profiles, measured sections, calibration, gradient bytes, unit policies) on its own, and
counts memory in exact bytes.

State: ``g``, the border whose gradient is waiting (blocks ``g .. n-1`` are done; ``n`` at the start, where the
loss's gradient costs nothing); the set of borders ``1 .. g-1`` whose values are held; the tapes held, each a
section ``[a, b)`` run under a unit policy. Operations:

- ``forward(a, b)``: from a held border ``a`` (border 0, the batch, is always held) run blocks ``a .. b-1``,
  keeping border ``b < g``. Work: their forward seconds.
- ``tape(a, b, policy)``: the same run, keeping what ``policy`` keeps (``policy.cost(section)``'s kept bytes)
  until the section's backward. A tape holds both its borders until its backward (the engine's ``Store`` keeps
  its input and output); tapes do not overlap; ``b < g`` (a tape made when its own gradient is already waiting
  would be a re-run section, which ``leaf`` prices). Work: forward seconds, the policy's extra seconds and one
  section's overhead.
- ``free(i)``: drop a held border (not one a tape holds). No work.
- ``leaf(a)``: with border ``a`` held and no tape ending after ``a``, run section ``[a, g)`` again forward and
  backward; during it the section's activations (``section(a, g)``: measured as one run, or estimated from
  its blocks times ``calibration``) are added to what is held. Work: its forward seconds and one overhead.
- ``backward()``: the tape ending at ``g``, ``[a, g)``, runs its backward; during it the policy's backward
  bytes are added. No work beyond its tape's.

After a backward the gradient waits at ``a``; borders ``>= a`` are dropped (a border's value is not needed once
its gradient exists). Memory at every state, in bytes beside the base: held borders (border 0 is the batch, in
the base) + tapes' kept bytes + the waiting gradient (border ``g``'s size) + the gradients of blocks ``g ..
n-1``; during a backward, plus the section's activations (leaf) or the policy's backward bytes (tape). It must
stay within ``limit`` at every state and during every backward. The objective, as the planner's: the step's
forward seconds plus ``section_overhead`` per section (per leaf and per tape); ties go to the lower peak.

Against the planner's space (leaf; unit policy on a first section, then the rest; keep a border, solve the
right part, then the left part again), this is:

- wider: borders may be dropped at any time and re-created later from any held border, so a schedule need not
  nest (the planner holds a segment's input border until the segment is done); forwards may start from any
  held border; tapes may be made anywhere a forward runs, not only as the first section of a segment. Every
  schedule the planner can make is one path here, with the same peak.
- narrower: nothing the planner can express is missing. Both leave out the same things: a forward's own
  working memory (only what it keeps is counted), tapes dropped before their backward (never useful: a plain
  forward gives the same border for less), a tape for the last section (the loss section is always re-run
  fused with its backward), and schedules that run a block's backward twice.

The state space grows as ``2^n`` times the sets of disjoint tapes: a search takes milliseconds at 7 blocks and
about 10 s at 13 (one ``Store`` unit, on this project's CPU); meant for small chains.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

_INF = float("inf")


@dataclass(frozen=True)
class SectionCosts:
    """A run of blocks as one section, with the fields a policy's ``cost`` reads."""

    activation_bytes: int
    stored_bytes: int
    transient_bytes: int
    forward_seconds: float


@dataclass(frozen=True)
class ExactPlan:
    """The search's result. ``cost``: forward seconds plus the overheads; ``peak``: bytes beside the base;
    ``ops``: the operations in order, as ``(name, *arguments)``."""

    cost: float
    forward_seconds: float
    sections: int
    peak: int
    ops: tuple


class ChainCosts:
    """Every cost the search reads, from the same inputs as the planner (see ``plan_schedule``)."""

    def __init__(self, profiles, measured=None, grad_bytes=None, calibration: float = 1.0,
                 activation_scale: float = 1.0):
        self.profiles = list(profiles)
        self.n = n = len(self.profiles)
        self.measured = dict(measured or {})
        self.calibration, self.scale = calibration, activation_scale
        grads = [0] * n if grad_bytes is None else list(grad_bytes)
        if len(grads) != n:
            raise ValueError(f"grad_bytes has {len(grads)} entries; expected one per block ({n}).")
        # Border i is block i's input: border 0 is the batch (counted in the base), border n the loss.
        self.border = [0] + [p.output_bytes for p in self.profiles[:-1]] + [0]
        self.grads_after = [sum(grads[g:]) for g in range(n + 1)]

    def seconds(self, s: int, t: int) -> float:
        return sum(p.forward_seconds for p in self.profiles[s:t])

    def section(self, s: int, t: int) -> SectionCosts:
        blocks = self.profiles[s:t]
        entry = getattr(blocks[0], "entry_bytes", 0)  # the section's input border: its caller holds it
        active = self.measured.get((s, t))
        if active is None:  # while block j's backward runs, blocks s..j hold what they kept, j its transients
            kept = list(itertools.accumulate(p.kept_bytes for p in blocks))
            active = self.calibration * (max(k + p.transient_bytes for k, p in zip(kept, blocks)) - entry)
        stored = sum(p.stored_bytes for p in blocks) - entry
        return SectionCosts(int(self.scale * active), int(self.scale * stored),
                            int(self.scale * max(p.transient_bytes for p in blocks)), self.seconds(s, t))


def _search(costs: ChainCosts, limit: float, units, overhead: float, objective: str):
    """From the first state to ``g == 0``. ``objective``: "cost" (A* on labels ``(cost, peak)``, states over
    ``limit`` cut) or "peak" (Dijkstra on the largest bytes so far, a bottleneck: the least peak reachable)."""
    n, border, after = costs.n, costs.border, costs.grads_after
    units = list(units)
    section = {(s, t): costs.section(s, t) for s in range(n) for t in range(s + 1, n + 1)}
    unit_cost = {(s, t, u): units[u].cost(section[(s, t)]) for (s, t) in section for u in range(len(units))}

    def memory(g, held, tapes):
        return (sum(border[i] for i in held) + sum(unit_cost[tape].kept_bytes for tape in tapes) + border[g]
                + after[g])

    def moves(g, held, tapes):
        """(work, bytes during the move, next state, op) for every operation from a state."""
        here = memory(g, held, tapes)
        pinned = {i for a, b, _ in tapes for i in (a, b)}
        sources = [0, *sorted(held)]
        for i in held - pinned:
            yield 0.0, here - border[i], (g, held - {i}, tapes), ("free", i)
        for a in sources:
            for b in range(a + 1, g):
                if b not in held:
                    grown = held | {b}
                    yield costs.seconds(a, b), here + border[b], (g, grown, tapes), ("forward", a, b)
                if any(a < e and c < b for c, e, _ in tapes):
                    continue
                for u in range(len(units)):
                    pc = unit_cost[(a, b, u)]
                    extra = 0 if b in held else border[b]
                    yield (costs.seconds(a, b) + pc.extra_seconds + overhead, here + extra + pc.kept_bytes,
                           (g, held | {b}, tapes | {(a, b, u)}), ("tape", a, b, units[u].name))
        ending = [tape for tape in tapes if tape[1] == g]
        if ending:
            a, _, u = tape = ending[0]
            rest = tapes - {tape}
            state = (a, frozenset(i for i in held if i < a), rest)
            yield 0.0, max(here + unit_cost[tape].backward_bytes, memory(*state)), state, ("backward", a, g)
            return
        for a in sources:
            if any(e > a for _, e, _ in tapes):
                continue
            state = (a, frozenset(i for i in held if i < a), tapes)
            yield (costs.seconds(a, g) + overhead, max(here + section[(a, g)].activation_bytes, memory(*state)),
                   state, ("leaf", a, g))

    def remaining(g, tapes):
        """A lower bound on the work left (A*): every block before ``g`` not under a tape runs at least once more."""
        return costs.seconds(0, g) - sum(costs.seconds(a, b) for a, b, _ in tapes)

    done: set = set()
    start = (n, frozenset(), frozenset())
    first = memory(*start)
    if objective == "cost" and first > limit:
        return None
    label = {start: (0.0, first) if objective == "cost" else (first, 0.0)}
    parent: dict = {start: None}
    queue, tick = [(label[start], 0, start)], itertools.count(1)
    while queue:
        _, _, state = heapq.heappop(queue)
        key = label[state]
        if state[0] == 0:
            ops, s = [], state
            while parent[s] is not None:
                s, op = parent[s]
                ops.append(op)
            return key, tuple(reversed(ops))
        if state in done:
            continue
        done.add(state)
        for work, during, nxt, op in moves(*state):
            if objective == "cost":
                if during > limit:
                    continue
                new = (key[0] + work, max(key[1], during))
            else:
                new = (max(key[0], during), key[1] + work)
            old = label.get(nxt)
            if old is None or (new < old if objective == "cost" else new[0] < old[0]):
                label[nxt], parent[nxt] = new, (state, op)
                if objective == "cost":
                    priority = (new[0] + remaining(nxt[0], nxt[2]), new[1])
                else:
                    priority = new
                heapq.heappush(queue, (priority, next(tick), nxt))
    return None


def _overhead(costs: ChainCosts, section_overhead):
    return 0.01 * costs.seconds(0, costs.n) / max(1, costs.n) if section_overhead is None else section_overhead


def exact_schedule(profiles, limit: float, units=None, measured=None, grad_bytes=None, calibration: float = 1.0,
                   activation_scale: float = 1.0, section_overhead: float | None = None) -> ExactPlan | None:
    """The schedule with the least forward work (plus ``section_overhead`` per section, default as the
    planner's) whose peak beside the base stays within ``limit`` bytes; ``None`` when none does. The other
    arguments are ``plan_schedule``'s (``units`` default: ``Store()``)."""
    from .policies import Store

    costs = ChainCosts(profiles, measured, grad_bytes, calibration, activation_scale)
    overhead = _overhead(costs, section_overhead)
    found = _search(costs, limit, (Store(),) if units is None else units, overhead, "cost")
    if found is None:
        return None
    (cost, peak), ops = found
    sections = sum(op[0] in ("leaf", "tape") for op in ops)
    return ExactPlan(cost, cost - overhead * sections, sections, int(peak), ops)


def least_peak(profiles, units=None, measured=None, grad_bytes=None, calibration: float = 1.0,
               activation_scale: float = 1.0) -> int:
    """The least peak beside the base any schedule of the search reaches (bytes)."""
    from .policies import Store

    costs = ChainCosts(profiles, measured, grad_bytes, calibration, activation_scale)
    found = _search(costs, _INF, (Store(),) if units is None else units, 0.0, "peak")
    return int(found[0][0])
