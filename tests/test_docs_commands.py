"""Every `python -m runner` command in the README and docs/ parses as Hydra overrides, and (single runs) composes
into a config that passes the runner's own checks, in-process: a documented example cannot fail to parse again."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = {"-m", "--multirun", "--help", "--hydra-help", "--info"}


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for each `python -m runner ...` line inside a fenced code block."""
    found = []
    for path in DOCS:
        inside, lines = False, []
        for number, line in enumerate(path.read_text().splitlines(), 1):  # continuation lines joined
            if lines and lines[-1][1].endswith("\\"):
                lines[-1] = (lines[-1][0], lines[-1][1][:-1] + " " + line.strip())
            else:
                lines.append((number, line))
        for number, line in lines:
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            if not inside or "python -m runner " not in line + " " or "python -m runner." in line:
                continue
            command = line[line.index("python -m runner"):]
            command = re.split(r"\s+#", command, maxsplit=1)[0].strip()
            if "<" in command or "..." in command:  # a placeholder, not a command
                continue
            found.append((f"{path.relative_to(ROOT)}:{number}", command))
    return found


COMMANDS = documented_commands()


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 20, COMMANDS


@pytest.mark.parametrize("where, command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_a_documented_command_parses_and_composes(where, command):
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from runner.config import schema
    from runner.config.checks import check_config

    words = shlex.split(command)[3:]
    sweep = "-m" in words or "--multirun" in words
    overrides = [w for w in words if w not in FLAGS and not w.startswith("--cfg")]
    parsed = OverridesParser.create().parse_overrides(overrides)  # raises on what Hydra's parser rejects
    if sweep or any(o.is_hydra_override() for o in parsed):
        return  # sweeps and launcher choices: parsed; composing them needs Hydra's launcher plugins
    schema.register()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    if cfg.resume is None:
        check_config(cfg)
