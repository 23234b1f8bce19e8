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
from pathlib import Path
from typing import MutableMapping

BFC = "TF_CPU_ALLOCATOR_USE_BFC"
ONEDNN = "TF_ENABLE_ONEDNN_OPTS"
LIMIT = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # the BFC allocator's hard limit: a CPU of fixed memory, as a GPU is
# What sectionflow sets where the user set nothing: oneDNN on x86 (TensorFlow leaves it off on some x86 CPUs; turning
# it on halved the default run's step time: BENCHMARKS.md, "CPU allocator"), which brings a CPU allocator that keeps
# statistics; where oneDNN stays off (the user's choice, or not x86), the BFC allocator, which keeps them too.
ONEDNN_ON_X86 = "1"
BFC_WITHOUT_ONEDNN = "true"
MARKER = "SECTIONFLOW_ALLOCATOR_SET"  # which variables configure() set (child processes inherit it)


def configure(environ: MutableMapping[str, str] | None = None, tensorflow_loaded: bool | None = None) -> str:
    """Before TensorFlow loads, each only where the user has not set it: on x86 ``TF_ENABLE_ONEDNN_OPTS=1`` (faster
    kernels, and an allocator that keeps statistics); where oneDNN is off, ``TF_CPU_ALLOCATOR_USE_BFC=true`` (the
    statistics). Returns a line saying what is in effect and who set it. Does nothing once TensorFlow is loaded."""
    env = os.environ if environ is None else environ
    loaded = "tensorflow" in sys.modules if tensorflow_loaded is None else tensorflow_loaded
    if not loaded:
        chosen = []
        limited = cpu_limit({**env, BFC: env.get(BFC, "true")}) is not None  # a limit, and BFC not refused
        if env.get(ONEDNN) is None and limited:
            # A device of fixed memory emulated on the CPU: oneDNN's kernels crash the process (SIGSEGV) when an
            # allocation past the limit fails (keras.applications EfficientNetB0, a whole step under 473 MiB),
            # where TensorFlow's own raise ResourceExhaustedError, as on a GPU.
            env[ONEDNN] = "0"
            chosen.append(ONEDNN)
        elif env.get(ONEDNN) is None and platform.machine().lower() in ("x86_64", "amd64"):
            env[ONEDNN] = ONEDNN_ON_X86
            chosen.append(ONEDNN)
        onednn_on = env.get(ONEDNN, "").strip().lower() in ("1", "true")
        if env.get(BFC) is None and (not onednn_on or limited):  # the limit is the BFC allocator's
            env[BFC] = BFC_WITHOUT_ONEDNN
            chosen.append(BFC)
        if chosen:
            env[MARKER] = ",".join(chosen)
    return describe(env)


def onednn_off(environ=None) -> bool:
    """Whether ``TF_ENABLE_ONEDNN_OPTS`` turns oneDNN's kernels off (unset: TensorFlow's own choice, not read as
    off; ``configure`` sets it on x86)."""
    env = os.environ if environ is None else environ
    return env.get(ONEDNN, "").strip().lower() in ("0", "false")


def describe(environ=None) -> str:
    """``CPU allocator: TF_CPU_ALLOCATOR_USE_BFC=true (set by sectionflow), TF_ENABLE_ONEDNN_OPTS unset``."""
    env = os.environ if environ is None else environ
    ours = env.get(MARKER, "").split(",")

    def show(key):
        value = env.get(key)
        if value is None:
            return f"{key} unset"
        return f"{key}={value}" + (" (set by sectionflow)" if key in ours else " (yours)")

    limit = f", {show(LIMIT)}{limit_not_in_force(env)}" if env.get(LIMIT) is not None else ""
    crash = ""
    if cpu_limit(env) is not None and not onednn_off(env) and env.get(ONEDNN) is not None:
        # TensorFlow's oneDNN kernels do not check a failed scratch allocation: the process dies (SIGSEGV).
        crash = (f" (oneDNN's kernels under a limit can crash the process where an allocation fails; "
                 f"{ONEDNN}=0 avoids it)")
    return f"CPU allocator: {show(BFC)}, {show(ONEDNN)}{limit}{crash}"


def limit_not_in_force(environ=None) -> str:
    """`` (not in force: ...)`` where ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` is set but no allocator reads it, else ``""``."""
    env = os.environ if environ is None else environ
    text = (env.get(LIMIT) or "").strip()
    if not text or cpu_limit(env) is not None:
        return ""
    if not text.isdigit() or int(text) <= 0:
        return " (not in force: not a positive whole number of MiB)"
    return (f" (not in force: only the BFC allocator reads it, and {BFC} is not true; set {BFC}=true before "
            f"TensorFlow loads)")


def missing_statistics_advice() -> str:
    """What to do when the CPU allocator keeps no statistics."""
    return (f"set {BFC}=true in the environment before TensorFlow loads (or import sections.allocator and call "
            f"configure() before importing TensorFlow); {ONEDNN}=1 also gives them")


def cpu_limit(environ=None) -> int | None:
    """The CPU allocator's hard limit in bytes (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, read by the BFC allocator), or None
    where it is unset or unreadable (an unreadable value is ignored by TensorFlow too)."""
    env = os.environ if environ is None else environ
    text = (env.get(LIMIT) or "").strip()
    if not text.isdigit() or int(text) <= 0:
        return None
    if (env.get(BFC) or "").strip().lower() not in ("1", "true"):
        return None  # only the BFC allocator reads it (oneDNN's own CPU allocator ignores it: measured)
    return int(text) * 2**20


def machine_memory() -> tuple[int | None, str]:
    """Physical memory, or the container's (cgroup) limit when lower, with which it is; ``(None, why)`` when
    neither can be read."""
    found = []
    try:
        found.append((os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "physical memory"))
    except (ValueError, OSError, AttributeError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            found.append((int(text), f"the container's limit, {limit}"))
    return min(found) if found else (None, "neither physical memory nor a cgroup limit could be read")


def kernel_crash_warning(environ=None) -> str | None:
    """Where a dry step may kill the process instead of raising: a CPU allocator limit with oneDNN's kernels not
    turned off (they do not check a failed scratch allocation: SIGSEGV). None elsewhere."""
    env = os.environ if environ is None else environ
    if cpu_limit(env) is None or onednn_off(env):
        return None
    state = f"{ONEDNN}={env[ONEDNN]}" if env.get(ONEDNN) is not None else f"{ONEDNN} unset (TensorFlow's choice)"
    return (f"planning under the CPU allocator's limit {LIMIT}={env.get(LIMIT)} with {state}: where a dry step "
            f"runs out of memory inside a oneDNN kernel the process can crash (SIGSEGV) instead of raising; set "
            f"{ONEDNN}=0 before TensorFlow loads (the runner does) to plan safely")
