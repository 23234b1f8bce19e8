"""``train.gpu_memory``: each GPU's memory capped, as a smaller card, before TensorFlow's GPU runtime starts."""

from __future__ import annotations

import math

from runner.errors import ConfigError
from sections.allocator import LIMIT
from sections.rules import parse_bytes

KEY = "train.gpu_memory"


def check_gpu_memory(value) -> int | None:
    """The cap in bytes, or None; a value that is not a size is refused naming what is allowed."""
    if value is None:
        return None
    try:
        return parse_bytes(value, KEY)
    except ValueError:
        raise ConfigError(KEY, value, "allowed: a size such as 16GiB or 850MiB (a number: bytes), or null") from None


def cap_gpu_memory(value) -> int | None:
    """Give each GPU a logical-device memory limit of ``value`` (whole MiB, rounded up): TensorFlow's allocator on it
    then fails past that, as on a card that size, and ``sections.device_memory`` reads the limit (so
    ``sections=auto`` plans to it). Returns the MiB set, or None. Must run before the GPU runtime starts."""
    bytes_ = check_gpu_memory(value)
    if bytes_ is None:
        return None
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        raise ConfigError(KEY, value, f"this process has no GPU; on the CPU a device of N MiB is emulated with "
                                      f"{LIMIT}=N in the environment (read when TensorFlow starts)")
    mib = max(1, math.ceil(bytes_ / 2**20))
    try:
        for gpu in gpus:
            if [c.memory_limit for c in tf.config.get_logical_device_configuration(gpu) or ()] == [mib]:
                continue  # set so already (an earlier job of a sweep in this process)
            tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mib)])
    except RuntimeError as err:  # the runtime already started in this process (an earlier run of a sweep)
        raise ConfigError(KEY, value, f"TensorFlow's GPU runtime already started in this process and its memory "
                                      f"cannot change now ({err}); run it in a process of its own") from None
    return mib
