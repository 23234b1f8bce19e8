"""`python tests/stop_worker.py MOMENT [runner overrides]`: `python -m runner` with a stop at a chosen moment of a
`batch=max` search, made deterministic by a hook rather than a sleep:

- `term-in-finalizer-at-trial-end`: as trial 1's engine is freed, a finalizer (`__del__`, as TensorFlow's
  `ConcreteFunctionGarbageCollector.__del__` is) sends SIGTERM from inside itself;
- `int-in-finalizer-while-planning`: Ctrl-C (SIGINT) from a finalizer that runs inside trial 2's engine build;
- `kill-after-trial-2`: kill -9 as soon as trial 2's line is in the run folder.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from sections.allocator import configure

configure()  # as `python -m runner` does, before anything could load TensorFlow

moment = sys.argv.pop(1)


class SendsFromItsFinalizer:
    """Its `__del__` raises `sig` in this process: Python runs the handler right there, inside the finalizer."""

    def __init__(self, sig):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)


def in_a_finalizer(sig) -> None:
    SendsFromItsFinalizer(sig)  # dropped at once: its finalizer runs here


if moment == "term-in-finalizer-at-trial-end":
    from runner.run import batch_max

    real_gc = batch_max.gc

    class Gc:
        calls = 0

        @staticmethod
        def collect(*args):
            Gc.calls += 1
            if Gc.calls == 2:  # trial 1's engine freed (the first collect frees the kept one before it is kept)
                in_a_finalizer(signal.SIGTERM)
            return real_gc.collect(*args)

    batch_max.gc = Gc
elif moment == "int-in-finalizer-while-planning":
    from runner.run import build

    real_make_engine = build.make_engine
    made = []

    def make_engine(*args, **kwargs):
        made.append(1)
        if len(made) == 2:
            in_a_finalizer(signal.SIGINT)
        return real_make_engine(*args, **kwargs)

    build.make_engine = make_engine
elif moment == "kill-after-trial-2":
    from runner.run import batch_max

    real_append = batch_max.append_trial

    def append_trial(folder, record):
        real_append(folder, record)
        if record["trial"] == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    batch_max.append_trial = append_trial
else:
    raise SystemExit(f"unknown moment {moment}")

sys.argv[0] = "runner"
runpy.run_module("runner", run_name="__main__", alter_sys=True)
