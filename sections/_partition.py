"""Cutting a chain of blocks into contiguous sections: by boundary names or balanced by memory."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

POLICIES = ("recompute", "store")


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
    activation_bytes: int = 0

    @property
    def name(self) -> str:
        return f"section_{self.index}"

    @property
    def num_parameters(self) -> int:
        return int(sum(_numel(v.shape) for v in self.variables))


def boundary_names(block_names: Sequence[str]) -> list[str]:
    """Every name a boundary may use: block names and group prefixes (before ``/``), in order."""
    names: list[str] = []
    for n in block_names:
        group = n.split("/", 1)[0]
        if "/" in n and group not in names:
            names.append(group)
        names.append(n)
    return names


def resolve_boundaries(block_names: Sequence[str], boundaries: Sequence[str]) -> list[int]:
    """Block indices where sections 1.. start, from boundary names (block names or group prefixes)."""
    valid = boundary_names(block_names)
    starts = []
    for b in boundaries:
        if not isinstance(b, str) or b not in valid:
            raise ValueError(f"Unknown section boundary {b!r}; valid boundary names are: {valid}.")
        idx = next(i for i, n in enumerate(block_names) if n == b or n.startswith(b + "/"))
        if idx == 0:
            raise ValueError(
                f"Section boundary {b!r} is the first block, which would leave the first section empty; "
                f"choose from: {valid[1:]}."
            )
        starts.append(idx)
    if len(set(starts)) != len(starts):
        raise ValueError(f"Section boundaries {list(boundaries)} name the same place twice.")
    if starts != sorted(starts):
        raise ValueError(
            f"Section boundaries {list(boundaries)} are out of order; they must follow the block order."
        )
    return starts


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


def validate_sections_arg(sections, num_blocks: int, block_names: Sequence[str]) -> None:
    if isinstance(sections, bool) or not isinstance(sections, (int, list, tuple, str)):
        raise ValueError(
            f"sections={sections!r}: must be an int >= 1, a list of boundary names, or 'auto'."
        )
    if isinstance(sections, int):
        if sections < 1:
            raise ValueError(f"sections={sections}: must be at least 1.")
        if sections > num_blocks:
            raise ValueError(
                f"sections={sections}: more sections than blocks; this network has {num_blocks} blocks "
                f"({list(block_names)})."
            )


def policies_for(policy, num_sections: int) -> list[str]:
    """One policy per section from a single name or a per-section list."""
    if isinstance(policy, str):
        policy = [policy] * num_sections
    policy = list(policy)
    if len(policy) != num_sections:
        raise ValueError(
            f"policy has {len(policy)} entries {policy} but there are {num_sections} sections; "
            f"give one policy or exactly one per section."
        )
    for p in policy:
        if p not in POLICIES:
            raise ValueError(f"Unknown policy {p!r}; allowed: {list(POLICIES)}.")
    return policy


def format_table(rows: list[dict]) -> str:
    """A plain-text table of dict rows (same keys)."""
    if not rows:
        return ""
    keys = list(rows[0])
    cells = [[str(r[k]) for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    return "\n".join([line(keys), line(["-" * w for w in widths])] + [line(c) for c in cells])


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
