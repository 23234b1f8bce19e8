"""Memory statistics on every CPU: TensorFlow's CPU allocator keeps them only when it is a BFC allocator.

TensorFlow uses a BFC allocator on the CPU when oneDNN is on, and turns oneDNN on by default only on some CPUs
(x86 CPUs with features such as AVX512_VNNI, AVX512_BF16 or AMX); elsewhere, or with ``TF_ENABLE_ONEDNN_OPTS=0``,
``tf.config.experimental.get_memory_info("CPU:0")`` raises and no memory can be measured.
``TF_CPU_ALLOCATOR_USE_BFC=true`` gives the statistics whatever oneDNN does. Both are read once, when TensorFlow
loads, so ``configure`` must run before that. Plain Python: importing this module does not import TensorFlow.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import MutableMapping

BFC = "TF_CPU_ALLOCATOR_USE_BFC"
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
# What sectionflow sets where the user set nothing. BFC gives the statistics; oneDNN is what TensorFlow leaves off on
# some x86 CPUs, and turning it on halved the default run's step time on two machines (BENCHMARKS.md, "CPU
# allocator"): 1.746 -> 0.889 s on an AMD EPYC without AVX2, 5.03 -> 2.59 s on a loaded AVX-512 machine.
DEFAULTS = {BFC: "true"}
X86_DEFAULTS = {ONEDNN: "1"}
MARKER = "SECTIONFLOW_ALLOCATOR_SET"  # which variables configure() set (child processes inherit it)


def configure(environ: MutableMapping[str, str] | None = None, tensorflow_loaded: bool | None = None) -> str:
    """Before TensorFlow loads: ``TF_CPU_ALLOCATOR_USE_BFC=true`` (memory statistics) and, on x86,
    ``TF_ENABLE_ONEDNN_OPTS=1`` (faster CPU kernels), each only where the user has not set it; returns a line
    saying what is in effect and who set it. Does nothing once TensorFlow is loaded."""
    env = os.environ if environ is None else environ
    loaded = "tensorflow" in sys.modules if tensorflow_loaded is None else tensorflow_loaded
    if not loaded:
        wanted = {**DEFAULTS, **(X86_DEFAULTS if platform.machine().lower() in ("x86_64", "amd64") else {})}
        chosen = [key for key in wanted if env.get(key) is None]
        for key in chosen:
            env[key] = wanted[key]
        if chosen:
            env[MARKER] = ",".join(chosen)
    return describe(env)


def describe(environ=None) -> str:
    """``CPU allocator: TF_CPU_ALLOCATOR_USE_BFC=true (set by sectionflow), TF_ENABLE_ONEDNN_OPTS unset``."""
    env = os.environ if environ is None else environ
    ours = env.get(MARKER, "").split(",")

    def show(key):
        value = env.get(key)
        if value is None:
            return f"{key} unset"
        return f"{key}={value}" + (" (set by sectionflow)" if key in ours else " (yours)")

    return f"CPU allocator: {show(BFC)}, {show(ONEDNN)}"


def missing_statistics_advice() -> str:
    """What to do when the CPU allocator keeps no statistics."""
    return (f"set {BFC}=true in the environment before TensorFlow loads (or import sections.allocator and call "
            f"configure() before importing TensorFlow); {ONEDNN}=1 also gives them")
