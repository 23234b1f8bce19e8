"""The device's memory (what a plan may use when no budget is given) and what an out-of-memory error says."""

from __future__ import annotations

import functools
import gc
import math
import os
import re
import subprocess
from dataclasses import dataclass
from typing import NamedTuple

import tensorflow as tf

from .. import rules
from ..allocator import LIMIT, cpu_limit, machine_memory

# What a plan to the whole device leaves free: the allocator's chunking (a request can fail with this much free in
# pieces) and a later process's other op order. Measured on this project's CPU emulation of a fixed device: see
# BENCHMARKS.md, "Fitting the device".
HEADROOM = 0.05
_DTYPE_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "int16": 2, "uint16": 2,
                "int32": 4, "uint32": 4, "int64": 8, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16}


@dataclass(frozen=True)
class DeviceMemory:
    """How much memory a device has for TensorFlow, and where that figure came from.

    ``hard``: an allocation past it raises ``ResourceExhaustedError`` (a GPU, a CPU allocator with
    ``TF_CPU_BFC_MEM_LIMIT_IN_MB``); on a CPU without one the process swaps or is killed instead.
    """

    device: str
    total: int | None
    source: str
    hard: bool

    def describe(self) -> str:
        if self.total is None:
            return f"{self.device}: unknown ({self.source})"
        return f"{self.device}: {rules.human_bytes(self.total)} ({self.source})"


def device_memory(device: str) -> DeviceMemory:
    """The memory of ``device`` (``"GPU:0"``, ``"CPU:0"``): on a GPU a memory limit set with
    ``tf.config.set_logical_device_configuration`` where there is one, else the card's memory (``nvidia-smi``);
    on the CPU the allocator's ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` where set, else physical memory or the cgroup
    limit."""
    if device.upper().startswith("GPU"):
        return _gpu_memory(device)
    limit = cpu_limit()
    if limit is not None:
        return DeviceMemory(device, limit, f"{LIMIT}={limit // 2**20}", hard=True)
    total, source = machine_memory()
    return DeviceMemory(device, total, source, hard=False)


def _gpu_memory(device: str) -> DeviceMemory:
    index = int(device.split(":")[-1] or 0)
    gpus = tf.config.list_physical_devices("GPU")
    if index < len(gpus):
        try:
            configs = tf.config.get_logical_device_configuration(gpus[index]) or []
        except (ValueError, RuntimeError):
            configs = []
        limits = [c.memory_limit for c in configs if getattr(c, "memory_limit", None)]
        if limits:
            return DeviceMemory(device, int(limits[0]) * 2**20, "the memory limit set with "
                                "tf.config.set_logical_device_configuration", hard=True)
    total = _card_memory(index)
    if total is None:
        return DeviceMemory(device, None, "nvidia-smi could not be read", hard=True)
    return DeviceMemory(device, total, "nvidia-smi memory.total", hard=True)


@functools.lru_cache(maxsize=None)
def _card_memory(index: int) -> int | None:
    """A card's total memory from ``nvidia-smi`` (asked once per process: every trainer reads it at init)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30)
        total = int(out.stdout.strip().splitlines()[0]) * 2**20 if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        total = None
    return total


class Budget(NamedTuple):
    """A memory budget: its bytes, and a line saying how they were reached."""

    bytes: int
    source: str


def resolve_budget(value, memory: DeviceMemory, held: int = 0) -> Budget:
    """A budget in bytes and a line saying how it was reached. ``value``: bytes or a size (as given), a fraction
    of the device (``rules.parse_budget``), or None: the device's memory less ``HEADROOM`` and, on a CPU without
    an allocator limit, ``held`` (what the process holds outside TensorFlow's allocator, which no step reading
    counts)."""
    parsed = None if value is None else rules.parse_budget(value)
    if isinstance(parsed, int):
        return Budget(parsed, "given")
    if memory.total is None:
        raise rules.RuleError(
            f"memory_budget={'None' if value is None else value!r}: the memory of {memory.device} is unknown "
            f"({memory.source}); give memory_budget in bytes or a size like '2GiB'.", "unknown_device_memory")
    total = memory.total - (0 if memory.hard else held)
    if parsed is None:
        budget = int(total * (1 - HEADROOM))
        held_note = f" less {rules.human_bytes(held)} the process holds outside TensorFlow" if (
            held and not memory.hard) else ""
        return Budget(budget, f"the device's memory, {memory.describe()}{held_note}, less {HEADROOM:.0%} headroom")
    return Budget(int(total * parsed), f"{parsed:g} of the device's memory, {memory.describe()}")


def device_budget(value=None, device: str | None = None) -> Budget:
    """``resolve_budget`` for ``device`` (default: ``GPU:0`` where there is one, else ``CPU:0``)."""
    device = device or ("GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0")
    return resolve_budget(value, device_memory(device))


# The CPU allocator grows (TensorFlow builds it with allow_growth): its first region is 2 MiB, made by the first
# allocation of any size, here the reserving op's own shape.
_FIRST_REGION = 2 * 2**20
_reserved: list = []  # the limit this process reserved (an allocator keeps its regions for the process's life)


def reserve_cpu_limit() -> str | None:
    """Take a CPU allocator limit (``TF_CPU_BFC_MEM_LIMIT_IN_MB``) as one region now and free it, so that steps
    allocate from one region of the limit's size, as a GPU's allocator does (it reserves the device at start).
    Without it the growing allocator keeps regions of doubling sizes, and a tensor cannot span two of them: a
    request can fail with much more than its size free. Call it first, before anything else allocates. Returns a
    line saying what was done; None where no CPU limit is in force (or a GPU takes the steps)."""
    limit = cpu_limit()
    if limit is None or limit <= _FIRST_REGION or tf.config.list_physical_devices("GPU"):
        return None
    if _reserved:  # a later job of a sweep in one process: the region is still the allocator's
        return f"the CPU allocator's limit {LIMIT}={limit // 2**20} is one region (reserved earlier in this process)"
    held = int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    if held > _FIRST_REGION // 2:
        return (f"the CPU allocator's limit {LIMIT}={limit // 2**20} was not reserved as one region: "
                f"{rules.human_bytes(held)} was allocated before; steps allocate from regions of doubling sizes")
    size = limit - _FIRST_REGION
    try:
        tf.raw_ops.Empty(shape=[size], dtype=tf.uint8)
    except tf.errors.ResourceExhaustedError:
        return (f"the CPU allocator's limit {LIMIT}={limit // 2**20} could not be reserved as one region "
                f"({rules.human_bytes(size)} refused); steps allocate from regions of doubling sizes")
    finally:
        tf.config.experimental.reset_memory_stats("CPU:0")
    _reserved.append(limit)
    return (f"the CPU allocator's limit {LIMIT}={limit // 2**20} reserved as one region of "
            f"{rules.human_bytes(size)} (as a GPU's allocator reserves its memory)")


def held_outside(meter) -> int:
    """Bytes this process holds outside TensorFlow's allocator (resident memory less what the allocator holds):
    on a CPU without an allocator limit they share the machine's memory with the steps."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return 0
    return max(0, resident - meter.current())


class VariablesDoNotFit(ValueError):
    """What no batch, partition or engine can train: the model's variables could not be made on the device
    (``what="model"``), or they and the optimizer's slots are more than it holds (``what="optimizer"``)."""

    def __init__(self, message: str, what: str):
        super().__init__(message)
        self.what = what


class OutOfMemory(RuntimeError):
    """A step ran out of the device's memory: which device, what the failing allocation asked for (bytes and
    shape, where TensorFlow's message names them) and what was in use when it failed."""

    def __init__(self, message: str, device: DeviceMemory, requested: int | None, shape: str, in_use: int):
        super().__init__(message)
        self.device, self.requested, self.shape, self.in_use = device, requested, shape, in_use

    @classmethod
    def from_error(cls, err: BaseException, meter, memory: DeviceMemory) -> "OutOfMemory":
        """From TensorFlow's ``ResourceExhaustedError``; frees what the failed step held (``release``)."""
        requested, shape = requested_bytes(err)
        release(err)
        in_use = meter.peak() if meter.available else 0
        hb = rules.human_bytes
        asked = f"{hb(requested)} ({shape})" if requested is not None else "an allocation TensorFlow did not size"
        used = f" with {hb(in_use)} in use" if meter.available else ""
        return cls(f"out of memory on {memory.describe()}: the failing allocation asked for {asked}{used}",
                   memory, requested, shape, in_use)


def requested_bytes(err: BaseException) -> tuple[int | None, str]:
    """What the failing allocation asked for, from TensorFlow's message (``OOM when allocating tensor with
    shape[96,64,64,3] and type float``): bytes and the shape as text; ``(None, "")`` where the message names
    no tensor."""
    m = re.search(r"shape\s*\[([0-9,\s]*)\]\s*and type\s+(\w+)", str(err))
    if not m:
        return None, ""
    dims = [int(d) for d in m.group(1).replace(" ", "").split(",") if d]
    size = _DTYPE_BYTES.get(m.group(2))
    shape = f"[{','.join(map(str, dims))}] {m.group(2)}"
    return (math.prod(dims) * size if size else None), shape


def release(err: BaseException | None = None) -> None:
    """Free what a failed step held: its traceback's frames keep the step's tensors alive until collected."""
    if err is not None:
        err.__traceback__ = None
    gc.collect()
