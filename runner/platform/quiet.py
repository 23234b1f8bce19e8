"""Import TensorFlow without its start-up noise: each C++ line once, and no CUDA probing lines without a GPU.

TensorFlow's C++ code logs through two copies of absl before logging is set up, so every start-up line
appears twice and ignores `TF_CPP_MIN_LOG_LEVEL`; on a machine without a GPU it also reports failing to
initialise CUDA. The lines written while TensorFlow imports and lists its devices are captured at the file
descriptor, then shown once each, at the level `TF_CPP_MIN_LOG_LEVEL` allows (the runner's default: 2,
errors only), with CUDA lines dropped when no GPU was found.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
import warnings

_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ (\S+\] .*)$")
_LEVELS = "IWEF"
_CUDA = re.compile(r"cuda|cuInit|cudart|GPU will not be used|TensorRT", re.IGNORECASE)
_BANNER = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def load_tensorflow():
    """`import tensorflow` and list its devices with the C++ lines filtered; returns the module. The engine's
    warning about missing memory statistics is left to the run's header, which says it."""
    warnings.filterwarnings("ignore", message="sectionflow: the allocator", category=RuntimeWarning)
    if "tensorflow" in sys.modules and getattr(load_tensorflow, "done", False):
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    saved, tf, gpus, failed = os.dup(2), None, [], False
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import tensorflow as tf

            gpus = tf.config.list_physical_devices("GPU")
        except Exception:
            failed = True
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            # on a failed import, show everything it said (not on Ctrl-C or SIGTERM: nothing failed)
            shown = filtered(text, has_gpu=bool(gpus), min_level=0 if failed else _min_level())
            if shown:
                print("\n".join(shown), file=sys.stderr, flush=True)
    # tf.distribute logs a line per reduction at INFO ("Reduce to ... then broadcast"); the run's log is ours.
    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    load_tensorflow.done = True
    return tf


def preload_tensorflow() -> None:
    """`import tensorflow, keras` with the start-up lines filtered, touching no device: a process that forks its
    sweep jobs imports once for all of them (no device runtime, CUDA included, may start before a fork)."""
    if "keras" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            import keras  # noqa: F401 - imports tensorflow
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            shown = filtered(capture.read().decode(errors="replace"), has_gpu=False, min_level=_min_level())
            if shown:
                print("\n".join(shown), file=sys.stderr, flush=True)


def filtered(text: str, has_gpu: bool, min_level: int) -> list[str]:
    """The captured lines worth showing: de-duplicated, at or above `min_level` (0 I, 1 W, 2 E, 3 none)."""
    out, seen, keep = [], set(), True
    for line in text.splitlines():
        if not line.strip() or line.strip() == _BANNER:
            continue
        m = _LINE.match(line)
        if m:
            level, body = _LEVELS.index(m.group(1)), m.group(2)
            keep = level >= min_level and body not in seen and not (not has_gpu and _CUDA.search(body))
            seen.add(body)
        elif line in seen:  # a continuation line of a message shown already
            keep = False
        else:
            seen.add(line)
        if keep:
            out.append(line)
    return out


def _min_level() -> int:
    try:
        return int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        return 0
