"""The engine's rules, in plain Python (no TensorFlow): policy and strategy names, the ``sections``
argument, boundary names, and byte sizes. The runner checks config against these before anything heavy
is imported, so ``Engine(...)`` and ``python -m runner`` give the same answer to the same bad input.
"""

from __future__ import annotations

import difflib
import math
import numbers
import re
from typing import Mapping, Sequence

from .schedule.policies import POLICIES as _REGISTRY

#: Per-section policy names, from the registry in ``sections.schedule.policies`` (built in: re-run the forward in the
#: backward, its input border kept; keep the forward's tape; drop the input border and re-create it from the
#: nearest kept one, multi-level).
POLICIES = tuple(_REGISTRY)
#: The trainers a config can name (``_target_``) and their strategy: this engine, or a baseline at the same partition.
TRAINERS = {"sections.Engine": "sectioned", "sections.WholeGraph": "whole", "sections.RecomputeGrad": "recompute_grad"}
#: Training strategies (each trainer's ``strategy``).
STRATEGIES = tuple(TRAINERS.values())



#: ``lean`` settings: every layer's own gradient, lean gradients, or lean gradients that also re-make the inputs of
#: convolution and dense layers from the batch norm (and ReLU) before them in the backward (``sections.backend.lean``).
LEAN_MODES = (False, True, "recompute")


def check_lean(lean) -> bool | str:
    """``lean`` as one of ``LEAN_MODES`` (``"true"``/``"false"`` strings as booleans); else a clear error."""
    if isinstance(lean, str) and lean.lower() in ("true", "false"):
        return lean.lower() == "true"
    if isinstance(lean, bool) or lean == "recompute":
        return lean
    raise ValueError(f"lean={lean!r}: must be true, false or recompute (lean gradients that also re-make "
                     f"convolution and dense inputs in the backward)")


#: ``apply`` settings (``Engine(apply=...)``, ``sections.step.update``), where the optimizer applies gradients:
#: section by section in the backward where that is exact, always in the backward (an error where it is not exact),
#: or one update after the whole backward.
APPLY_MODES = ("auto", "in_backward", "at_end")


def check_apply(apply) -> str:
    """``apply`` as one of ``APPLY_MODES``; else a clear error."""
    if apply in APPLY_MODES:
        return apply
    raise ValueError(f"apply={apply!r}: must be one of {', '.join(APPLY_MODES)} (in_backward: apply each "
                     f"section's gradients as soon as its backward made them; at_end: one update after the whole "
                     f"backward; auto: in_backward where that equals one update)")


class RuleError(ValueError):
    """A rule's answer: its one-line message, with the rule's name and the facts it decided on, so a caller that
    words answers its own way (the runner's ``key=value: ...``) wraps the answer and restates no rule."""

    def __init__(self, message: str, rule: str, **facts):
        super().__init__(message)
        self.rule, self.facts = rule, facts


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
SIZE_HELP = "bytes (an integer) or a size with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 2GiB, 512MB, 1e9)"


def parse_bytes(value, key: str = "memory_budget") -> int:
    """Bytes from an int or a string such as ``"2GiB"``, ``"2G"``, ``"512MB"``, ``"1e9"``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{key}={value!r}: must be {SIZE_HELP}.")
    if isinstance(value, (int, float)):
        number, unit = float(value), ""
    else:
        m = _SIZE.fullmatch(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{key}={value!r}: must be {SIZE_HELP}.")
        number, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(number) or number * _UNITS[unit] < 1:
        raise ValueError(f"{key}={value!r}: must be a positive size, at least 1 byte.")
    return int(number * _UNITS[unit])


BUDGET_HELP = ("a size with a unit (2GiB, 512MiB; B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), a fraction of the device's "
               "memory written with a decimal point (0 < f <= 1: 0.8, 1.0), or a percentage of it (80%)")


def parse_budget(value, key: str = "memory_budget", bare_bytes: bool = True) -> int | float:
    """A memory budget: bytes (a size with a unit, as ``parse_bytes`` reads it), or a fraction of the device's
    memory (a float in (0, 1], or a string like ``"0.8"`` or ``"80%"``), returned as that float.

    Nothing else: a float above 1 (``1.5``) or a number string without a unit or a decimal point (``"1"``) is
    refused, never read as bytes. ``bare_bytes``: whether a Python int is bytes (the API's ``memory_budget=2**30``);
    a config, where ``1`` and ``1.0`` differ only by a point, passes False and needs a unit."""
    refused = ValueError(f"{key}={value!r}: must be {BUDGET_HELP}.")
    if isinstance(value, bool):
        raise refused
    if isinstance(value, float):
        if 0 < value <= 1:
            return value
        raise refused
    if isinstance(value, int):
        if bare_bytes and value >= 1:
            return value
        raise refused
    if not isinstance(value, str):
        raise refused
    text = value.strip()
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            percent = math.nan
        if not 0 < percent <= 100:
            raise ValueError(f"{key}={value!r}: a percentage of the device's memory must be in (0%, 100%].")
        return percent / 100
    m = _SIZE.fullmatch(text)
    if m and not m.group(2):  # a number without a unit: a fraction, written with a decimal point
        number = float(m.group(1))
        if "." in m.group(1) and 0 < number <= 1:
            return number
        raise refused
    try:
        return parse_bytes(text, key)
    except ValueError:
        raise refused from None


def check_policy_names(policy, allowed: Sequence[str] = POLICIES) -> None:
    """Policy names must be known; objects (custom policies) pass through."""
    names = [policy] if isinstance(policy, str) else list(policy) if isinstance(policy, (list, tuple)) else [policy]
    if not names:
        raise ValueError(f"policy=[]: give one policy name ({', '.join(allowed)}) or one per section.")
    for p in names:
        if isinstance(p, str) and p not in allowed:
            raise ValueError(f"Unknown policy {p!r}; allowed: {list(allowed)}{_did_you_mean(p, allowed)}.")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"Unknown strategy {strategy!r}; allowed: {list(STRATEGIES)}"
                         f"{_did_you_mean(str(strategy), STRATEGIES)}.")


def as_sections(sections):
    """``sections`` with a NumPy (or other ``numbers.Integral``) integer as a Python int, a tuple as a list."""
    if isinstance(sections, numbers.Integral) and not isinstance(sections, bool):
        return int(sections)
    return list(sections) if isinstance(sections, tuple) else sections


def check_sections_arg(sections, memory_budget=None, planner: bool = True) -> None:
    """The shape of a ``sections`` argument, before the network is known (``memory_budget`` is parsed by
    ``parse_bytes``, once, by the caller); ``planner``: whether the trainer plans (``"auto"``: the engine only)."""
    allowed = "must be an int >= 1, a list of boundary names, or 'auto'"
    if isinstance(sections, bool) or not isinstance(sections, (int, list, tuple, str)):
        raise ValueError(f"sections={sections!r}: {allowed}.")
    if isinstance(sections, int) and sections < 1:
        raise ValueError(f"sections={sections}: must be at least 1.")
    if isinstance(sections, str) and sections != "auto":
        raise ValueError(f"sections={sections!r}: {allowed}.")
    if sections == "auto" and not planner:
        raise RuleError("sections='auto' plans the sectioned engine (sections.Engine); the baselines take an int or "
                        "a list of boundary names.", "auto_needs_engine")
    if isinstance(sections, (list, tuple)):
        if not sections or not all(isinstance(n, str) and n for n in sections):
            raise ValueError(f"sections={list(sections)!r}: a list of sections must hold one or more boundary "
                             f"names (strings).")
        if len(set(sections)) != len(sections):
            raise ValueError(f"Section boundaries {list(sections)} name the same place twice.")
    if memory_budget is not None and sections != "auto":
        raise RuleError(f"memory_budget={memory_budget!r}: only sections='auto' plans to a budget; got "
                        f"sections={sections!r} (give sections='auto', or no memory_budget).", "budget_needs_auto")


def default_boundaries(block_names: Sequence[str]) -> dict[str, int]:
    """Boundary names of a chain of blocks, in order: each block's name, and each group prefix (before
    ``/``) naming the group's first block. The value is the index of the block a section would start at."""
    out: dict[str, int] = {}
    for i, name in enumerate(block_names):
        if "/" in name:
            out.setdefault(name.split("/", 1)[0], i)
        out[name] = i
    return out


def resolve_boundaries(boundaries: Mapping[str, int], names: Sequence[str]) -> list[int]:
    """Block indices where sections 1.. start, from boundary names (see ``default_boundaries``)."""
    valid = list(boundaries)
    unknown = [b for b in names if not isinstance(b, str) or b not in boundaries]
    if unknown:
        b = unknown[0]
        raise RuleError(f"Unknown section boundary {b!r}{_did_you_mean(str(b), valid)}; valid boundary "
                        f"names are: {valid}.", "unknown_boundary", unknown=unknown)
    starts = []
    for b in names:
        if boundaries[b] == 0:
            raise ValueError(f"Section boundary {b!r} is the first block, which would leave the first section "
                             f"empty; choose from: {[n for n in valid if boundaries[n] > 0]}.")
        starts.append(boundaries[b])
    if len(set(starts)) != len(starts):
        raise ValueError(f"Section boundaries {list(names)} name the same place twice.")
    if starts != sorted(starts):
        raise ValueError(f"Section boundaries {list(names)} are out of order; they must follow the block order.")
    return starts


def default_probe_batch(real: int) -> int:
    """Examples the planner probes when not told: the whole batch up to 64, else 64 times the largest power of two
    within a quarter of it (64 up to batch 511, 128 up to 1023, ...: ``batch=max``'s trials in one such range reuse
    each other's probes), its figures scaled up (dry steps run the real batch). A probe at the full batch that the
    device has no memory for waits out the allocator's retry and measures nothing: keras.applications ResNet50 at
    batch 240 on a 2 GiB device planned in 8.5 minutes probing 64 against 30 at 240, its plan as fast; the notebook
    ResNet at 2048 on 0.30 of whole's peak planned in 2.2 minutes at 512 and 2.1 at 2048, its steps 10.1 s and
    10.4 s."""
    return real if real <= 64 else 64 << max(0, (real // 4 // 64).bit_length() - 1)


def check_probe_batch(probe_batch) -> None:
    if probe_batch is not None and (isinstance(probe_batch, bool) or not isinstance(probe_batch, int)
                                    or probe_batch < 1):
        raise ValueError(f"probe_batch={probe_batch!r}: expected a positive int (examples the planner's probe "
                         f"runs), or None (null in a config) for the default: the real batch up to 64, else 64 times "
                         f"the largest power of two within a quarter of it.")


def check_section_count(sections: int, num_blocks: int, block_names: Sequence[str]) -> None:
    if sections > num_blocks:
        raise RuleError(f"sections={sections}: more sections than blocks; this network has {num_blocks} blocks"
                        f"{name_list(block_names, 'network.block_names lists them all')}.", "more_sections_than_blocks",
                        num_blocks=num_blocks)


def check_batch_divides(batch: int, replicas: int) -> None:
    """Each replica takes an equal slice of the global batch."""
    if batch % replicas:
        raise RuleError(f"batch {batch} does not divide by the {replicas} replicas; use a multiple of {replicas}.",
                        "batch_not_divisible", replicas=replicas)


def name_list(names: Sequence[str], hint: str, head: int = 5, tail: int = 5) -> str:
    """``": ['a', 'b']"`` for a short list; for a long one the first and last few, the count and ``hint``."""
    names = list(names)
    if len(names) <= head + tail + 2:
        return f": {names}"
    shown = ", ".join(repr(n) for n in names[:head]) + ", ..., " + ", ".join(repr(n) for n in names[-tail:])
    return f" ({len(names)}; {hint}): [{shown}]"


def policies_for(policy, num_sections: int) -> list:
    """One policy per section from a single policy or a per-section list."""
    check_policy_names(policy)
    items = list(policy) if isinstance(policy, (list, tuple)) else [policy] * num_sections
    if len(items) != num_sections:
        raise ValueError(f"policy has {len(items)} entries {items} but there are {num_sections} sections; "
                         f"give one policy or exactly one per section.")
    return items


def check_micro_batch(micro_batch, batch: int | None = None) -> None:
    """Gradient accumulation's micro-batch (``sections.MicroBatched``): a positive integer of examples, at most the
    batch (which is cut into ``ceil(batch / micro_batch)`` micro-batches)."""
    upto = f"1 to the batch ({batch})" if batch is not None else "a positive integer"
    if isinstance(micro_batch, bool) or not isinstance(micro_batch, int) or micro_batch < 1:
        raise RuleError(f"micro_batch={micro_batch!r}: expected examples per micro-batch, {upto}.",
                        "micro_batch_value", batch=batch)
    if batch is not None and micro_batch > batch:
        raise RuleError(f"micro_batch={micro_batch}: larger than the batch; allowed: {upto}.",
                        "micro_batch_over_batch", batch=batch)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def human_seconds(seconds: float) -> str:
    """``4.2 s``, ``12.5 min``."""
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _did_you_mean(word: str, options: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
