"""`batch_max_trials.jsonl`: a `batch=max` search's trials, one JSON line each, written into the run folder as each
trial ends, so that a search killed (kill -9, a node lost) is continued by `resume=<run folder>` rather than run
again. The file is rewritten whole and moved into place for each line (`write_atomic`): a kill leaves the previous
lines, never half a line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from runner.platform.files import write_atomic

log = logging.getLogger("runner")

TRIALS = "batch_max_trials.jsonl"


def recorded_trials(folder: Path) -> list[dict]:
    """The trials recorded in `folder` (none where there is no file); a line that is not a trial record is
    skipped with a warning naming it."""
    path = Path(folder) / TRIALS
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    trials = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("batch"), int) or \
                not isinstance(record.get("fits"), bool):
            log.warning(f"{path}, line {number}: not a trial record; skipped")
            continue
        trials.append(record)
    return trials


def append_trial(folder: Path, record: dict) -> None:
    """Add one trial's line to `folder`'s file (the whole file written aside and moved into place)."""
    path = Path(folder) / TRIALS
    try:
        before = path.read_text(encoding="utf-8") if path.is_file() else ""
    except (OSError, UnicodeDecodeError):
        before = ""
    if before and not before.endswith("\n"):
        before += "\n"
    write_atomic(path, before + json.dumps(record) + "\n")
