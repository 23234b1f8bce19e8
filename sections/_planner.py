"""Memory-budget planner: boundaries and per-section policies that fit a budget with the least re-run work.

Peak model, from the per-block probe: during the backward of section k the live memory is the base
(variables, optimizer slots, the batch), the input borders of sections 0..k, the kept activations of
stored sections before k, section k's own training memory and the gradient arriving at its output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ._partition import human_bytes
from ._profile import section_activation_bytes

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(value) -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"512MB"``, ``"1e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"memory_budget={value!r}: must be bytes (int) or a string like '2GiB'.")
    if isinstance(value, (int, float)):
        if value <= 0:
            raise ValueError(f"memory_budget={value!r}: must be positive.")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(
            f"memory_budget={value!r}: must be bytes or a number with a unit "
            f"(B, KB, MB, GB, KiB, MiB, GiB), e.g. '2GiB'."
        )
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory_budget={value!r}: must be positive.")
    return n


@dataclass
class Plan:
    starts: list
    policies: list
    predicted_peak: int
    rerun_seconds: float
    budget: int
    section_peaks: list = field(default_factory=list)

    def summary(self) -> str:
        return (f"plan: {len(self.starts) + 1} section(s), policies {self.policies}, predicted peak "
                f"{human_bytes(self.predicted_peak)} (budget {human_bytes(self.budget)}), "
                f"predicted re-run time {self.rerun_seconds:.3f} s/step")


@dataclass(frozen=True)
class _State:
    carried: int      # bytes alive from earlier sections during later backwards
    cost: float       # re-run seconds so far
    peak: int         # largest predicted section peak so far (without base)
    starts: tuple
    policies: tuple


def _pareto(states: list[_State]) -> list[_State]:
    states = sorted(states, key=lambda s: (s.carried, s.cost, s.peak, len(s.starts)))
    kept: list[_State] = []
    for s in states:
        if not any(k.carried <= s.carried and k.cost <= s.cost and k.peak <= s.peak for k in kept):
            kept.append(s)
    return kept


def _search(profiles, out, fwd, input_bytes, limit):
    n = len(profiles)
    border = [input_bytes] + out[:-1]  # bytes of the tensor entering block i
    frontier = {0: [_State(0, 0.0, 0, (), ())]}
    finals = []
    for j in range(n):
        for s in _pareto(frontier.pop(j, [])):
            for m in range(j + 1, n + 1):
                run = profiles[j:m]
                if m == n:  # the last section runs forward and backward together
                    peak = max(s.peak, s.carried + border[j] + section_activation_bytes(run))
                    if peak <= limit:
                        finals.append(_State(s.carried, s.cost, peak, s.starts, s.policies + ("store",)))
                    continue
                starts = s.starts + (m,)
                for policy in ("store", "recompute"):
                    peak = max(s.peak, s.carried + border[j] + section_activation_bytes(run, policy) + out[m - 1])
                    if peak > limit:
                        continue
                    if policy == "store":
                        state = _State(s.carried + border[j] + sum(p.stored_bytes for p in run), s.cost, peak,
                                       starts, s.policies + (policy,))
                    else:
                        state = _State(s.carried + border[j], s.cost + sum(fwd[j:m]), peak, starts,
                                       s.policies + (policy,))
                    frontier.setdefault(m, []).append(state)
    return finals


def plan_partition(profiles, input_bytes: int, budget: int, base_bytes: int = 0, margin: float = 0.1) -> Plan:
    """The plan with the least predicted re-run time whose predicted peak fits ``(1 - margin) * budget``.

    The margin covers the model's error (measured peaks ran up to 8% above predictions on the ResNet).
    Raises ValueError naming the smallest reachable peak when nothing fits.
    """
    limit = (1.0 - margin) * budget
    out = [p.output_bytes for p in profiles]
    fwd = [p.forward_seconds for p in profiles]
    finals = _search(profiles, out, fwd, input_bytes, limit - base_bytes)
    if not finals:
        smallest = min(s.peak for s in _search(profiles, out, fwd, input_bytes, float("inf")))
        raise ValueError(
            f"memory_budget={human_bytes(budget)} ({budget} bytes): no partition fits; the smallest "
            f"predicted peak reachable is {human_bytes(smallest + base_bytes)} ({smallest + base_bytes} bytes), "
            f"and plans keep a {margin:.0%} safety margin below the budget."
        )
    best = min(finals, key=lambda s: (round(s.cost, 6), len(s.starts), s.peak))
    policies = list(best.policies)
    return Plan(list(best.starts), policies, best.peak + base_bytes, best.cost, budget)
