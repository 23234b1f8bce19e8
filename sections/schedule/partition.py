"""Sections: contiguous runs of blocks, balanced cuts, and the partition table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

@dataclass
class Section:
    """A contiguous run of blocks trained as one unit of the backward pass."""

    index: int
    start: int
    stop: int
    block_names: list[str]
    policy: str
    variables: list = field(default_factory=list)
    state_variables: list = field(default_factory=list)
    input_bytes: int = 0
    input_specs: object = None

    @property
    def name(self) -> str:
        return f"section_{self.index}"

    @property
    def num_parameters(self) -> int:
        return int(sum(_numel(v.shape) for v in self.variables))


def balanced_starts(costs: Sequence[float], sections: int) -> list[int]:
    """Split ``costs`` into ``sections`` contiguous runs minimising the largest run's sum.

    Returns the start indices of runs 1..; ties prefer earlier cuts.
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][j]: smallest max-run cost splitting the first j blocks into k runs.
    best = [[inf] * (n + 1) for _ in range(sections + 1)]
    cut = [[0] * (n + 1) for _ in range(sections + 1)]
    best[0][0] = 0.0
    for k in range(1, sections + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], prefix[j] - prefix[i])
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    starts, j = [], n
    for k in range(sections, 1, -1):
        j = cut[k][j]
        starts.append(j)
    return sorted(starts)


def format_table(rows: list[dict]) -> str:
    """A plain-text table of dict rows (same keys)."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    return "\n".join([line(keys), line(["-" * w for w in widths])] + [line(c) for c in cells])


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
