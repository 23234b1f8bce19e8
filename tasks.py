"""Set up ``.venv`` on first use, then run the main job or the tests.

    python3 tasks.py run [hydra overrides...]   # python -m runner inside .venv
    python3 tasks.py test [pytest args...]      # the fast test suite (not the `slow` ones)
    python3 tasks.py test-all                   # everything, slow quality bars included, one process per test file

On Linux with an NVIDIA GPU (``nvidia-smi -L`` lists one), the set-up also installs the ``gpu`` extra
(``tensorflow[and-cuda]``: CUDA and cuDNN from pip), so TensorFlow finds the GPU with no system CUDA.
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


def gpu_present() -> bool:
    """True when ``nvidia-smi -L`` runs and lists at least one GPU (NVIDIA driver installed, a GPU visible)."""
    try:
        proc = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and any(line.startswith("GPU ") for line in proc.stdout.splitlines())


def extras(gpu: bool, platform: str = sys.platform) -> list[str]:
    """The extras to install: ``test``, plus ``gpu`` on Linux with an NVIDIA GPU (the CUDA wheels are Linux-only)."""
    return ["test", "gpu"] if gpu and platform.startswith("linux") else ["test"]


def install_command(python: Path, root: Path, chosen: list[str]) -> list[str]:
    """The pip command that installs the project (editable) with the chosen extras."""
    return [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q",
            "-e", f"{root}[{','.join(chosen)}]"]


def stamp(pyproject: bytes, chosen: list[str]) -> str:
    """What an installed ``.venv`` records: a change in either part re-installs."""
    return hashlib.sha256(pyproject).hexdigest() + " " + ",".join(chosen)


def setup() -> None:
    """Create the virtual environment and install the project when pyproject.toml or the chosen extras changed."""
    chosen = extras(gpu_present())
    wanted = stamp((ROOT / "pyproject.toml").read_bytes(), chosen)
    if STAMP.exists() and STAMP.read_text() == wanted and PYTHON.exists():
        return
    if not PYTHON.exists():
        print(f"creating {VENV}", flush=True)
        venv.create(VENV, with_pip=True)
    subprocess.run([str(PYTHON), "-m", "pip", "install", "--disable-pip-version-check", "-q", "--upgrade", "pip"],
                   check=True)
    gpu = " with CUDA for the NVIDIA GPU (the gpu extra)" if "gpu" in chosen else ""
    print(f"installing sectionflow and its dependencies{gpu} (first time: a few minutes)", flush=True)
    subprocess.run(install_command(PYTHON, ROOT, chosen), check=True, cwd=ROOT)
    STAMP.write_text(wanted)


def main(argv: list[str]) -> int:
    commands = {
        "run": [str(PYTHON), "-m", "runner"],
        # Three worker processes on two cores: tracing is Python on one core, and some tests mostly wait (the BFC
        # allocator's 10 s retries, child processes), which a third worker fills (873 tests: 5:03 against 5:58
        # with two, one after the other, 2026-11-28); a worker that runs out of tests takes another's (whole files
        # per worker left one idle for the last half-minute); memory is measured per process.
        "test": [str(PYTHON), "-m", "pytest", "-q", "-m", "not slow", "-n", "3", "--dist", "worksteal",
                 "--durations=10"],
        "test-all": [str(PYTHON), "-m", "pytest", "-q"],
        "setup": None,
    }
    if not argv or argv[0] not in commands:
        print(f"usage: python3 tasks.py {{{'|'.join(commands)}}} [args...]", file=sys.stderr)
        return 2
    setup()
    if commands[argv[0]] is None:
        return 0
    if argv[0] == "test-all":
        return test_files_apart(commands["test-all"], argv[1:])
    return subprocess.run(commands[argv[0]] + argv[1:], cwd=ROOT).returncode


def test_files_apart(pytest: list[str], args: list[str]) -> int:
    """Each test file in its own process: memory tests measure the whole device, and a process that ran the slow
    keras.applications cases keeps 0.4-1 GiB that no ``gc.collect`` frees (measured; what holds it is not known)."""
    failed = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        code = subprocess.run(pytest + [str(path.relative_to(ROOT))] + args, cwd=ROOT).returncode
        if code not in (0, 5):  # 5: nothing collected (a -k that matches nothing in this file)
            failed.append(path.name)
    if failed:
        print(f"failed in: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
