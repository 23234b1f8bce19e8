"""The training loop's concerns as hooks around one loop (`runner.run.train.fit`), after Keras's `CallbackList`.

Each hook does one thing at the loop's moments: `on_train_begin()`, `on_step_begin(step)`,
`on_step_end(step, stats, seconds)` (in list order: a hook that raises stops the run there) and
`on_train_end()` (always, in list order, on success or failure). A new concern is one more hook in
`runner.run.train.fit`'s list; the loop itself does not change.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from pathlib import Path

from runner.errors import Interrupted, NonFiniteLoss, NonFiniteWeights

log = logging.getLogger("runner")


class Hook:
    """A no-op at every moment; subclasses override the ones they need."""

    def on_train_begin(self) -> None:
        pass

    def on_step_begin(self, step: int) -> None:
        pass

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        pass

    def on_train_end(self) -> None:
        pass


class Hooks(Hook):
    """Hooks called in order, as one (Keras's `CallbackList`)."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = list(hooks)

    def on_train_begin(self) -> None:
        for h in self.hooks:
            h.on_train_begin()

    def on_step_begin(self, step: int) -> None:
        for h in self.hooks:
            h.on_step_begin(step)

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        for h in self.hooks:
            h.on_step_end(step, stats, seconds)

    def on_train_end(self) -> None:
        for h in self.hooks:
            h.on_train_end()


def due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and step % every == 0)


class Profiler(Hook):
    """`train.profile_steps=[a, b]`: a TensorBoard profile of steps a..b, written into the run folder, and what held
    those steps' memory peak (`peak_breakdown.md`, from the profile's allocator trace: `runner.record.peak`)."""

    def __init__(self, steps, out: Path):
        self.window = tuple(steps) if steps else None
        self.out, self.active, self.statistics = out, False, None

    def on_step_begin(self, step: int) -> None:
        if self.window and step == self.window[0]:
            import tensorflow as tf

            tf.profiler.experimental.start(str(self.out))
            self.active = True

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        if self.active and stats.get("step_peak_bytes") is not None:
            self.statistics = max(self.statistics or 0, stats["step_peak_bytes"])
        if self.active and step >= self.window[1]:
            self.on_train_end()
            log.info(f"profile of steps {self.window[0]}-{self.window[1]} written to {self.out / 'plugins' / 'profile'}"
                     f" (TensorBoard's Profile tab)")

    def on_train_end(self) -> None:
        self.stop()

    def stop_at(self, step: int) -> Path | None:
        """Stop a running profile at `step`, before its window's end (a step that ran out of memory stops the
        run): where its breakdown was written, or None."""
        self.window = (self.window[0], step)
        return self.stop()

    def stop(self) -> Path | None:
        """Stop the profile, where one runs, and write its breakdown: where it was written, or None."""
        if not self.active:
            return None
        import tensorflow as tf

        self.active = False
        tf.profiler.experimental.stop()
        return self._write_breakdown()

    def _write_breakdown(self) -> Path | None:
        from runner.platform.files import write_atomic
        from runner.record import peak

        try:
            found = peak.read(self.out / "plugins" / "profile", self.statistics)
        except Exception as err:  # noqa: BLE001 - a diagnostic: it must not hide why the run ended
            log.warning(f"the profile's allocator trace could not be read ({type(err).__name__}: {err}): "
                        f"no peak breakdown")
            return None
        if found is None:
            log.info("the profile traced no allocation (under oneDNN it leaves out those under 256 KiB): "
                     "no peak breakdown")
            return None
        path = self.out / "peak_breakdown.md"
        first, last = self.window
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        write_atomic(path, f"# What held the peak of {steps}\n\n" + found.table())
        log.info(f"{found.headline()} (table: {path})")
        return path


class FiniteStop(Hook):
    """Stop on a NaN or Inf loss, or on weights that hold one (a NaN input can poison the weights while the loss
    still reads finite), naming the newest all-finite checkpoint."""

    def __init__(self, variables, checkpoints):
        from runner.run.finite import FiniteCheck

        self.finite, self.checkpoints = FiniteCheck(variables), checkpoints

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        newest = f"Newest all-finite checkpoint: {self.checkpoints.latest or 'none (none saved yet)'}"
        if not math.isfinite(stats["loss"]):
            raise NonFiniteLoss(f"loss is {stats['loss']} at step {step}; stopped. {newest}")
        bad = self.finite.first_bad()
        if bad:
            raise NonFiniteWeights(f"step {step}: {bad} holds NaN or Inf (loss {stats['loss']:.4g}); stopped. {newest}")


class Telemetry(Hook):
    """Each step's figures: kept for the run's summary (`history`) and written to TensorBoard."""

    def __init__(self, board, batch: int):
        self.board, self.batch, self.history = board, batch, []

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        self.history.append((stats, seconds))
        self.board.train_step(step, stats, seconds, self.batch)


class ProgressHook(Hook):
    """The progress bar (or log lines): loss, throughput and peak memory each step."""

    def __init__(self, progress, batch: int):
        self.progress, self.batch = progress, batch

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        self.progress.update(step, stats["loss"], self.batch / seconds, stats["step_peak_bytes"])

    def on_train_end(self) -> None:
        self.progress.close()


class Evaluation(Hook):
    """Every `eval_every` steps and at the last: evaluate, write the figures to TensorBoard and the progress."""

    def __init__(self, evaluate, every: int, last: int, board, progress, then=None):
        self.evaluate, self.every, self.last, self.board, self.progress = evaluate, every, last, board, progress
        self.then = then  # then(step, results) after each evaluation (the best model's file)
        self.results: dict = {}

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        if due(step, self.every, self.last):
            self.results = self.evaluate()
            self.board.scalars(step, {f"{k}/eval": v for k, v in self.results.items()})
            self.progress.write(f"eval @ step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in self.results.items()))
            if self.then:
                self.then(step, self.results)


class Checkpointing(Hook):
    """Every `checkpoint_every` steps and at the last."""

    def __init__(self, checkpoints, every: int, last: int):
        self.checkpoints, self.every, self.last = checkpoints, every, last

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        if due(step, self.every, self.last):
            self.checkpoints.save(step)


class SignalStop(Hook):
    """Ctrl-C (SIGINT) or SIGTERM (SLURM, `timeout`) asks the loop to save and stop after the current step;
    a second one aborts at once. Last in the list: the step's own checkpoint, if due, is saved already."""

    exit_code = 130
    _NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, checkpoints, checkpoint_every: int, last: int, out: Path):
        self.checkpoints, self.every, self.last, self.out = checkpoints, checkpoint_every, last, out
        self.requested: str | None = None
        self._previous = {}

    def on_train_begin(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig in self._NAMES:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.requested and signum == self._signum and time.monotonic() - self._at < 1.0:
            return  # the same signal twice at once: sent to the job and passed on by its sweep's process
        self._signum, self._at = signum, time.monotonic()
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)
        self.requested, self.exit_code = self._NAMES[signum], 128 + signum
        log.warning(f"{self.requested}: saving a checkpoint after this step (send it again to abort without saving)")

    def on_step_end(self, step: int, stats: dict, seconds: float) -> None:
        if self.requested and step < self.last:
            saved = self.checkpoints.latest if due(step, self.every, 0) else self.checkpoints.save(step)
            saved = saved or "nothing (state not finite)"
            raise Interrupted(f"{self.requested} at step {step}: saved {saved}; continue with resume={self.out}",
                              exit_code=self.exit_code)

    def on_train_end(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
