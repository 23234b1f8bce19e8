"""Hydra callbacks: a fresh output folder per run and per sweep, and the end-of-sweep report."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

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
