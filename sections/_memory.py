"""Allocator peak-memory readings around each phase of a step (GPU:0 when present, else CPU:0)."""

from __future__ import annotations

import tensorflow as tf


def default_device() -> str:
    return "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"


class MemoryMeter:
    """Reads ``tf.config.experimental.get_memory_info`` for one device.

    On devices whose allocator keeps no statistics the meter is ``available == False`` and reads 0.
    """

    def __init__(self, device: str | None = None):
        self.device = device or default_device()
        try:
            tf.config.experimental.get_memory_info(self.device)
            self.available = True
        except (ValueError, RuntimeError, tf.errors.OpError):
            self.available = False

    def _sync(self) -> None:
        # GPU execution is asynchronous: the peak is only final once queued kernels have run.
        if self.device.startswith("GPU"):
            sync = getattr(getattr(tf.test, "experimental", None), "sync_devices", None)
            if sync is not None:
                sync()

    def reset(self) -> None:
        if self.available:
            self._sync()
            tf.config.experimental.reset_memory_stats(self.device)

    def peak(self) -> int:
        if not self.available:
            return 0
        self._sync()
        return int(tf.config.experimental.get_memory_info(self.device)["peak"])

    def current(self) -> int:
        if not self.available:
            return 0
        self._sync()
        return int(tf.config.experimental.get_memory_info(self.device)["current"])
