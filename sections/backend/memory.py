"""Allocator peak-memory readings around each phase of a step (GPU:0 when present, else CPU:0)."""

from __future__ import annotations

import gc
import os
import time
import warnings
from typing import Sequence

import tensorflow as tf

from ..allocator import missing_statistics_advice

_warned = False


def default_device() -> str:
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


def one_op_order() -> bool:
    """Whether TensorFlow runs ready ops on one inter-op thread (``tf.config.threading`` or
    ``TF_NUM_INTEROP_THREADS=1``): then a compiled function runs its ops in one order every call, and its peak
    memory repeats; with several threads the order, and the peak, move between identical calls."""
    threads = tf.config.threading.get_inter_op_parallelism_threads()
    if not threads:  # 0: TensorFlow's default, unless the environment chose before the runtime started
        threads = int(os.environ.get("TF_NUM_INTEROP_THREADS", "0") or 0)
    return threads == 1


def meter_devices(devices: Sequence[str]) -> list[str]:
    """The devices whose allocators hold a step's memory. Logical CPU devices share the process's one CPU
    allocator, so CPU replicas read as one device, ``CPU:0`` (their total)."""
    out = []
    for d in devices:
        d = "CPU:0" if d.upper().startswith("CPU") else d
        if d not in out:
            out.append(d)
    return out


class MemoryMeter:
    """Reads ``tf.config.experimental.get_memory_info`` for one device or several (a strategy's replicas).

    ``peak()`` is the largest device's peak; ``peaks()`` each device's. On devices whose allocator keeps no
    statistics the meter is ``available == False`` and reads 0; trainers then report ``None`` ("not measured"),
    the planner refuses to plan, and the first such meter in a process warns once, saying what to set.
    """

    def __init__(self, device: str | Sequence[str] | None = None):
        devices = [device] if isinstance(device, str) else list(device or [default_device()])
        self.devices = meter_devices(devices)
        self.device = self.devices[0]
        try:
            for d in self.devices:
                tf.config.experimental.get_memory_info(d)
            self.available = True
        except (ValueError, RuntimeError, tf.errors.OpError):
            self.available = False
            _warn_once(self.devices)

    def _sync(self) -> None:
        # GPU execution is asynchronous: the peak is only final once queued kernels have run.
        if any(d.startswith("GPU") for d in self.devices):
            sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
            if sync is not None:
                sync()

    def reset(self) -> None:
        if self.available:
            self._sync()
            for d in self.devices:
                tf.config.experimental.reset_memory_stats(d)

    def peaks(self) -> dict[str, int]:
        if not self.available:
            return {d: 0 for d in self.devices}
        self._sync()
        return {d: int(tf.config.experimental.get_memory_info(d)["peak"]) for d in self.devices}

    def peak(self) -> int:
        return max(self.peaks().values())

    def current(self) -> int:
        if not self.available:
            return 0
        self._sync()
        return max(int(tf.config.experimental.get_memory_info(d)["current"]) for d in self.devices)

    def settled(self, still: float = 0.3, most: float = 3.0) -> int:
        """``current()`` after garbage is collected and once it has not moved for ``still`` seconds (at most
        ``most`` of waiting: an input pipeline's threads may still be filling their buffers). Without the collection
        the notebook ResNet's planning read a batch (6 MiB) that only a reference cycle held, in two processes of
        three, and it was gone by the dry step: predicted 230.3 MiB, measured 224.4 (with it: 218.1 and 218.3)."""
        gc.collect()
        began = last_change = time.perf_counter()
        value = self.current()
        while time.perf_counter() - last_change < still and time.perf_counter() - began < most:
            time.sleep(0.05)
            now = self.current()
            if now != value:
                value, last_change = now, time.perf_counter()
        return value


def below_resolution(devices) -> str:
    """Why a reading of 0 bytes from an allocator that keeps statistics measured nothing."""
    return (f"every allocation was below the resolution of the allocator of {', '.join(devices)} (read as 0 bytes; "
            f"oneDNN's CPU allocator counts no allocation under 256 KiB, TF_ENABLE_ONEDNN_OPTS=0 with "
            f"TF_CPU_ALLOCATOR_USE_BFC=true counts every one)")


def _warn_once(devices) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"sectionflow: the allocator of {', '.join(devices)} keeps no memory statistics, so no memory is "
                  f"measured (peaks read as not measured, sections='auto' cannot plan); "
                  f"{missing_statistics_advice()}.", RuntimeWarning, stacklevel=3)
