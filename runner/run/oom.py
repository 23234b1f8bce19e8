"""What held memory when a training step ran out of it (`train.oom_breakdown`, default true).

The failing step's batch runs once more under TensorFlow's profiler, into `<run>/oom_profile/` (apart from a
`train.profile_steps` profile in `<run>/plugins/profile/`: `peak.read` takes a folder's newest trace), and the
allocator trace, read at the moment the most was in use (`runner.record.peak`), goes to `<run>/peak_breakdown.md`.
The run is stopping: nothing the re-run changes is saved (with `engine.apply=in_backward` some sections may have
stepped in the failed step and step again here). It is a diagnostic: whatever goes wrong in it ends the stop line
as "no peak breakdown: <why>" and never replaces the stop.
"""

from __future__ import annotations

import gc
import logging
import shutil
from pathlib import Path

log = logging.getLogger("runner")

FOLDER = "oom_profile"
TABLE = "peak_breakdown.md"


class NoBreakdown(Exception):
    """Why no breakdown was made, in a few words."""


class OomBreakdown:
    """`oom_breakdown(step, batch)`: the end of the out-of-memory stop line (where the table is, or why there is
    none). `profiler`: the run's `Profiler` hook (a running profile already traces the failing step: it is stopped
    there and its table named, without a re-run); `workers`: processes training together (a re-run on one would
    leave the others waiting on it)."""

    def __init__(self, engine, out: Path, enabled: bool = True, profiler=None, workers: int = 1):
        self.engine, self.out, self.enabled, self.profiler, self.workers = engine, Path(out), enabled, profiler, workers

    def __call__(self, step: int, batch) -> str:
        if not self.enabled:
            return ""
        try:
            return f"; what held memory: {self._made(step, batch)}"
        except NoBreakdown as why:
            return f"; no peak breakdown: {why}"
        except Exception as err:  # noqa: BLE001 - the diagnostic must not hide the stop
            from runner.platform.files import first_line

            return f"; no peak breakdown: {type(err).__name__}: {first_line(err)}"

    def _made(self, step: int, batch) -> Path:
        if self.profiler is not None and self.profiler.active:
            path = self.profiler.stop_at(step)
            if path is None:
                raise NoBreakdown("the running train.profile_steps profile gave none (see the log)")
            return path
        if self.workers > 1:
            raise NoBreakdown(f"not re-run on one of {self.workers} workers (the others would wait on it)")
        log.info(f"step {step} ran out of memory: running it once more under the profiler, for what held memory")
        failed = rerun(self.engine, batch, self.out / FOLDER)
        return write(self.out / TABLE, step, failed, self.out / FOLDER)


def rerun(engine, batch, folder: Path):
    """`batch`'s step once more, profiled into `folder` (emptied first); the `OutOfMemory` it ends with."""
    import tensorflow as tf

    from sections import OutOfMemory

    shutil.rmtree(folder, ignore_errors=True)  # an earlier stop's trace in this folder would be read as this one's
    gc.collect()  # what the failed step left to the collector
    tf.profiler.experimental.start(str(folder))
    try:
        # sections=auto would re-plan it: its dry steps, not the failing step, would be the trace's peak
        engine.train_step(batch, replan=False)
    except OutOfMemory as err:
        return err
    finally:
        tf.profiler.experimental.stop()
    raise NoBreakdown("its re-run under the profiler did not run out of memory")


def write(path: Path, step: int, failed, folder: Path) -> Path:
    """The table of what `folder`'s trace held at its peak, titled for `step`; `failed`: the re-run's
    `OutOfMemory`."""
    from runner.platform.files import write_atomic
    from runner.record import peak

    found = peak.read(folder, failed.in_use or None)
    if found is None:
        raise NoBreakdown("the profile traced no allocation")
    write_atomic(path, document(step, failed, found, folder.name))
    return path


def document(step: int, failed, found, folder: str) -> str:
    return (f"# What held memory when step {step} ran out of the device's memory\n\n"
            f"The step's batch, run once more under TensorFlow's profiler (`{folder}/`), ran out again: {failed}. "
            f"Below: what was live at the moment the most was in use (the failing allocation is not in the trace: "
            f"it was never made).\n\n" + found.table())
