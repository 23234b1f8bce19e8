"""The run record, one owner: `config.yaml` (and its history on resume), `partition.txt`, `run.json`
(command line, device, versions per session), `metrics.json`, TensorBoard text/HParams/layout, and the
console's short header and final summary.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.config.resume import history_name, show
from runner.errors import to_log_file
from runner.platform.files import keep_copy, write_atomic
from sections.rules import human_bytes
from sections.telemetry import TrainerProtocol

log = logging.getLogger("runner")


class RunRecord:
    """What a run writes about itself into its folder `out` and its TensorBoard event file."""

    def __init__(self, out: Path, cfg: DictConfig, setup, overrides: list[str], sweep: bool, start_step: int = 0):
        from runner.record.tb import Board, truncate_after

        if start_step:
            truncate_after(out, start_step)
        self.out, self.cfg, self.setup, self.overrides, self.sweep = out, cfg, setup, overrides, sweep
        self.start_step = start_step
        self.flops: list[dict] | None = None
        self.board = Board(out)

    def start(self, changes: dict) -> None:
        """Write config, partition and session record; print the short header."""
        engine, cfg, out, start_step = self.setup.engine, self.cfg, self.out, self.start_step
        config_text = OmegaConf.to_yaml(cfg, resolve=True)
        config = out / "config.yaml"
        if start_step and config.is_file() and changes:
            keep_copy(config, history_name(out))
        write_atomic(config, config_text)
        self.flops = section_flops(engine)
        table = partition_table(engine, self.flops)
        write_atomic(out / "partition.txt", table + "\n")
        session = self._session(start_step)
        record = out / "run.json"
        sessions = _sessions(record) if start_step else []
        write_atomic(record, json.dumps({"sessions": sessions + [session]}, indent=1))
        to_log_file("config:\n" + config_text)  # the log file gets the whole config; the console the header
        log.info(self.header(session["device"], table, start_step))
        for key, (before, after) in changes.items():
            if not key.startswith("optimizer."):
                log.info(f"resume: {key} {show(before)} -> {show(after)}")
        board = self.board
        board.text("config", config_text)
        board.text("partition", table)
        board.text("command", session["command"])
        board.hparams(self._hparams(), trial=self._trial(sessions + [session]))
        board.layout(len(engine.sections))

    def header(self, device: str, table: str, start_step: int) -> str:
        cfg = self.cfg
        lr = cfg.optimizer.get("learning_rate")
        strategy = self.setup.engine.strategy
        lines = [f"run folder: {self.out}" + (f" (resumed at step {start_step})" if start_step else ""),
                 f"model {_short(cfg.model._target_)}, data {_short(cfg.data._target_)}, batch {cfg.batch}"
                 + (f" (batch=max: {search.describe()})" if (search := self.setup.batch_search) else "") + ", "
                 f"{cfg.train.steps} steps, optimizer {_short(cfg.optimizer._target_)}"
                 + (f" lr {lr:g}" if isinstance(lr, (int, float)) else "") + f", engine {strategy}"
                 + (f", precision {precision}" if (precision := cfg.train.get("precision", "float32")) != "float32"
                    else ""),
                 f"device: {device}" + _topology(self.setup) + f"; {_inter_op_threads()}",
                 _memory_line(self.setup.engine),
                 *([micro] if (micro := self.setup.engine.describe_micro_batches()) else []),  # train.micro_batch
                 *([f"data: {described}"] if (described := self.setup.data.describe()) else []),
                 table,
                 f"full config: {self.out / 'config.yaml'}"]
        return "\n".join(lines)

    def exactness(self, report: dict) -> None:
        self.board.text("exactness", json.dumps(report))

    def finish(self, step: int, metrics: dict) -> None:
        metrics.setdefault("precision", self.cfg.train.get("precision", "float32"))  # reports compare by it
        self.board.final(step, metrics)
        self.board.close()
        write_atomic(self.out / "metrics.json", json.dumps(metrics, indent=1))
        to_log_file("metrics: " + json.dumps(metrics))
        log.info(summary(metrics) + f"\nrun folder: {self.out}\nTensorBoard: {tensorboard_hint(self.out, self.sweep)}")

    def close(self, quietly: bool = False) -> None:
        """Close the event file; `quietly` (the run is failing already): a failure to flush is only logged."""
        from runner.errors import RunnerError

        try:
            self.board.close()
        except RunnerError as err:
            if not quietly:
                raise
            log.warning(str(err))

    def _session(self, start_step: int) -> dict:
        import hydra
        import keras
        import tensorflow as tf

        argv = sys.argv[1:] if Path(sys.argv[0]).name == "__main__.py" else None
        command = shlex.join(["python", "-m", "runner", *argv]) if argv is not None else shlex.join(sys.argv)
        return {"command": command, "overrides": self.overrides, "cwd": os.getcwd(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "start_step": start_step, "device": device_name(), "host": platform.node(),
                "versions": {"python": platform.python_version(), "tensorflow": tf.__version__,
                             "keras": keras.__version__, "hydra": hydra.__version__}}

    def _hparams(self) -> dict:
        from runner.record.tb import hparam_values

        cfg = self.cfg
        choices = {"model": _short(cfg.model._target_), "data": _short(cfg.data._target_),
                   "optimizer": _short(cfg.optimizer._target_),
                   "engine": self.setup.engine.strategy}
        return hparam_values(OmegaConf.to_container(cfg, resolve=True), choices, self.setup.sections)

    def _trial(self, sessions: list[dict]) -> str:
        """The first session's overrides (the run's identity in a sweep), else the folder's name."""
        shown = [o for o in sessions[0].get("overrides", []) if not o.startswith(("hydra", "resume="))]
        return " ".join(shown) or self.out.name


def _sessions(record: Path) -> list:
    """The sessions `run.json` lists (none if it is missing or was cut short)."""
    try:
        return json.loads(record.read_text()).get("sessions", [])
    except (OSError, ValueError, AttributeError):
        return []


def partition_table(engine: TrainerProtocol, flops: list[dict] | None) -> str:
    """The engine's partition table, with FLOPs per section when the engine can count them."""
    table = engine.describe()
    if flops and "flops" not in table.lower():  # the engine's own table may already list them
        table += "\nFLOPs per step: " + ", ".join(
            f"section {k} forward {f['forward']:.3g} backward {f['backward']:.3g}" for k, f in enumerate(flops))
    return table


def section_flops(engine: TrainerProtocol) -> list[dict] | None:
    """`engine.flops()` (forward/backward FLOPs per section, TensorFlow's cost analysis), where the trainer counts
    them (None: a baseline)."""
    tf_log = logging.getLogger("tensorflow")
    level = tf_log.level
    tf_log.setLevel(logging.ERROR)  # the cost analysis goes through TF1 APIs that log deprecation warnings
    try:
        flops = engine.flops()
        return None if flops is None else [dict(f) for f in flops]
    except Exception as err:  # cost analysis is best effort: a missing figure must not stop a run
        log.warning(f"FLOPs not available: {type(err).__name__}: {err}")
        return None
    finally:
        tf_log.setLevel(level)


def _topology(setup) -> str:
    """`, distribute: 2 replicas on CPU:0, CPU:1` under a strategy; nothing on one device."""
    strategy = setup.strategy
    if strategy is None:
        return ""
    from runner.platform import distribute

    info = distribute.summary(strategy)
    workers = f" over {info['workers']} workers" if info["workers"] > 1 else ""
    return f", distribute: {info['replicas']} replicas{workers} (this process: {', '.join(info['devices'])})"


def device_name() -> str:
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        return f"{len(gpus)} x GPU {details.get('device_name', gpus[0].name)}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {cpu}, {os.cpu_count()} cores (no GPU)"


def _inter_op_threads() -> str:
    import tensorflow as tf

    n = tf.config.threading.get_inter_op_parallelism_threads()
    return f"inter-op threads: {n}" if n else "inter-op threads: TensorFlow's default (one per core)"


def _memory_line(engine: TrainerProtocol) -> str:
    """Where memory is measured, or that it is not, and the CPU allocator setting in effect."""
    from sections.allocator import describe

    meter = engine.meter
    if meter.available:
        where = f"memory: measured on {', '.join(meter.devices)}"
        device = engine.device_memory
        if device is not None:
            where += f"; device memory {device.describe()}"
        if engine.budget_source:
            where += f"; budget {human_bytes(engine.memory_budget)} ({engine.budget_source})"
    else:
        where = "memory: NOT MEASURED (the allocator keeps no statistics; set TF_CPU_ALLOCATOR_USE_BFC=true)"
    return f"{where}; {describe(os.environ)}"


def summary(metrics: dict) -> str:
    """The final figures as a short two-column table."""
    metric = metrics.get("metric")
    rows = [("step", metrics.get("step")), ("train loss", _num(metrics.get("loss"))),
            ("eval loss", _num(metrics.get("eval_loss")))]
    if metric and metric != "eval_loss":
        rows.append((f"eval {metric}", _num(metrics.get(metric))))
    rows += [("median step", f"{metrics['median_step_seconds']:.4g} s" if metrics.get("median_step_seconds")
              else "-"),
             ("examples/s", _num(metrics.get("examples_per_second"), ".0f")),
             ("step peak", human_bytes(metrics["step_peak_bytes"]) if metrics.get("step_peak_bytes") is not None
              else f"not measured ({metrics.get('memory_note') or 'the allocator keeps no statistics'})"),
             ("forward runs", metrics.get("forward_runs_per_section"))]
    if "rerun_flops" in metrics:
        rows.append(("re-run FLOPs", f"{metrics['rerun_flops']:.3g}"))
    if "exact" in metrics:
        rows.append(("exact", "not checked (does not fit the device)" if metrics["exact"] is None
                     else "yes" if metrics["exact"] else "NO"))
    width = max(len(k) for k, _ in rows)
    return "done:\n" + "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def tensorboard_hint(out: Path, sweep: bool) -> str:
    """A command that works as printed: the tensorboard beside this Python (the venv's), relative if possible."""
    return tensorboard_command(out.parent if sweep else _outputs_root(out))


def tensorboard_command(logdir: Path) -> str:
    script = Path(sys.executable).with_name("tensorboard")
    command = str(_relative(script)) if script.is_file() else f"{_relative(Path(sys.executable))} -m tensorboard.main"
    return f"{command} --logdir {shlex.quote(str(_relative(Path(logdir))))}"


def _relative(path: Path) -> Path:
    try:
        return Path(os.path.relpath(path)) if Path(path).resolve().is_relative_to(Path.cwd()) else path
    except ValueError:
        return path


def _outputs_root(out: Path) -> Path:
    """`outputs` for `outputs/<date>/<time>`, else the run folder's parent."""
    return out.parent.parent if out.parent.parent.name == "outputs" else out.parent


def _short(target: str) -> str:
    name = str(target).rsplit(".", 1)[-1]
    return name[len("build_"):] if name.startswith("build_") else name


def _num(value, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)
