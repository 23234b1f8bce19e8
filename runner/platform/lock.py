"""One writer per run folder: `run.lock` holds the writer's PID and host while it runs.

A second run or resume of the folder refuses in one line naming the holder. The lock is released on any exit the
process sees (return, error, signal); one left by a process that died (kill -9, out of memory) on this host is
stale: its PID no longer runs, so the next run takes it over."""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

from runner.errors import RunnerError

log = logging.getLogger("runner")
LOCK = "run.lock"


class FolderLocked(RunnerError):
    """Another live process writes into this run folder."""

    exit_code = 2


@contextmanager
def holding(folder: Path):
    """Hold `folder/run.lock` for the duration of the block."""
    path = acquire(folder)
    try:
        yield path
    finally:
        release(path)


def acquire(folder: Path) -> Path:
    """Create `folder/run.lock` for this process, taking over a stale one; raises FolderLocked if held."""
    path = Path(folder) / LOCK
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunnerError(f"cannot create the run folder {folder}: {err.strerror or err}") from None
    me = {"pid": os.getpid(), "host": platform.node(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
          "start_ticks": _start_ticks(os.getpid())}
    for _ in range(3):
        if _create(path, me):
            return path
        holder = _read(path)
        if holder is None:  # being written right now (no hard links here), or garbled: give its writer a moment
            time.sleep(0.2)
            holder = _read(path)
        if holder is None and not path.exists():
            continue  # released meanwhile
        if holder is not None and _alive(holder):
            hint = "" if holder["host"] == platform.node() else f"; if no process of it runs any more, remove {path}"
            raise FolderLocked(f"{folder} is in use by another run (PID {holder['pid']} on {holder['host']} since "
                               f"{holder.get('started', '?')}, lock {path}); wait for it to end or stop it{hint}")
        gone = f"PID {holder['pid']} on {holder['host']}, which no longer runs" if holder else "an unreadable lock"
        log.warning(f"{path}: taking over the lock of {gone}")
        _remove_stale(path, holder)
    raise FolderLocked(f"{folder}: could not take {path} (other processes keep taking it)")


def _remove_stale(path: Path, holder: dict | None) -> None:
    """Move the stale lock aside (atomic: of two processes taking over, one moves it) and check that it was the
    stale one, not a lock another process took in the meantime (that one goes back)."""
    aside = path.with_name(f".{LOCK}.stale.{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    if _read(aside) != holder:
        try:
            os.link(aside, path)
        except OSError:
            pass
    aside.unlink(missing_ok=True)


def release(path: Path) -> None:
    """Remove the lock if this process still holds it."""
    holder = _read(path)
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == platform.node():
        path.unlink(missing_ok=True)


def _create(path: Path, content: dict) -> bool:
    """Atomically create `path` holding `content` (complete from its first moment: written aside, then linked)."""
    temp = path.with_name(f".{LOCK}.{os.getpid()}")
    try:
        temp.write_text(json.dumps(content))
    except OSError as err:
        temp.unlink(missing_ok=True)
        raise RunnerError(f"cannot write the run folder's lock {path}: {err.strerror or err}") from None
    try:
        os.link(temp, path)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: exclusive create, then write
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(content))
        return True
    finally:
        temp.unlink(missing_ok=True)


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(holder, dict) or not isinstance(holder.get("pid"), int) or not isinstance(holder.get("host"), str):
        return None
    return holder


def _alive(holder: dict) -> bool:
    """Whether the holder may still run: on another host this cannot be checked, so it counts as alive."""
    if holder["host"] != platform.node():
        return True
    if holder["pid"] == os.getpid():
        return False  # this process's own leftover (an earlier job of an in-process sweep that crashed hard)
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    stat = _stat(holder["pid"])
    if stat is None:
        return True  # no /proc: the PID exists, that is all we know
    # a zombie has ended; another process that got the same PID later started at another time
    return stat[0] != "Z" and holder.get("start_ticks") in (None, stat[19])


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first; field 22, the start time, is [19])."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _start_ticks(pid: int) -> str | None:
    stat = _stat(pid)
    return stat[19] if stat and len(stat) > 19 else None
