"""Run state in a `tf.train.Checkpoint`: network, seed-generator states, optimizer state, data position, step.

Only all-finite state is saved, a broken newest checkpoint falls back to the newest readable one, leftover
`_temp` folders of a killed save are removed, and a failed write stops the run in one line.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import tensorflow as tf

from runner.errors import ConfigError, RunnerError
from sections.tf_compat import checkpoint_state_parses, write_checkpoint_state

log = logging.getLogger("runner")
_NUMBERED = re.compile(r"^ckpt-(\d+)\.index$")
_OP_NOISE = re.compile(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]")


class CheckpointWriteError(RunnerError):
    """A checkpoint could not be written (read-only folder, disk full): the run stops, earlier ones are kept."""


class Checkpoints:
    """Saves to `directory` every so often and restores the newest readable checkpoint found there.

    Args:
        directory: the run's `checkpoints/` folder.
        engine: a built `sections.Engine` (its network layers and optimizer variables exist).
        iterator: the training data iterator, so a resumed run sees the batches an uninterrupted run would.
        keep: how many checkpoints to keep.
    """

    def __init__(self, directory: Path, engine, iterator, keep: int):
        self.directory = Path(directory)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self._optimizer = engine.optimizer
        # `network.variables` lists every layer's state, seed-generator states included, which the layers'
        # own checkpoint dependencies leave out (a SeedGenerator is not a trackable object).
        self._variables = list(engine.network.variables)
        self._objects = dict(step=self.step, optimizer=engine.optimizer, network=list(engine.network.layers),
                             data=iterator)
        self.checkpoint = tf.train.Checkpoint(**self._objects, variables=self._variables)
        self.keep = keep
        self.manager = self._manager()
        self._latest: str | None = None

    def _manager(self) -> tf.train.CheckpointManager:
        state = self.directory / "checkpoint"
        if state.is_file() and not _parses(state):  # the numbered files are what count; TF would log 2 lines
            log.warning(f"{state} (the list of checkpoints) is unreadable; rebuilding it from the checkpoint files "
                        f"in the folder")
            state.unlink()
        if not state.is_file() and self.numbered():
            self._rebuild_state()  # else the manager would never prune the checkpoints already there
        return tf.train.CheckpointManager(self.checkpoint, str(self.directory), max_to_keep=self.keep)

    def _rebuild_state(self) -> None:
        """Write the `checkpoint` state file listing the checkpoints on disk, oldest first, so that the manager
        counts them towards `keep` (it prunes only what its state lists)."""
        found = sorted(self.numbered())
        stamps = [prefix.with_suffix(".index").stat().st_mtime for _, prefix in found]
        write_checkpoint_state(str(self.directory), str(found[-1][1]), [str(p) for _, p in found], stamps,
                               last_preserved_timestamp=min(stamps) - 1)

    @property
    def latest(self) -> str | None:
        """The newest checkpoint this run saved or restored (always all-finite)."""
        return self._latest

    def save(self, step: int) -> str | None:
        """Save at `step`, unless some variable or optimizer slot is NaN/Inf (then warn and return None)."""
        bad = self.nonfinite()
        if bad:
            log.warning(f"step {step}: {bad} holds NaN or Inf; checkpoint not saved "
                        f"(newest all-finite one: {self.latest or 'none'})")
            return None
        self._remove_leftovers()
        self.step.assign(step)
        try:
            self._latest = self.manager.save(checkpoint_number=step)
            return self._latest
        except (tf.errors.OpError, OSError) as err:
            self._remove_leftovers()
            raise CheckpointWriteError(f"could not write the step-{step} checkpoint in {self.directory}: "
                                       f"{_first_line(err)}; stopped, earlier checkpoints kept "
                                       f"(newest: {self.latest or 'none'})") from err

    def nonfinite(self) -> str | None:
        """The name of the first float variable or optimizer slot holding NaN or Inf, else None."""
        for v in self._variables + list(self._optimizer.variables):
            if tf.as_dtype(v.dtype).is_floating and not bool(tf.reduce_all(tf.math.is_finite(v))):
                return getattr(v, "path", None) or v.name
        return None

    def numbered(self, directory: Path | None = None) -> list[tuple[int, Path]]:
        """(step, prefix) of every checkpoint file set in the folder, newest first."""
        directory = Path(directory or self.directory)
        if not directory.is_dir():
            return []
        found = [(int(m.group(1)), directory / f"ckpt-{m.group(1)}")
                 for p in directory.iterdir() if (m := _NUMBERED.match(p.name))]
        return sorted(found, reverse=True)

    def restore(self, directory: Path | None = None) -> tuple[int, str]:
        """Load the newest readable checkpoint of the folder (or of `directory`); returns (its step, its path).

        A checkpoint that cannot be read is named in a warning and the previous one is tried."""
        failures = []
        for step, prefix in self.numbered(directory):
            try:
                self._restore(prefix)
            except Exception as err:  # noqa: BLE001 - a truncated file raises IndexError, others OpError
                failures.append(f"{prefix.name}: {_first_line(err)}")
                log.warning(f"checkpoint {prefix} is unreadable or does not fit this run ({_first_line(err)}); "
                            f"trying the previous one")
                continue
            if failures:
                log.warning(f"resuming from {prefix.name}, the newest readable checkpoint")
            self._latest = str(prefix)
            return int(self.step.numpy()), str(prefix)
        folder = Path(directory or self.directory).parent
        if not failures:
            raise ConfigError("resume", folder, "that run folder holds no checkpoint")
        raise ConfigError("resume", folder, "no checkpoint there can be read into this model/data: "
                          + "; ".join(failures))

    def _restore(self, prefix: Path) -> None:
        try:
            self.checkpoint.restore(str(prefix)).assert_existing_objects_matched()
            return
        except Exception:
            if not _without_variables(prefix):
                raise
        # written by an earlier runner, before every variable (seed-generator states) was saved
        tf.train.Checkpoint(**self._objects).restore(str(prefix)).assert_existing_objects_matched()
        log.warning(f"{prefix.name} predates checkpointed seed-generator states; resuming without them (dropout "
                    f"or sampling will not repeat the uninterrupted run's draws)")

    def _remove_leftovers(self) -> None:
        """`ckpt-N_temp/` folders that a killed or failed save left behind."""
        if self.directory.is_dir():
            for path in self.directory.glob("*_temp*"):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def _without_variables(prefix: Path) -> bool:
    try:
        return not any(name.startswith("variables/") for name, _ in tf.train.list_variables(str(prefix)))
    except Exception:  # noqa: BLE001 - unreadable: not a legacy checkpoint, a broken one
        return False


def _parses(state: Path) -> bool:
    try:
        text = state.read_text(errors="strict")
    except (OSError, UnicodeDecodeError):  # undecodable bytes
        return False
    return checkpoint_state_parses(text)  # the proto's text format


def _first_line(err: BaseException) -> str:
    """The error's first line without TensorFlow's `{{function_node ...}}` and `[Op:...]` wrapping."""
    text = str(err).strip() or type(err).__name__
    text = _OP_NOISE.sub("", text.splitlines()[0]).strip()
    return text[:300]
