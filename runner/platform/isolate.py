"""A sweep job in a process of its own (forked from the launcher's), so that a job whose process dies (kill -9,
the kernel's out-of-memory killer, a crash in native code) is recorded as failed with the cause and the sweep goes
on with the next job, with any launcher (basic, joblib, submitit). Each job also starts from a clean TensorFlow.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Callable

log = logging.getLogger("runner")


def available() -> bool:
    """Fork only where it is safe: POSIX, and TensorFlow's runtime not started in this process (its thread pools
    hold locks a forked child would wait on forever: seen when a test process that had trained forked a job)."""
    return hasattr(os, "fork") and not _tensorflow_started()


def _tensorflow_started() -> bool:
    if "tensorflow" not in sys.modules:
        return False
    from sections.tf_compat import runtime_started

    return runtime_started()  # unknown: started (do not fork)


def run_in_child(job: Callable[[], float], record: Callable[[dict], None], describe: str) -> float:
    """`job()` in a forked child; returns its value. If the child dies without one, `record({...})` notes the
    cause (status and error) and NaN is returned; a signal that stopped the sweep stops this process too."""
    from runner.platform.quiet import preload_tensorflow

    preload_tensorflow()  # once in this process, not once per job
    read, write = os.pipe()
    _flush()
    pid = os.fork()
    if pid == 0:  # the child: run the job, hand back its value, leave without the parent's exit handlers
        os.close(read)
        code = 0
        try:
            os.write(write, json.dumps({"value": job()}).encode())
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else 1
        except BaseException:  # noqa: BLE001 - guarded() reports failures itself; this is a last resort
            traceback.print_exc()
            code = 1
        finally:
            _flush()
            os._exit(code)
    os.close(write)
    with _forwarding(pid) as received:
        status = _wait(pid)
    with os.fdopen(read, "rb") as f:
        answer = f.read()
    if os.WIFEXITED(status) and answer:
        if received:  # this process was signalled while the job finished: the sweep stops after it
            sys.exit(128 + received[0])
        value = json.loads(answer)["value"]
        return float("nan") if value is None else value
    if os.WIFSIGNALED(status):
        sig = signal.Signals(os.WTERMSIG(status))
        cause = f"killed by {sig.name}" + (" (kill -9, or the kernel's out-of-memory killer: `dmesg` says which)"
                                            if sig == signal.SIGKILL else "")
    else:
        code = os.WEXITSTATUS(status)
        if code in (130, 143):  # Ctrl-C or SIGTERM: the job saved and reported it; the sweep stops here
            sys.exit(code)
        cause = f"exited with code {code} without a result"
    message = f"{describe}: its process (PID {pid}) {cause}"
    log.error(message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    stopped = received and received[0]
    record({"status": "interrupted" if stopped else "failed", "error": message})
    if stopped:
        sys.exit(128 + stopped)
    return float("nan")


def _wait(pid: int) -> int:
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


@contextmanager
def _forwarding(pid: int):
    """While the child runs: SIGTERM is passed on to it; Ctrl-C is left to it (the terminal sends it to both)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum, frame):
        received.append(signum)
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    def note(signum, frame):
        received.append(signum)

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, forward), signal.SIGINT: signal.signal(signal.SIGINT, note)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001 - a full disk must not stop the hand-over
            pass
