"""Measuring for the planner: dry steps of compiled plans (a step run with its state restored after). It holds the executor and a way to compile a schedule, never the engine."""

from __future__ import annotations

import time
from typing import Callable

from ..backend.device import release
from ..schedule.program import Schedule
from .section_functions import Compiled
from .executor import DryStep, Executor


class Measurer:
    """Runs what planning measures. ``compile(schedule)`` makes a program; ``current`` is the one the executor
    runs; ``seconds`` and the counts say what measuring cost."""

    def __init__(self, network, executor: Executor, compile: Callable[[Schedule], Compiled], meter, lean):
        self.network, self.executor, self._compile, self.meter, self.lean = network, executor, compile, meter, lean
        self.current: Compiled | None = None
        self.programs: list = []  # (schedule, Compiled): a plan dry-run once is not compiled again
        self.seconds = {"dry steps": 0.0}
        self.dry_steps = self.ran_out = 0

    def use(self, schedule: Schedule) -> Compiled:
        """Make ``schedule``'s program the one that runs (compiled once)."""
        compiled = next((c for s, c in self.programs if s == schedule), None)
        if compiled is None:
            compiled = self._compile(schedule)
            self.programs.append((schedule, compiled))
        if compiled is not self.current:  # adopting again would make (and trace) its update functions anew
            self.current = compiled
            self.executor.adopt(compiled)
        return compiled

    def dry_step(self, schedule: Schedule, batch) -> DryStep:
        """``schedule``'s step run unapplied, its state and counters restored (``Executor.dry_step``)."""
        self.use(schedule)
        began = time.perf_counter()
        dry = self.executor.dry_step(batch, self.current.read_counters)
        self.seconds["dry steps"] += time.perf_counter() - began
        self.dry_steps += 1
        self.ran_out += int(dry.ran_out)
        if dry.ran_out:
            release()
        return dry

    def forget(self) -> None:
        """Drop the programs kept for plans that do not run."""
        self.programs = [(s, c) for s, c in self.programs if c is self.current]
