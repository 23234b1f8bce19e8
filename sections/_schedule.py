"""A step's schedule: where sections start, each section's policy, and which borders each forward keeps.

The step runs *descents*: from a held border ``p`` toward section ``t - 1`` of a segment ``[p, t)``, asking
``action(p, t)`` at each held border. An action ``(mode, q)`` runs section ``p`` so that it keeps something
(``"policy"``: what its own policy keeps; ``"keep"``: just its input border, for a later re-run), runs
sections ``p+1 .. q-1`` without keeping anything, and goes on from border ``q``. The top descent is
``[0, K)``; a section whose input border was not kept is re-created by a descent from the nearest kept
border before its backward (Rotor's recursion, Beaumont et al. 2019, when the planner wrote the actions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ._policies import Policy


@dataclass(frozen=True)
class Schedule:
    """Frozen result of planning. ``actions``: ``{(p, t): (mode, q)}`` from the planner; missing entries follow
    the policies (the top descent keeps the input of every section whose policy keeps its input; re-creating
    descents keep every border they pass, the two-level scheme)."""

    starts: tuple[int, ...]
    policies: tuple[Policy, ...]
    actions: Mapping[tuple[int, int], tuple[str, int]] = field(default_factory=dict)

    @property
    def num_sections(self) -> int:
        return len(self.starts) + 1

    def action(self, p: int, t: int) -> tuple[str, int]:
        if (p, t) in self.actions:
            return self.actions[(p, t)]
        q = p + 1
        if t == self.num_sections:
            while q < t - 1 and not self.policies[q].keeps_input:
                q += 1
        return "policy", q


def count_forward_runs(schedule: Schedule) -> list[int]:
    """Forward executions of each section in one step, as the engine will count them (a dry run)."""
    k_total = schedule.num_sections
    runs = [0] * k_total
    kept = [None] * k_total

    def descend(p, t):
        while p < t - 1:
            mode, q = schedule.action(p, t)
            kept[p] = "store" if mode == "policy" and schedule.policies[p].name == "store" else "input"
            for i in range(p, q):
                runs[i] += 1
            p = q

    descend(0, k_total)
    runs[-1] += 1
    for k in range(k_total - 2, -1, -1):
        if kept[k] is None:
            j = max(i for i in range(k) if kept[i] is not None)
            descend(j + 1 if kept[j] == "store" else j, k + 1)
            kept[k] = "input"
        if kept[k] == "input":
            runs[k] += 1
        kept[k] = None
    return runs
