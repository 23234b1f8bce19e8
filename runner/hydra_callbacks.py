"""Hydra callbacks: a fresh output folder per run and per sweep, and the end-of-sweep report."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from runner.config.resume import RESUMING, SWEEP_RECORD

JOB_STATUS = "status.json"


def claim_folder(path: str | Path) -> Path:
    """Create `path`, or `path-1`, `path-2`, ... if taken; atomic, so two processes never share one."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    candidate, n = base, 0
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = base.with_name(f"{base.name}-{n}")


class UniqueOutputDir(Callback):
    """Claims `hydra.run.dir` (or `hydra.sweep.dir`) before Hydra uses it, adding `-N` when it already exists."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        resume = OmegaConf.select(config, "resume")
        if resume is not None and Path(str(resume)).expanduser().is_dir():
            folder = Path(str(resume)).expanduser()  # a resumed run continues in its own folder
        else:
            try:
                folder = claim_folder(OmegaConf.select(config, "hydra.run.dir"))
            except OSError as err:
                print(f"error: hydra.run.dir={OmegaConf.select(config, 'hydra.run.dir')}: cannot create the run "
                      f"folder: {err.strerror or err}", file=sys.stderr, flush=True)
                raise SystemExit(2) from None
        with read_write(config.hydra.run):
            config.hydra.run.dir = str(folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        continued = os.environ.get(RESUMING)
        if continued and Path(OmegaConf.select(config, "hydra.sweep.dir")).resolve() == Path(continued).resolve():
            print(f"[sweep] {continued}: continued (finished jobs kept, interrupted ones resumed from their "
                  f"checkpoints, the others run)", flush=True)
            return
        try:
            folder = str(claim_folder(OmegaConf.select(config, "hydra.sweep.dir")))
        except OSError as err:
            print(f"error: hydra.sweep.dir={OmegaConf.select(config, 'hydra.sweep.dir')}: cannot create the sweep "
                  f"folder: {err.strerror or err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        with read_write(config.hydra):
            config.hydra.sweep.dir = folder
            quoted = folder.replace("\\", "\\\\").replace("'", "\\'")
            config.hydra.overrides.hydra.append(f"hydra.sweep.dir='{quoted}'")
        record = {"task": list(config.hydra.overrides.task), "hydra": list(config.hydra.overrides.hydra),
                  "sweeper": OmegaConf.select(config, "hydra.sweeper._target_")}
        if "optuna" in str(record["sweeper"] or "").lower():  # what resume= needs to find and count its study
            record["optuna"] = {k: OmegaConf.select(config, f"hydra.sweeper.{k}")
                                for k in ("storage", "study_name", "n_trials")}
        try:
            (Path(folder) / SWEEP_RECORD).write_text(json.dumps(record, indent=1))
        except OSError as err:  # the sweep runs; only its resume= would lack the record
            print(f"warning: {Path(folder) / SWEEP_RECORD}: {err.strerror or err}", file=sys.stderr, flush=True)
        from runner.record.run_record import tensorboard_command

        print(f"[sweep] {folder}  ({tensorboard_command(Path(folder))})", flush=True)


class SweepReport(Callback):
    """After a sweep, lists every job's outcome and what failed and why; exits 1 if any job failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep = Path(OmegaConf.select(config, "hydra.sweep.dir"))
        jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and (p / JOB_STATUS).is_file()),
                      key=lambda p: (len(p.name), p.name))
        statuses = [(job, json.loads((job / JOB_STATUS).read_text())) for job in jobs]
        failed = [(job, s) for job, s in statuses if s.get("status") != "completed"]
        print(f"[sweep] {len(statuses)} jobs, {len(statuses) - len(failed)} completed, {len(failed)} failed: {sweep}",
              flush=True)
        common = set.intersection(*(set(s.get("overrides", [])) for _, s in statuses)) if statuses else set()
        swept = {job: " ".join(o for o in s.get("overrides", []) if o not in common) for job, s in statuses}
        for job, s in statuses:
            value = s.get("value")
            shown = f"{s.get('metric', 'value')}={value:.4g}" if isinstance(value, float) else s.get("status")
            print(f"  {job.name}: {swept[job]}  ->  {shown}", flush=True)
        if failed:
            print("[sweep] failed jobs:", file=sys.stderr)
            for job, s in failed:
                print(f"  {job.name} ({swept[job]}): {s.get('error', s.get('status'))}", file=sys.stderr)
            sys.stderr.flush()
            raise SystemExit(1)


def earlier_attempt(out: Path, overrides: list[str]) -> tuple[str, Any]:
    """What a sweep job's folder holds from an earlier run of the sweep (`resume=<sweep folder>`): ("kept", value)
    for a completed job, ("resume", None) for one with checkpoints (it continues from the newest) or a stopped
    `batch=max` search (it continues from its trials), ("run", None)
    for one never started or stopped before its first checkpoint. A folder a fresh sweep claims is empty: "run".

    Raises RunnerError where the folder's job had other overrides (the sweep was continued with other values)."""
    from runner.errors import RunnerError

    status = out / JOB_STATUS
    try:
        earlier = json.loads(status.read_text()) if status.is_file() else None
    except (OSError, ValueError):
        earlier = None  # a status cut short by the kill: the job did not finish
    if earlier is not None and earlier.get("overrides") is not None and list(earlier["overrides"]) != overrides:
        raise RunnerError(f"{out} holds the job {' '.join(earlier['overrides'])}, not {' '.join(overrides)}: the "
                          f"sweep continued is not the sweep that ran there")
    if earlier is not None and earlier.get("status") == "completed":
        return "kept", earlier.get("value")
    if (out / "config.yaml").is_file() and any((out / "checkpoints").glob("ckpt-*.index")):
        return "resume", None
    from runner.config.resume import stopped_search

    if stopped_search(out):  # a batch=max search killed before the first checkpoint: it continues from its trials
        return "resume", None
    return "run", None
