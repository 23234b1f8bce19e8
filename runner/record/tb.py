"""TensorBoard logging: one `tf.summary` writer per run folder; scalars, text, HParams and a custom-scalars layout.

Tags (memory in MiB, the unit in the tag; a step's tags are named once, in `sections.telemetry`):
    loss/train, loss/eval, <metric>/eval          training loss each step; eval figures
    memory_MiB/step_peak, memory_MiB/section_<k>  allocator peak over the step, and during section k's backward
    forward_runs/section_<k>                      forward executions of section k in the step: 1 = ran once,
                                                  2 = its forward was re-run once in the backward
    time/step_seconds, throughput/examples_per_second
    final/<figure>                                 the few end figures worth comparing across runs
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import tensorflow as tf
from tensorboard.plugins.hparams import api as hp

from runner.platform.files import first_line, write_error
from sections import telemetry

log = logging.getLogger("runner")

FINAL = ("loss", "eval_loss", "median_step_seconds", "examples_per_second", "step_peak_MiB")


def _one_line_errors(method):
    """A failed write of the event file (full disk, folder gone) stops the run in one line, not a traceback."""

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        if self.failed:
            return None
        try:
            return method(self, *args, **kwargs)
        except (tf.errors.OpError, OSError) as err:
            self.failed = True
            raise write_error(f"the TensorBoard event file in {self.logdir}", err) from err

    return wrapped


class Board:
    """Writes the run's event file into `logdir` (the run folder)."""

    def __init__(self, logdir: Path):
        self.logdir, self.failed = Path(logdir), False
        self.writer = tf.summary.create_file_writer(str(logdir))

    @_one_line_errors
    def text(self, tag: str, body: str) -> None:
        with self.writer.as_default(step=0):
            tf.summary.text(tag, "```\n" + body + "\n```")

    @_one_line_errors
    def hparams(self, values: dict, trial: str) -> None:
        """The run's settings for the HParams dashboard, the trial named `trial`; its metrics are the scalars."""
        with self.writer.as_default(step=0):
            hp.hparams(values, trial_id=trial)

    @_one_line_errors
    def layout(self, sections: int) -> None:
        """Custom Scalars: all sections' memory in one chart, all sections' forward runs in another."""
        from tensorboard.plugins.custom_scalar import layout_pb2
        from tensorboard.plugins.custom_scalar import summary as custom_scalar

        def chart(title: str, regex: str):
            return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=[regex]))

        layout = layout_pb2.Layout(category=[layout_pb2.Category(title=f"sections ({sections})", chart=[
            chart("peak memory during each section's backward (MiB)", telemetry.SECTION_PEAK_TAGS),
            chart("forward runs per section (1 = once, 2 = re-run once)", telemetry.FORWARD_RUNS_TAGS),
            chart("step peak memory (MiB)", telemetry.STEP_PEAK),
        ])])
        with self.writer.as_default(step=0):
            tf.summary.experimental.write_raw_pb(custom_scalar.pb(layout).SerializeToString(), step=0)

    @_one_line_errors
    def scalars(self, step: int, values: dict) -> None:
        with self.writer.as_default(step=step):
            for tag, value in values.items():
                if value is not None:
                    tf.summary.scalar(tag, value)

    def train_step(self, step: int, stats: telemetry.StepReading, seconds: float, examples: int) -> None:
        """The step's readings under their tags (``sections.telemetry``), its time and throughput."""
        self.scalars(step, {**stats.scalars(), "time/step_seconds": seconds,
                            "throughput/examples_per_second": examples / seconds})

    @_one_line_errors
    def final(self, step: int, metrics: dict) -> None:
        """`final/*`: the loss, the eval metric, speed and peak memory: what a sweep compares."""
        figures = {**metrics, "step_peak_MiB": telemetry.mib(metrics.get("step_peak_bytes"))}
        names = [*FINAL[:2], metrics.get("metric"), *FINAL[2:]]
        self.scalars(step, {f"final/{k}": figures.get(k) for k in dict.fromkeys(n for n in names if n)
                            if isinstance(figures.get(k), (int, float)) and not isinstance(figures.get(k), bool)})

    def close(self) -> None:
        """Flush and close; after a failed write (already reported) a second failure is only logged."""
        try:
            self.writer.close()
        except (tf.errors.OpError, OSError) as err:
            if not self.failed:
                self.failed = True
                raise write_error(f"the TensorBoard event file in {self.logdir}", err) from err
            log.debug(f"closing the event file after a failed write: {first_line(err)}")


TRIM = ".truncating"


def truncate_after(folder: Path, step: int) -> None:
    """Drop events after `step` from the folder's event files: what a killed run logged past its checkpoint,
    which the resumed run logs again, so TensorBoard shows one continuous set of curves.

    Each file is rewritten aside (`<name>.truncating`) and moved over the original in one step; a leftover of a
    trim that was killed or ran out of space is removed first (the original it was copied from is still whole)."""
    from tensorboard.compat.proto.event_pb2 import Event

    recover_trims(folder)
    for path in sorted(p for p in Path(folder).glob("events.out.tfevents.*") if not p.name.endswith(TRIM)):
        records = []
        try:
            for r in tf.data.TFRecordDataset(str(path)):
                records.append(bytes(r.numpy()))
        except tf.errors.DataLossError:  # the last record was cut short by the kill (or a full disk)
            records.append(b"")
        kept = [r for r in records if r and Event.FromString(r).step <= step]
        if len(kept) < len(records):
            temp = path.with_name(path.name + TRIM)
            try:
                with tf.io.TFRecordWriter(str(temp)) as writer:
                    for r in kept:
                        writer.write(r)
                temp.replace(path)
            except (tf.errors.OpError, OSError) as err:
                temp.unlink(missing_ok=True)
                raise write_error(f"{temp} (the event file without the steps after {step})", err) from err


def recover_trims(folder: Path) -> None:
    """Leftovers of an interrupted trim: removed where the original is there, else put in its place."""
    for temp in Path(folder).glob(f"events.out.tfevents.*{TRIM}"):
        original = temp.with_name(temp.name[: -len(TRIM)])
        if original.exists():
            temp.unlink()
            log.info(f"removed {temp.name}, the leftover of an interrupted event-file trim ({original.name} is whole)")
        else:
            temp.replace(original)
            log.warning(f"{original.name} was missing; its trimmed copy {temp.name} takes its place")


def hparam_values(cfg: dict, choices: dict, sections) -> dict:
    """A flat `{name: bool|float|str}` of the run's config (and group choices), for `hp.hparams`.

    Integers are written as text: the HParams dashboard shows every number as a float (7500.0)."""
    values = {g: str(v) for g, v in choices.items() if v is not None}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if key in ("_target_", "default_sections", "resume"):
                continue
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                values[f"{prefix}{key}"] = _hparam(value)

    walk("", cfg)
    values["sections"] = _hparam(sections)
    return values


def _hparam(value):
    if isinstance(value, bool) or isinstance(value, float):
        return value
    if isinstance(value, int):
        return str(value)
    return _text(value)


def _text(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) if not isinstance(v, str) else v for v in value) + "]"
    return str(value)
