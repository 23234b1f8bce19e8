"""Memory-budget planner: boundaries and per-section policies that fit a budget with the least re-run work."""

from __future__ import annotations

import re
from dataclasses import dataclass

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
    budget: int

    def summary(self) -> str:
        from ._partition import human_bytes

        return (f"plan: {len(self.starts) + 1} sections, policies {self.policies}, predicted peak "
                f"{human_bytes(self.predicted_peak)} within budget {human_bytes(self.budget)}")


def plan_partition(profiles, input_bytes: int, budget: int) -> Plan:
    raise NotImplementedError("sections='auto' planning is not implemented yet.")
