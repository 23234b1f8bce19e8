"""Set up ``.venv`` on first use, then run the main job or the tests.

    python3 tasks.py run [hydra overrides...]   # python -m runner inside .venv
    python3 tasks.py test [pytest args...]      # the fast test suite (not the `slow` ones)
    python3 tasks.py test-all                   # everything, slow quality bars included
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PYTHON = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".installed"


def setup() -> None:
    """Create the virtual environment and install the project when pyproject.toml changed."""
    wanted = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    pip = [str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True)
    print("installing sectionflow and its dependencies (first time: a few minutes)", flush=True)
    subprocess.run(pip + ["-e", f"{ROOT}[test]"], check=True, cwd=ROOT)
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    commands = {
        "run": [str(PYTHON), "-m", "runner"],
        "test": [str(PYTHON), "-m", "pytest", "-q", "-m", "not slow"],
        "test-all": [str(PYTHON), "-m", "pytest", "-q"],
        "setup": None,
    }
    if not argv or argv[0] not in commands:
        print(f"usage: python3 tasks.py {{{'|'.join(commands)}}} [args...]", file=sys.stderr)
        return 2
    setup()
    if commands[argv[0]] is None:
        return 0
    return subprocess.run(commands[argv[0]] + argv[1:], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
