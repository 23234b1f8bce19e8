"""Stops that always stop: SIGTERM (SLURM, `timeout`) and Ctrl-C outside the training loop.

Python runs a signal handler between two bytecodes of the main thread, wherever it is. An exception raised there
inside a finalizer (a `__del__`, such as TensorFlow's `ConcreteFunctionGarbageCollector.__del__` as a `batch=max`
trial's engine is freed, or a weak reference's callback) is printed as "Exception ignored in ..." and lost: the run
went on. So the handler records the signal first (`requested`), then raises at once (`Terminated`, or
`KeyboardInterrupt` for Ctrl-C) unless the interrupted frame runs inside a finalizer; there it sends the signal
again a moment later, when the finalizer has returned. Code between long phases (each `batch=max` trial, the
end of planning, the start of the training loop) calls `check()`, which raises for a recorded signal: a raise that
something swallowed is raised again there. The training loop installs its own handlers (`runner.run.hooks`).
"""

from __future__ import annotations

import os
import signal
import threading
import weakref
from contextlib import contextmanager

NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}
AGAIN_AFTER = 0.05  # seconds: a signal that landed in a finalizer is sent again after this
# Frames in which a raised exception is printed and dropped: finalizers and weak-reference callbacks.
_FINALIZERS = {"__del__"}
_FINALIZER_CODES = {weakref.finalize.__call__.__code__, weakref.WeakValueDictionary()._remove.__code__,
                    weakref.WeakKeyDictionary()._remove.__code__, weakref.WeakSet()._remove.__code__}

requested: int | None = None  # the signal received outside the training loop, not yet acted on


class Terminated(BaseException):
    """SIGTERM (SLURM, `timeout`) outside the training loop; a BaseException, so no `except Exception` keeps it."""


def exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated()


def check() -> None:
    """A safe point: raise for a signal received and not yet acted on (its first raise may have been lost)."""
    if requested is not None:
        raise exception(requested)


def in_finalizer(frame) -> bool:
    """Whether `frame` runs inside a finalizer or weak-reference callback (an exception raised there is lost)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name in _FINALIZERS or code in _FINALIZER_CODES:
            return True
        frame = frame.f_back
    return False


def handle(signum, frame) -> None:
    """The handler outside the training loop: record, then raise (or send again after a finalizer)."""
    global requested
    requested = signum
    if in_finalizer(frame):
        timer = threading.Timer(AGAIN_AFTER, os.kill, (os.getpid(), signum))
        timer.daemon = True
        timer.start()
        return
    raise exception(signum)


@contextmanager
def catching(active: bool = True):
    """SIGTERM and SIGINT handled by `handle` in the block (main thread only; `active=False`: left alone)."""
    global requested
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    requested = None
    previous = {sig: signal.signal(sig, handle) for sig in NAMES}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
