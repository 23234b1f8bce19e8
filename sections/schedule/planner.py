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
    leaves: tuple = ()  # (start, stop) block spans run as re-run sections (each counted from its own trace)
    margin: float = 0.1
    measured_sections: int = 0  # sections of this plan whose activations were measured as one run
    extra_bytes: int = 0  # a dry step's measured peak minus the model's (may be < 0)
    apply_peak: int = 0  # the optimizer update's predicted peak (every gradient at once), which a dry step skips
    leaf_held: tuple = ()  # per span of ``leaves``: the bytes held beside its activations while it runs backward

    @property
    def starts(self) -> list:
        return list(self.schedule.starts)

    @property
    def policies(self) -> list:
        return [p.name for p in self.schedule.policies]

    def summary(self) -> str:
        return (f"plan: {len(self.starts) + 1} section(s), policies {self.policies}, forward runs "
                f"{list(self.forward_runs)}, predicted peak {human_bytes(self.predicted_peak)} (budget "
                f"{human_bytes(self.budget)}, margin {self.margin:.0%}; {self.measured_sections} of "
                f"{len(self.leaves)} re-run sections counted as one run"
                + (f"; {human_bytes(self.extra_bytes)} a dry step held beyond the model" if self.extra_bytes > 0
                   else f"; a dry step held {human_bytes(-self.extra_bytes)} less than the model" if self.extra_bytes
                   else "")
                + f"), predicted re-run time "
                f"{self.rerun_seconds:.3f} s/step")


class _Chain:
    """Prefix sums over blocks, so any run of blocks gets its costs in O(1).

    ``measured``: activation bytes of whole sections ``{(s, t): bytes}`` counted from the section's own trace
    (``Calibrator.count_span``); a section not in it is estimated from its blocks' figures times
    ``calibration``. ``grads``: each block's gradient bytes; the gradients of blocks after a segment are held
    while it is trained.
    """

    def __init__(self, profiles, input_bytes: int, measured=None, grads=None, calibration: float = 1.0,
                 update=None):
        self.n = len(profiles)
        # ``update``: (each block's gradient bytes, the update's temporaries) where each section's update runs at
        # the end of its backward: its gradients and its input's gradient, then the update's temporaries beside
        # them (ResNet50V2's last section: 57 MiB of gradients).
        blocks, self._update = (None, 0) if update is None else update
        self._own_grads = np.cumsum([0] + list(blocks or [0] * self.n))
        self.border = [input_bytes] + [p.output_bytes for p in profiles]   # border i enters block i
        self.border[-1] = 0  # the loss: no gradient waits at the end of the chain
        self._kept = np.cumsum([0] + [p.kept_bytes for p in profiles])
        self._stored = np.cumsum([0] + [p.stored_bytes for p in profiles])
        self._fwd = np.cumsum([0.0] + [p.forward_seconds for p in profiles])
        self._transient = [p.transient_bytes for p in profiles]
        self._entry = [getattr(p, "entry_bytes", 0) for p in profiles]  # held by the caller at a section's start
        grads = [0] * self.n if grads is None else list(grads)
        self.grads_after = [int(sum(grads[t:])) for t in range(self.n + 1)]
        self.measured = dict(measured or {})
        self.calibration = calibration
        self._memo: dict = {}  # (s, t) -> (backward peak, largest transient): the solver asks O(n^3) times

    def estimate(self, s: int, t: int) -> int:
        """A section's activations from its blocks' figures (before calibration)."""
        most = max(self._kept[j + 1] - self._kept[s] + self._transient[j] for j in range(s, t))
        return int(most - self._entry[s])

    def section(self, s: int, t: int, scale: float = 1.0) -> SectionProfile:
        # A section's backward goes from its last block to its first: while block j's backward runs, blocks
        # s..j still hold what they kept (later blocks' are freed) and block j needs its transient buffers.
        if (s, t) not in self._memo:
            active = self.measured.get((s, t))
            if active is None:
                active = self.calibration * self.estimate(s, t)
            self._memo[(s, t)] = (max(active, self.at_update(s, t)), max(self._transient[s:t]))
        active, transient = self._memo[(s, t)]
        return SectionProfile(int(scale * active), int(scale * (self._stored[t] - self._stored[s] - self._entry[s])),
                              int(scale * transient), float(self._fwd[t] - self._fwd[s]))

    def at_update(self, s: int, t: int) -> int:
        """What a section holds while its update runs in the backward (0 where the update runs at the end)."""
        if not self._update:
            return 0
        return int(self._own_grads[t] - self._own_grads[s] + (self.border[s] if s else 0) + self._update)

    def seconds(self, s: int, t: int) -> float:
        return float(self._fwd[t] - self._fwd[s])


class _Solver:
    def __init__(self, chain: _Chain, limit: float, units: list, scale: float, resolution: int, overhead: float):
        self.c, self.units, self.scale, self.overhead = chain, units, scale, overhead
        self.R = resolution
        self.slot = max(limit, 1.0) / resolution
        self.feasible = limit > 0
        self.f: dict = {}
        self._right: dict = {}  # (q, t) -> f[(q, t)] shifted by the border at q

    def up(self, b) -> int:
        return int(math.ceil(b / self.slot - 1e-9))

    def down(self, b) -> int:
        return int(math.floor(b / self.slot + 1e-9))

    def shifted(self, arr, need: int):
        """``out[m] = arr[m - need]`` (``inf`` below zero, ``arr[R]`` above R). Slices, not an index array: the
        solver asks this O(n^3) times (MobileNetV2's 64 blocks: half a million calls a solve)."""
        size = self.R + 1
        out = np.empty(size)
        if need >= 0:
            need = min(need, size)
            out[:need] = _INF
            out[need:] = arr[:size - need]
        else:
            k = min(-need, size - 1)
            out[:size - k] = arr[k:]
            out[size - k:] = arr[self.R]
        return out

    def options(self, s: int, t: int):
        """Every way to train segment [s, t): (kind, q, policy, cost over memory slots)."""
        c = self.c
        leaf = np.full(self.R + 1, c.seconds(s, t) + self.overhead)
        leaf[:max(self.up(c.section(s, t, self.scale).activation_bytes + c.grads_after[t]), 0)] = _INF
        yield "leaf", t, None, leaf
        for q in range(s + 1, t):
            grad_q, grad_t = c.border[q], c.border[t]
            for policy in self.units:
                pc = policy.cost(c.section(s, q, self.scale))
                rest = self.shifted(self.f[(q, t)], self.up(pc.kept_bytes + c.border[q]))
                back = self.up(pc.kept_bytes + pc.backward_bytes + grad_q + c.grads_after[q]) - self.down(grad_t)
                cost = c.seconds(s, q) + pc.extra_seconds + self.overhead + rest  # a new array: written in place
                cost[:max(back, 0)] = _INF
                yield "unit", q, policy, cost
            if (q, t) not in self._right:  # the same for every s
                self._right[(q, t)] = self.shifted(self.f[(q, t)], self.up(c.border[q]))
            left = self.shifted(self.f[(s, q)], self.up(grad_q) - self.down(grad_t))
            yield "split", q, None, c.seconds(s, q) + self._right[(q, t)] + left

    def solve(self) -> float:
        for length in range(1, self.c.n + 1):
            for s in range(0, self.c.n - length + 1):
                t = s + length
                self.f[(s, t)] = np.min(np.stack([cost for *_, cost in self.options(s, t)]), axis=0)
        return float(self.f[(0, self.c.n)][self.R]) if self.feasible else _INF

    def tree(self, s: int, t: int, m: int, held: float, out: list, peaks: list, beside: dict):
        """Follow the cheapest choices from segment [s, t) with m free slots; record (s, t, kind, q, policy), the
        peaks, and what each leaf has beside its activations (``beside``)."""
        best = min(self.options(s, t), key=lambda o: o[3][m])
        kind, q, policy, _ = best
        out.append((s, t, kind, q, policy))
        c = self.c
        if kind == "leaf":
            beside[(s, t)] = held + c.grads_after[t]
            peaks.append(beside[(s, t)] + c.section(s, t, self.scale).activation_bytes)
        elif kind == "unit":
            pc = policy.cost(c.section(s, q, self.scale))
            self.tree(q, t, m - self.up(pc.kept_bytes + c.border[q]), held + pc.kept_bytes + c.border[q], out, peaks,
                      beside)
            peaks.append(held - c.border[t] + c.border[q] + pc.kept_bytes + pc.backward_bytes + c.grads_after[q])
        else:
            self.tree(q, t, m - self.up(c.border[q]), held + c.border[q], out, peaks, beside)
            self.tree(s, q, min(self.R, m - self.up(c.border[q]) + self.down(c.border[t])),
                      held - c.border[t] + c.border[q], out, peaks, beside)


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


DOES_NOT_FIT = 2**50  # what a measurement reads for a section the device had no memory to run: more than any budget


class NoPlanFits(ValueError):
    """No schedule's predicted peak fits the budget. ``smallest``: the smallest predicted peak reachable (or
    measured); ``plan``: the schedule that reaches it; ``advised``: the smallest budget that fits it (margin and
    spread); ``lower_bound``: ``smallest`` is only a lower bound (the plan's dry step ran out of memory)."""

    def __init__(self, message: str, smallest: int, plan: "Plan", advised: int, lower_bound: bool = False):
        super().__init__(message)
        self.smallest, self.plan, self.advised, self.lower_bound = smallest, plan, advised, lower_bound


def plan_schedule(profiles, input_bytes: int, budget: int, base_bytes: int = 0, margin: float = 0.1,
                  units=(Store(),), activation_scale: float = 1.0, resolution: int = 300,
                  section_overhead: float | None = None, measured=None, grad_bytes=None,
                  calibration: float = 1.0, apply_bytes: int = 0, spread: int = 0, extra_bytes: int = 0,
                  update=None) -> Plan:
    """The schedule with the least predicted forward work whose predicted peak fits ``(1 - margin) * budget``.

    ``profiles``: per-block costs (``backend.profile.BlockProfile``: output, kept, transient, stored bytes and forward
    seconds, at the real batch). ``units``: policies a section may take besides re-running (each weighed by
    its ``cost``). ``activation_scale`` corrects measured activation bytes (the engine's re-plan). The margin
    covers the model's error. ``measured``, ``grad_bytes``, ``calibration``: as for ``_Chain``. ``apply_bytes``:
    what the optimizer's update needs beside the base and all gradients; ``update``: where each section's update
    runs in its backward, each block's gradient bytes and the update's temporaries (``_Chain``). ``spread``: bytes by which repeated
    measured peaks differed: a plan's prediction plus this fits the margin (the advised budget's too). ``extra_bytes``: memory a measured step held beyond this model
    (the engine's dry steps), added to the base. Raises ``NoPlanFits`` (a
    ValueError) naming the smallest reachable peak and the smallest budget that fits.
    """
    from .program import count_forward_runs

    chain = _Chain(profiles, input_bytes, measured, grad_bytes, calibration, update)
    base_bytes += extra_bytes
    total = chain.seconds(0, chain.n)
    overhead = 0.01 * total / max(1, chain.n) if section_overhead is None else section_overhead
    units = list(units)
    apply_peak = base_bytes + chain.grads_after[0] + apply_bytes  # the optimizer step: every gradient at once

    def solver(limit):
        sol = _Solver(chain, limit, units, activation_scale, resolution, overhead)
        return sol, sol.solve()

    def planned(sol, cost, plan_budget):
        choices, peaks, beside = [], [apply_peak], {}
        sol.tree(0, chain.n, sol.R, float(base_bytes), choices, peaks, beside)
        schedule = _to_schedule(choices, chain.n)
        leaves = tuple(sorted((s, t) for s, t, kind, *_ in choices if kind == "leaf"))
        return Plan(schedule, int(max(peaks)), cost - total - overhead * schedule.num_sections, plan_budget,
                    base_bytes, tuple(count_forward_runs(schedule)), leaves, margin,
                    sum(1 for span in leaves if span in chain.measured), extra_bytes, int(apply_peak),
                    tuple(int(beside[span]) for span in leaves))

    def fits(plan_budget):
        """The solved plan at this budget, or None."""
        if apply_peak + spread > (1.0 - margin) * plan_budget:
            return None
        solved = solver((1.0 - margin) * plan_budget - base_bytes - spread)
        return solved if solved[1] < _INF else None

    solved = fits(budget)
    if solved is None:
        # The least memory any schedule needs (exact bytes), then the least budget whose slotted plan fits it.
        smallest = max(int(_least_memory(chain, units, activation_scale) + base_bytes), apply_peak)
        # The plans' own rule, the spread once (another run's floor moving by it is what the spread stands for).
        advised = math.ceil((smallest + spread) / (1 - margin) / 2**20) * 2**20
        while (solved := fits(advised)) is None:
            advised += max(2**20, int(advised / resolution))
        sol, cost = solved
        spread_note = (f" and the {human_bytes(spread)} by which the probe's repeated runs differed"
                       if spread else "")
        raise NoPlanFits(
            f"memory_budget={human_bytes(budget)} ({budget} bytes): no partition fits; the smallest predicted "
            f"peak reachable is {human_bytes(smallest)} ({smallest} bytes), and plans keep a {margin:.0%} "
            f"safety margin below the budget{spread_note}: the smallest budget that fits is about "
            f"{human_bytes(advised)}.", smallest, planned(sol, cost, advised), advised)
    return planned(*solved, budget)


def _least_memory(chain: _Chain, units: list, scale: float) -> float:
    """The least memory beside the base any schedule of the chain needs, under the solver's model in exact
    bytes (a min-max recursion over the same choices: leaf, a unit policy, or keep a border and split)."""
    n, border, after = chain.n, chain.border, chain.grads_after
    g: dict = {}
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length
            best = chain.section(s, t, scale).activation_bytes + after[t]
            for q in range(s + 1, t):
                for policy in units:
                    pc = policy.cost(chain.section(s, q, scale))
                    best = min(best, max(pc.kept_bytes + border[q] + g[(q, t)],
                                         pc.kept_bytes + pc.backward_bytes + border[q] + after[q] - border[t]))
                best = min(best, max(border[q] + g[(q, t)], border[q] - border[t] + g[(s, q)]))
            g[(s, t)] = best
    return g[(0, n)]


def least_peak(profiles, input_bytes: int, base_bytes: int = 0, units=(Store(),), activation_scale: float = 1.0,
               measured=None, grad_bytes=None, apply_bytes: int = 0, extra_bytes: int = 0) -> int:
    """The smallest peak any schedule is predicted to reach (what ``NoPlanFits.smallest`` names), sections not in
    ``measured`` estimated at the median ratio measured/estimated. It grows with the
    batch where the activations do: ``batch=max`` searches for the batch whose floor meets the budget."""
    chain = _Chain(profiles, input_bytes, measured, grad_bytes)
    ratios = _ratios(chain, chain.measured) or [1.0]
    chain.calibration = ratios[len(ratios) // 2]
    apply_peak = base_bytes + extra_bytes + chain.grads_after[0] + apply_bytes
    return max(int(_least_memory(chain, list(units), activation_scale) + base_bytes + extra_bytes), apply_peak)


def _ratios(chain: _Chain, measured: dict) -> list:
    """Measured over estimated activations of each section measured, sorted. A section the device had no memory to
    measure (``DOES_NOT_FIT``) says nothing about the others' costs."""
    return sorted(measured[k] / max(1, chain.estimate(*k)) for k in measured if measured[k] < DOES_NOT_FIT)
