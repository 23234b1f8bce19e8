"""`train.plan_cache`: the plans `sections=auto` chose, kept across runs so that runs of one set-up (the same model,
data shapes, batch, optimizer, budget, device and engine options) run one plan (`sections.step.remembered`).

A run finds its set-up's record, dry-runs that plan first and runs it where it fits; else it searches as without a
cache and keeps what it chose. Records are JSON files named by the set-up's key, written aside and moved into place.
A record that cannot be read or written is said in one line and the run goes on without it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from runner.errors import RunnerError
from runner.platform.files import first_line, write_atomic

log = logging.getLogger("runner")
DEFAULT = "auto"  # the user's cache folder (`default_folder`)


def default_folder() -> Path:
    """`$XDG_CACHE_HOME/sectionflow/plans`, else `~/.cache/sectionflow/plans`."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "sectionflow" / "plans"


def plan_cache(value) -> "PlanCache | None":
    """The store for `value` (checked by `runner.config.checks`), or None where the cache is off."""
    if value is None or value is False:
        return None
    return PlanCache(default_folder() if value == DEFAULT else Path(os.path.expanduser(value)))


class PlanCache:
    """A mapping from set-up keys to plan records, one JSON file each under `folder` (made on first write)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.found: Path | None = None  # the record this run read, where it found one
        self._failed = False

    def get(self, key: str) -> dict | None:
        path = self.folder / f"{key}.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as err:
            log.warning(f"train.plan_cache: {path} could not be read ({first_line(err)}); planning without it")
            return None
        if not isinstance(record, dict):
            log.warning(f"train.plan_cache: {path} holds no plan record; planning without it")
            return None
        self.found = path
        log.info(f"train.plan_cache: a plan of {record.get('sections', '?')} section(s) remembered for this set-up "
                 f"({path}) is tried first")
        return record

    def __setitem__(self, key: str, record: dict) -> None:
        path = self.folder / f"{key}.json"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(record, indent=1) + "\n")
        except (OSError, RunnerError) as err:
            if not self._failed:
                self._failed = True
                log.warning(f"train.plan_cache: the plan could not be kept in {self.folder} ({first_line(err)}); "
                            f"later runs of this set-up search afresh")
