"""TensorBoard logging: one `tf.summary` writer per run folder, scalars, text and HParams."""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp


class Board:
    """Writes the run's event file into `logdir` (the run folder)."""

    def __init__(self, logdir: Path):
        self.writer = tf.summary.create_file_writer(str(logdir))

    def text(self, tag: str, body: str) -> None:
        with self.writer.as_default(step=0):
            tf.summary.text(tag, "```\n" + body + "\n```")

    def hparams(self, values: dict) -> None:
        """The run's settings for the HParams dashboard; its metrics are the run's scalars."""
        with self.writer.as_default(step=0):
            hp.hparams(values)

    def scalars(self, step: int, values: dict) -> None:
        with self.writer.as_default(step=step):
            for tag, value in values.items():
                tf.summary.scalar(tag, value)

    def train_step(self, step: int, stats: dict, seconds: float, examples: int) -> None:
        values = {"loss/train": stats["loss"], "memory/step_peak": stats["step_peak_bytes"],
                  "time/step_seconds": seconds, "throughput/examples_per_second": examples / seconds}
        for k, (peak, runs) in enumerate(zip(stats["peak_bytes"], stats["forward_runs"])):
            values[f"memory/section_{k}"] = peak
            values[f"recompute/section_{k}"] = runs
        self.scalars(step, {tag: value for tag, value in values.items() if value is not None})

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def hparam_values(cfg, choices: dict, sections) -> dict:
    """A flat `{name: bool|int|float|str}` of the run's config (and group choices), for `hp.hparams`."""
    values = {g: str(choices[g]) for g in ("model", "data", "optimizer", "engine", "train", "experiment")
              if choices.get(g) is not None}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if key == "_target_" or key == "default_sections":
                continue
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                values[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else _text(value)

    walk("", cfg)
    values["sections"] = sections if isinstance(sections, int) else _text(sections)
    return values


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) if not isinstance(v, str) else v for v in value) + "]"
    return str(value)
