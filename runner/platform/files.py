"""Writes that leave nothing half-written: a file is written aside and moved into place, so a full disk (or a
kill) mid-write keeps the previous version; a failed write is one line naming the file and the reason."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from runner.errors import DiskFull, RunnerError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` in one step; on failure the old file (if any) is untouched."""
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        _write(temp, text)
        os.replace(temp, path)
    except OSError as err:
        temp.unlink(missing_ok=True)
        raise write_error(path, err) from err


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())  # a full disk shows here at the latest, not after the rename


def keep_copy(path: Path, copy: Path) -> None:
    """`copy` holds what `path` holds now (a hard link: no space needed), before `path` is replaced."""
    try:
        os.link(path, copy)
    except OSError:
        try:
            copy.write_bytes(Path(path).read_bytes())
        except OSError as err:
            Path(copy).unlink(missing_ok=True)
            raise write_error(copy, err) from err


def no_space(err: BaseException) -> bool:
    """Whether `err` (an OSError, or TensorFlow's error for a failed write) says the disk or quota is full."""
    if isinstance(err, OSError) and err.errno in NO_SPACE:
        return True
    text = str(err)
    return any(s in text for s in ("No space left on device", "Disk quota exceeded", "File too large"))


def write_error(what, err: BaseException) -> RunnerError:
    """One line for a failed write of `what` (a path or a description)."""
    reason = (err.strerror if isinstance(err, OSError) and err.strerror else first_line(err))
    cls = DiskFull if no_space(err) else RunnerError
    return cls(f"could not write {what}: {reason}; stopped, files written before it kept")


def first_line(err: BaseException) -> str:
    """The error's first line, without TensorFlow's `{{function_node ...}}` and `[Op:...]` wrapping."""
    import re

    text = str(err).strip() or type(err).__name__
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]", "", text.splitlines()[0]).strip()
    return text[:300]
