"""Impossible sizes refused before anything is allocated: a batch whose examples alone exceed the machine's memory."""

from __future__ import annotations

import math
import os
from pathlib import Path

from runner.errors import ConfigError
from runner.progress import human_bytes


def example_bytes(spec) -> int:
    """Bytes of one example of a batched `tf.data` element spec (a dict of TensorSpecs with a batch dimension);
    an unknown dimension (variable length) counts as 1, so this is a lower bound."""
    import tensorflow as tf

    total = 0
    for s in tf.nest.flatten(spec):
        dims = [d if d is not None else 1 for d in s.shape.as_list()[1:]]
        total += math.prod(dims) * s.dtype.size
    return total


def machine_memory() -> int | None:
    """Physical memory, or the container's (cgroup) limit when lower; None when neither can be read."""
    found = []
    try:
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            found.append(int(text))
    return min(found) if found else None


def check_batch_fits(batch: int, spec, memory: int | None = None) -> None:
    """ConfigError when `batch` examples of `spec` alone need more than the machine's memory (the step's
    activations come on top, so a batch that passes may still not fit)."""
    memory = memory if memory is not None else machine_memory()
    per = example_bytes(spec)
    if memory is None or per == 0 or batch * per <= memory:
        return
    raise ConfigError("batch", batch, f"its examples alone need {human_bytes(batch * per)} ({human_bytes(per)} "
                      f"each), more than this machine's {human_bytes(memory)} of memory; allowed: at most "
                      f"{memory // per} here, and less for the activations")
