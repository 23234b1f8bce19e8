"""How a job ends: its value, or one short error line and an exit code; a failed sweep job lets the sweep go on."""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Callable

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.hydra_callbacks import JOB_STATUS
from runner.errors import Interrupted, RunnerError, full_errors, report
from runner.platform import stops
from runner.platform.stops import Terminated  # noqa: F401  (its home before runner.platform.stops)

log = logging.getLogger("runner")


def guarded(job: Callable[[DictConfig, Path], float], cfg: DictConfig) -> float:
    """Run `job(cfg, output_dir)`. In a sweep, a failure is recorded in the job folder and returns NaN."""
    hc = HydraConfig.get()
    out = Path(hc.runtime.output_dir)
    sweep = hc.mode == RunMode.MULTIRUN
    status = {"overrides": list(hc.overrides.task)}
    _log_files_survive_a_full_disk()
    if sweep:  # `resume=<sweep folder>`: what this job's folder holds from the sweep's earlier run
        from runner.hydra_callbacks import earlier_attempt

        try:
            attempt, value = earlier_attempt(out, status["overrides"])
        except RunnerError as err:  # its status.json is the other job's: left as it is
            report(err)
            return _failed_value()
        if attempt == "kept":
            log.info(f"sweep job {out.name}: completed in the sweep's earlier run; kept")
            return float("nan") if value is None else value
        if attempt == "resume":
            from omegaconf import open_dict, read_write

            with read_write(cfg), open_dict(cfg):
                cfg.resume = str(out)
            log.info(f"sweep job {out.name}: interrupted in the sweep's earlier run; continues from its newest "
                     f"checkpoint")
    from runner.platform import isolate

    if sweep and isolate.available():
        return isolate.run_in_child(lambda: _guarded(job, cfg, out, sweep, status),
                                    lambda outcome: _write(out, sweep, status | outcome), f"sweep job {out}")
    return _guarded(job, cfg, out, sweep, status)


def _guarded(job, cfg: DictConfig, out: Path, sweep: bool, status: dict) -> float:
    try:
        with _signals_before_the_loop(sweep):
            value = job(cfg, out)
    except (KeyboardInterrupt, Terminated) as signalled:  # before the training loop handles them (or a second one)
        name, code = ("SIGTERM", 143) if isinstance(signalled, Terminated) else ("Ctrl-C", 130)
        err = Interrupted(f"{name}: {_kept(Path(str(cfg.resume)) if cfg.get('resume') else out)}", exit_code=code)
        report(err)
        _write(out, sweep, status | {"status": "interrupted", "error": str(err)})
        sys.exit(code)
    except Interrupted as err:
        report(err)
        _write(out, sweep, status | {"status": "interrupted", "error": str(err)})
        sys.exit(err.exit_code)
    except RunnerError as err:
        if full_errors():
            raise
        report(err)
        _write(out, sweep, status | {"status": "failed", "error": str(err)})
        if sweep:
            return _failed_value()
        sys.exit(err.exit_code)
    except Exception as err:
        from runner.platform.files import no_space, write_error

        if no_space(err) and not full_errors():  # a write this runner does not make itself (Hydra's, TF's)
            failure = write_error(f"into {out}", err)
            report(failure)
            _write(out, sweep, status | {"status": "failed", "error": str(failure)})
            if sweep:
                return _failed_value()
            sys.exit(failure.exit_code)
        if not sweep:
            raise
        (out / "error.txt").write_text(traceback.format_exc())
        log.error(f"job failed: {type(err).__name__}: {err} (traceback in {out / 'error.txt'})")
        _write(out, sweep, status | {"status": "failed", "error": f"{type(err).__name__}: {err} (see error.txt)"})
        return _failed_value()
    _write(out, sweep, status | {"status": "completed", "value": value, "metric": _metric_name(out)})
    return value


def _log_files_survive_a_full_disk() -> None:
    """A log file that cannot be written (full disk) is closed with one warning on stderr, not a traceback per
    message; the console keeps logging, and the run reports its own failure in one line."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and not getattr(handler, "_runner_guarded", False):
            handler._runner_guarded = True
            handler.handleError = _give_up_on(handler, handler.handleError)


def _give_up_on(handler: logging.FileHandler, default):
    def handle_error(record):
        err = sys.exc_info()[1]
        if not isinstance(err, OSError):
            return default(record)
        if handler.level > logging.CRITICAL:
            return  # said once already
        handler.setLevel(logging.CRITICAL + 1)  # nothing more goes to it through the loggers
        print(f"warning: {handler.baseFilename}: {err.strerror or err}; the log file stops here", file=sys.stderr,
              flush=True)

    return handle_error


def _signals_before_the_loop(sweep: bool):
    """SIGTERM raises Terminated (not a silent exit), Ctrl-C KeyboardInterrupt, also where they land in a finalizer
    (`runner.platform.stops`), until the training loop installs its own handlers."""
    return stops.catching(active=not sweep)


def _kept(out: Path) -> str:
    """What a run stopped before its training loop (or between its steps' hooks) keeps, and how to go on."""
    saved = sorted((out / "checkpoints").glob("ckpt-*.index"), key=lambda p: int(p.stem.split("-")[1]))
    if saved:
        return f"stopped without saving; resume={out} continues from {saved[-1].with_suffix('')}"
    from runner.platform.journal import TRIALS, recorded_trials

    n = len(recorded_trials(out))
    if n:
        return (f"stopped during the batch=max search; its {n} trial{'s' if n > 1 else ''} "
                f"{'are' if n > 1 else 'is'} kept in {out / TRIALS}: resume={out} continues it")
    return "stopped without saving; nothing was saved"


def _failed_value() -> float:
    """What a failed sweep job returns: NaN, or for Optuna (whose study rejects NaN, and whose Hydra plugin then
    stops the sweep) the worst value in the study's direction, so the trial counts as the worst and the study goes
    on. The job's status.json says it failed either way, and the sweep's summary lists it."""
    sweeper = HydraConfig.get().sweeper
    if "optuna" not in str(sweeper.get("_target_", "")).lower():
        return float("nan")
    direction = sweeper.get("direction", "minimize")
    direction = direction[0] if not isinstance(direction, str) else direction  # multi-objective: the first
    return float("-inf") if str(direction).lower().endswith("maximize") else float("inf")


def _metric_name(out: Path) -> str:
    metrics = out / "metrics.json"
    return json.loads(metrics.read_text()).get("metric", "value") if metrics.is_file() else "value"


def _write(out: Path, sweep: bool, status: dict) -> None:
    if sweep:
        try:
            (out / JOB_STATUS).write_text(json.dumps(status, indent=1))
        except OSError as err:  # a full disk: the sweep's summary counts the job as not finished
            log.error(f"could not write {out / JOB_STATUS}: {err.strerror or err}")
