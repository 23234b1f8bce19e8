"""Run state in a `tf.train.Checkpoint`: network, optimizer state, data position and step."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

from runner.errors import ConfigError


class Checkpoints:
    """Saves to `<run>/checkpoints` every so often; restores the latest one of another run folder.

    Args:
        directory: where this run's checkpoints go.
        engine: a built `sections.Engine` (its network layers and optimizer variables exist).
        iterator: the training data iterator, so a resumed run sees the batches an uninterrupted run would.
        keep: how many checkpoints to keep.
    """

    def __init__(self, directory: Path, engine, iterator, keep: int):
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="step")
        self.checkpoint = tf.train.Checkpoint(step=self.step, optimizer=engine.optimizer,
                                              network=list(engine.network.layers), data=iterator)
        self.manager = tf.train.CheckpointManager(self.checkpoint, str(directory), max_to_keep=keep)

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def save(self, step: int) -> str:
        self.step.assign(step)
        return self.manager.save(checkpoint_number=step)

    def restore(self, run_folder: str | Path) -> int:
        """Load the latest checkpoint of `run_folder`; returns its step."""
        path = tf.train.latest_checkpoint(str(Path(run_folder) / "checkpoints"))
        if path is None:
            raise ConfigError("resume", run_folder, "that run folder holds no checkpoint")
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError, tf.errors.OpError) as err:
            first = str(err).strip().splitlines()[0]
            raise ConfigError("resume", run_folder, f"its checkpoint does not fit this model/data: {first}") from err
        return int(self.step.numpy())
