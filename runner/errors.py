"""Errors the runner reports as one short line, and how a run exits on them."""

from __future__ import annotations

import logging
import os
import sys


class RunnerError(Exception):
    """A failure reported as one line, without a traceback (unless HYDRA_FULL_ERROR=1)."""

    exit_code = 1


class ConfigError(RunnerError):
    """A config value that cannot work: names the key, the value and what is allowed."""

    exit_code = 2
    NO_VALUE = object()  # for an override with no value (`~key`): the message is `key: allowed`

    def __init__(self, key: str, value, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}: {allowed}" if value is self.NO_VALUE else f"{key}={_show(value)}: {allowed}")


def apply_rule(key: str, value, check, *args, wording=None):
    """Apply one of the engine's rules (``sections.rules``) and report its answer as a ConfigError naming ``key``.

    ``wording``: ``{rule name: facts -> reason}`` for answers the runner words in its own terms (config keys);
    any other answer keeps the engine's message, less its own ``name=value:`` prefix.
    """
    try:
        return check(*args)
    except ValueError as err:
        rule, facts = getattr(err, "rule", None), getattr(err, "facts", {})
        if wording and rule in wording:
            raise ConfigError(key, value, wording[rule](**facts)) from err
        text, prefix = str(err), f"{key.split('.')[-1]}="
        raise ConfigError(key, value, text.split(": ", 1)[1] if text.startswith(prefix) else text) from err


class NonFiniteLoss(RunnerError):
    """The training loss became NaN or Inf."""

    exit_code = 3


class NonFiniteWeights(NonFiniteLoss):
    """A weight (or other float variable of the network) became NaN or Inf, while the loss may still be finite."""


class OutOfMemoryStop(RunnerError):
    """A step ran out of the device's memory and could not be re-planned: the run stops, nothing of that step
    saved (checkpoints are those written before it)."""

    exit_code = 4


class DiskFull(RunnerError):
    """A write failed for lack of space (or quota): the run stops; what was written before is kept."""


class Interrupted(RunnerError):
    """Ctrl-C or SIGTERM: state was saved and the run stops (exit 128 + the signal's number)."""

    exit_code = 130

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code


def full_errors() -> bool:
    return os.environ.get("HYDRA_FULL_ERROR", "") not in ("", "0")


def report(err: BaseException) -> None:
    """Write `error: <message>` to stderr and to the run's log file (not to the console log)."""
    msg = f"error: {err}" if not isinstance(err, Interrupted) else str(err)
    to_log_file(msg, logging.ERROR)
    sys.stdout.flush()
    print(msg, file=sys.stderr, flush=True)


def to_log_file(message: str, level: int = logging.INFO) -> None:
    """Write `message` to the run's log file only (Hydra's file handler), not to the console."""
    record = logging.LogRecord("runner", level, __file__, 0, message, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _show(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    return "null" if value is None else str(value)
