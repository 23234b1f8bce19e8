"""A step's schedule: where sections start, each section's policy, and which borders each forward keeps; and the
flat program of steps it compiles to, which the engine executes and the forward-run counter simulates.

The step runs *descents*: from a held border ``p`` toward section ``t - 1`` of a segment ``[p, t)``, asking
``action(p, t)`` at each held border. An action ``(mode, q)`` runs section ``p`` so that it keeps something
(``"policy"``: what its own policy keeps; ``"keep"``: just its input border, for a later re-run), runs
sections ``p+1 .. q-1`` without keeping anything, and goes on from border ``q``. The top descent is
``[0, K)``; a section whose input border was not kept is re-created by a descent from the nearest kept
border before its backward (Rotor's recursion, Beaumont et al. 2019, when the planner wrote the actions).
``Schedule.program`` unrolls all of that once into a sequence of ``Step``s, the way Rockmate's solver emits one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from .policies import KEEP_INPUT, Policy

#: Step operations. FORWARD: run section k (``keep``: "policy" keeps what its policy keeps, "input" keeps its
#: input border for a re-run, "" keeps nothing). LOSS: the last section's forward, loss and backward in one.
#: RESUME: start a re-creating descent from the border that section ``source`` kept (border k). HOLD: keep the
#: descent's border as section k's input. BACKWARD: section k's backward from what it kept.
FORWARD, LOSS, RESUME, HOLD, BACKWARD = "forward", "loss", "resume", "hold", "backward"


@dataclass(frozen=True)
class Step:
    """One instruction of a step's program."""

    op: str
    section: int
    keep: str = ""
    source: int = -1

    def __repr__(self) -> str:
        extra = f", {self.keep}" if self.keep else f", from {self.source}" if self.op == RESUME else ""
        return f"{self.op}({self.section}{extra})"


@dataclass(frozen=True)
class Schedule:
    """Frozen result of planning. ``actions``: ``{(p, t): (mode, q)}`` from the planner; missing entries follow
    the policies (the top descent keeps the input of every section whose policy keeps its input; re-creating
    descents keep every border they pass, the two-level scheme). ``plain``: sections that run every layer's own
    Keras gradient whatever the engine's ``lean`` (the planner's choice where lean gradients cost time the
    budget does not need)."""

    starts: tuple[int, ...]
    policies: tuple[Policy, ...]
    actions: Mapping[tuple[int, int], tuple[str, int]] = field(default_factory=dict)
    plain: frozenset = frozenset()

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

    @cached_property
    def program(self) -> tuple[Step, ...]:
        """The step as one flat sequence: the cached forward, the fused last section, then each section's
        backward from the last to the first, preceded by the descent that re-creates its input if it was dropped."""
        return compile_program(self)


def kept_policy(schedule: Schedule, step: Step) -> Policy | None:
    """The policy whose ``forward`` a FORWARD step runs (None: a plain forward that keeps nothing)."""
    if step.keep == "policy":
        return schedule.policies[step.section]
    return KEEP_INPUT if step.keep == "input" else None


def compile_program(schedule: Schedule) -> tuple[Step, ...]:
    k_total = schedule.num_sections
    program: list[Step] = []
    kept: list[Policy | None] = [None] * k_total

    def descend(p, t):
        while p < t - 1:
            mode, q = schedule.action(p, t)
            step = Step(FORWARD, p, "policy" if mode == "policy" else "input")
            program.append(step)
            kept[p] = kept_policy(schedule, step)
            program.extend(Step(FORWARD, i) for i in range(p + 1, q))
            p = q

    descend(0, k_total)
    program.append(Step(LOSS, k_total - 1))
    for k in range(k_total - 2, -1, -1):
        if kept[k] is None:
            source = next((j for j in range(k - 1, -1, -1)
                           if kept[j] is not None and kept[j].resume_offset is not None), None)
            if source is None:
                raise RuntimeError(f"section_{k}: no kept border to re-create its input from (the schedule keeps "
                                   f"none).")
            border = source + kept[source].resume_offset
            program.append(Step(RESUME, border, source=source))
            descend(border, k + 1)
            program.append(Step(HOLD, k))
            kept[k] = KEEP_INPUT
        program.append(Step(BACKWARD, k))
        kept[k] = None
    return tuple(program)


def count_forward_runs(schedule: Schedule) -> list[int]:
    """Forward executions of each section in one step, as the engine will count them: a dry run of the program."""
    runs = [0] * schedule.num_sections
    kept: list[Policy | None] = [None] * schedule.num_sections
    for step in schedule.program:
        k = step.section
        if step.op in (FORWARD, LOSS):
            runs[k] += 1
            if step.keep:
                kept[k] = kept_policy(schedule, step)
        elif step.op == HOLD:
            kept[k] = KEEP_INPUT
        elif step.op == BACKWARD:
            runs[k] += kept[k].reruns_forward
            kept[k] = None
    return runs
