"""The planner: a pure function from per-block costs and a memory budget to a frozen schedule.

It follows Rotor's recursion for heterogeneous chains (Beaumont et al. 2019): a segment ``[s, t)`` of blocks,
whose input border is held and whose output gradient is waiting, is trained either as one section re-run in
its backward (a leaf), or by running a first section under a unit policy (``store``: keep its tape) and
solving ``[q, t)``, or by running ``s .. q-1`` forward, keeping border ``q``, solving ``[q, t)`` and then
``[s, q)`` again from border ``s`` (which re-runs ``s .. q-1``: multi-level recompute). Memory is counted in
``resolution`` slots of the budget (sizes rounded up, so a plan never exceeds its own prediction); the
objective is the step's forward work (measured seconds) plus a small cost per section (each is one more
compiled call).

Peak model: the base (variables, optimizer slots, the batch), the borders and tapes held by outer levels,
and during a section's backward its activations (the largest, over its blocks j, of what blocks up to j keep
plus block j's transient buffers; from the probe) with the gradient arriving at its output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..rules import human_bytes
from .policies import Recompute, Recreate, Store
from .program import Schedule

_INF = float("inf")


@dataclass(frozen=True)
class SectionProfile:
    """Costs of consecutive blocks run as one section (what policies' ``cost`` reads)."""

    activation_bytes: int
    stored_bytes: int
    transient_bytes: int
    forward_seconds: float


@dataclass(frozen=True)
class Plan:
    schedule: Schedule
    predicted_peak: int
    rerun_seconds: float
    budget: int
    base_bytes: int
    forward_runs: tuple

    @property
    def starts(self) -> list:
        return list(self.schedule.starts)

    @property
    def policies(self) -> list:
        return [p.name for p in self.schedule.policies]

    def summary(self) -> str:
        return (f"plan: {len(self.starts) + 1} section(s), policies {self.policies}, forward runs "
                f"{list(self.forward_runs)}, predicted peak {human_bytes(self.predicted_peak)} (budget "
                f"{human_bytes(self.budget)}), predicted re-run time {self.rerun_seconds:.3f} s/step")


class _Chain:
    """Prefix sums over blocks, so any run of blocks gets its costs in O(1)."""

    def __init__(self, profiles, input_bytes: int):
        self.n = len(profiles)
        self.border = [input_bytes] + [p.output_bytes for p in profiles]   # border i enters block i
        self.border[-1] = 0  # the loss: no gradient waits at the end of the chain
        self._kept = np.cumsum([0] + [p.kept_bytes for p in profiles])
        self._stored = np.cumsum([0] + [p.stored_bytes for p in profiles])
        self._fwd = np.cumsum([0.0] + [p.forward_seconds for p in profiles])
        self._transient = [p.transient_bytes for p in profiles]
        self._memo: dict = {}  # (s, t) -> (backward peak, largest transient): the solver asks O(n^3) times

    def section(self, s: int, t: int, scale: float = 1.0) -> SectionProfile:
        # A section's backward goes from its last block to its first: while block j's backward runs, blocks
        # s..j still hold what they kept (later blocks' are freed) and block j needs its transient buffers.
        if (s, t) not in self._memo:
            self._memo[(s, t)] = (max(self._kept[j + 1] - self._kept[s] + self._transient[j] for j in range(s, t)),
                                  max(self._transient[s:t]))
        active, transient = self._memo[(s, t)]
        return SectionProfile(int(scale * active), int(scale * (self._stored[t] - self._stored[s])),
                              int(scale * transient), float(self._fwd[t] - self._fwd[s]))

    def seconds(self, s: int, t: int) -> float:
        return float(self._fwd[t] - self._fwd[s])


class _Solver:
    def __init__(self, chain: _Chain, limit: float, units: list, scale: float, resolution: int, overhead: float):
        self.c, self.units, self.scale, self.overhead = chain, units, scale, overhead
        self.R = resolution
        self.slot = max(limit, 1.0) / resolution
        self.feasible = limit > 0
        self.f: dict = {}

    def up(self, b) -> int:
        return int(math.ceil(b / self.slot - 1e-9))

    def down(self, b) -> int:
        return int(math.floor(b / self.slot + 1e-9))

    def shifted(self, arr, need: int):
        """``out[m] = arr[m - need]`` (``inf`` below zero, ``arr[R]`` above R)."""
        idx = np.arange(self.R + 1) - need
        out = np.full(self.R + 1, _INF)
        ok = idx >= 0
        out[ok] = arr[np.minimum(idx[ok], self.R)]
        return out

    def options(self, s: int, t: int):
        """Every way to train segment [s, t): (kind, q, policy, cost over memory slots)."""
        c, m = self.c, np.arange(self.R + 1)
        leaf = self.up(c.section(s, t, self.scale).activation_bytes)
        yield "leaf", t, None, np.where(m >= leaf, c.seconds(s, t) + self.overhead, _INF)
        for q in range(s + 1, t):
            grad_q, grad_t = c.border[q], c.border[t]
            for policy in self.units:
                pc = policy.cost(c.section(s, q, self.scale))
                rest = self.shifted(self.f[(q, t)], self.up(pc.kept_bytes + c.border[q]))
                back = self.up(pc.kept_bytes + pc.backward_bytes + grad_q) - self.down(grad_t)
                cost = c.seconds(s, q) + pc.extra_seconds + self.overhead + rest
                yield "unit", q, policy, np.where(m >= back, cost, _INF)
            right = self.shifted(self.f[(q, t)], self.up(c.border[q]))
            left = self.shifted(self.f[(s, q)], self.up(grad_q) - self.down(grad_t))
            yield "split", q, None, c.seconds(s, q) + right + left

    def solve(self) -> float:
        for length in range(1, self.c.n + 1):
            for s in range(0, self.c.n - length + 1):
                t = s + length
                self.f[(s, t)] = np.min(np.stack([cost for *_, cost in self.options(s, t)]), axis=0)
        return float(self.f[(0, self.c.n)][self.R]) if self.feasible else _INF

    def tree(self, s: int, t: int, m: int, held: float, out: list, peaks: list):
        """Follow the cheapest choices from segment [s, t) with m free slots; record (s, t, kind, q, policy)."""
        best = min(self.options(s, t), key=lambda o: o[3][m])
        kind, q, policy, _ = best
        out.append((s, t, kind, q, policy))
        c = self.c
        if kind == "leaf":
            peaks.append(held + c.section(s, t, self.scale).activation_bytes)
        elif kind == "unit":
            pc = policy.cost(c.section(s, q, self.scale))
            self.tree(q, t, m - self.up(pc.kept_bytes + c.border[q]), held + pc.kept_bytes + c.border[q], out, peaks)
            peaks.append(held - c.border[t] + c.border[q] + pc.kept_bytes + pc.backward_bytes)
        else:
            self.tree(q, t, m - self.up(c.border[q]), held + c.border[q], out, peaks)
            self.tree(s, q, min(self.R, m - self.up(c.border[q]) + self.down(c.border[t])),
                      held - c.border[t] + c.border[q], out, peaks)


def _to_schedule(choices: list, n: int) -> Schedule:
    """Block-level choices -> sections (between every boundary any choice uses) and section-level actions."""
    cuts = sorted({q for s, t, kind, q, _ in choices if kind != "leaf"} | {s for s, *_ in choices} - {0})
    index = {b: i for i, b in enumerate([0, *cuts])}
    index[n] = len(cuts) + 1
    actions, stored = {}, set()
    for s, t, kind, q, policy in choices:
        if kind == "unit":
            actions[(index[s], index[t])] = ("policy", index[q])
            stored.add(index[s])
        elif kind == "split":
            actions[(index[s], index[t])] = ("keep", index[q])
    k_total = len(cuts) + 1
    top, p = {0}, 0
    while (p, k_total) in actions:
        p = actions[(p, k_total)][1]
        top.add(p)
    units = {index[s]: policy for s, t, kind, q, policy in choices if kind == "unit"}
    policies = tuple(units[k] if k in stored else (Recompute() if k in top else Recreate())
                     for k in range(k_total))
    return Schedule(tuple(cuts), policies, actions)


def plan_schedule(profiles, input_bytes: int, budget: int, base_bytes: int = 0, margin: float = 0.1,
                  units=(Store(),), activation_scale: float = 1.0, resolution: int = 300,
                  section_overhead: float | None = None) -> Plan:
    """The schedule with the least predicted forward work whose predicted peak fits ``(1 - margin) * budget``.

    ``profiles``: per-block costs (``_profile.BlockProfile``: output, kept, transient, stored bytes and forward
    seconds, at the real batch). ``units``: policies a section may take besides re-running (each weighed by
    its ``cost``). ``activation_scale`` corrects measured activation bytes (the engine's re-plan). The margin
    covers the model's error. Raises ValueError naming the smallest reachable peak when nothing fits.
    """
    from .program import count_forward_runs

    chain = _Chain(profiles, input_bytes)
    total = chain.seconds(0, chain.n)
    overhead = 0.01 * total / max(1, chain.n) if section_overhead is None else section_overhead
    units = list(units)

    def solver(limit):
        sol = _Solver(chain, limit, units, activation_scale, resolution, overhead)
        return sol, sol.solve()

    limit = (1.0 - margin) * budget - base_bytes
    sol, cost = solver(limit)
    if cost == _INF:
        smallest = _smallest_peak(solver, base_bytes, margin)
        raise ValueError(
            f"memory_budget={human_bytes(budget)} ({budget} bytes): no partition fits; the smallest predicted "
            f"peak reachable is {human_bytes(smallest)} ({smallest} bytes), and plans keep a {margin:.0%} "
            f"safety margin below the budget: the smallest budget that fits is about "
            f"{human_bytes(math.ceil(smallest / (1 - margin) / 2**20) * 2**20)}.")
    choices, peaks = [], []
    sol.tree(0, chain.n, sol.R, float(base_bytes), choices, peaks)
    schedule = _to_schedule(choices, chain.n)
    return Plan(schedule, int(max(peaks)), cost - total - overhead * schedule.num_sections, budget, base_bytes,
                tuple(count_forward_runs(schedule)))


def _smallest_peak(solver, base_bytes: int, margin: float) -> int:
    """Bisect on the budget for the smallest predicted peak any schedule reaches."""
    hi = 1.0
    while solver(hi)[1] == _INF:
        hi *= 2
    lo = hi / 2 if hi > 1 else 0.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if solver(mid)[1] < _INF else (mid, hi)
    return int(hi + base_bytes)
