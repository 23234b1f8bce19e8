"""tasks.py's set-up: the gpu extra when `nvidia-smi -L` lists a GPU, and re-installation when the choice changes.

A fake `nvidia-smi` on PATH stands in for the driver, and a fake `.venv/bin/python` records the pip commands
instead of running them, so nothing is installed.
"""

from __future__ import annotations

import stat
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tasks  # noqa: E402

LISTS_A_GPU = 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a1b2c3d)"'
FAILS = 'echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9'
LISTS_NOTHING = "exit 0"


def script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def fake_path(tmp_path, monkeypatch):
    """A PATH holding only a folder the test may fill with a fake nvidia-smi."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", str(folder))
    return folder


@pytest.mark.parametrize("body, gpu", [(LISTS_A_GPU, True), (FAILS, False), (LISTS_NOTHING, False), (None, False)],
                         ids=["lists-a-gpu", "fails", "lists-nothing", "absent"])
def test_install_command_has_the_gpu_extra_only_when_nvidia_smi_lists_a_gpu(fake_path, body, gpu):
    if body is not None:
        script(fake_path / "nvidia-smi", body)
    assert tasks.gpu_present() is gpu
    command = tasks.install_command(Path("/v/bin/python"), Path("/src"), tasks.extras(tasks.gpu_present(), "linux"))
    expected = "/src[test,gpu]" if gpu else "/src[test]"
    assert command == ["/v/bin/python", "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", expected]


def test_no_gpu_extra_off_linux():
    assert tasks.extras(True, "darwin") == ["test"] and tasks.extras(True, "linux") == ["test", "gpu"]


def test_setup_reinstalls_when_the_gpu_appears_and_not_otherwise(fake_path, tmp_path, monkeypatch, capsys):
    venv = tmp_path / "venv"
    log = tmp_path / "pip.log"
    python = script(venv / "bin" / "python", f'echo "$@" >> {log}')
    monkeypatch.setattr(tasks, "VENV", venv)
    monkeypatch.setattr(tasks, "PYTHON", python)
    monkeypatch.setattr(tasks, "STAMP", venv / ".installed")
    calls = lambda: log.read_text().splitlines() if log.exists() else []  # noqa: E731

    tasks.setup()  # no nvidia-smi: the test extra only
    assert calls()[-1].endswith(f"-e {tasks.ROOT}[test]") and len(calls()) == 2  # pip upgrade, then the project
    tasks.setup()  # nothing changed: nothing runs
    assert len(calls()) == 2
    script(fake_path / "nvidia-smi", LISTS_A_GPU)
    tasks.setup()  # a GPU now: installs again, with the gpu extra
    assert len(calls()) == 4 and calls()[-1].endswith(f"-e {tasks.ROOT}[test,gpu]")
    assert "the gpu extra" in capsys.readouterr().out
    assert (venv / ".installed").read_text().endswith(" test,gpu")


def test_gpu_extra_pins_the_same_tensorflow_as_the_dependencies():
    import tomllib

    project = tomllib.loads((tasks.ROOT / "pyproject.toml").read_text())["project"]
    (tf,) = [d for d in project["dependencies"] if re.match(r"tensorflow\b(?![-_])", d)]  # not tensorflow-datasets
    assert project["optional-dependencies"]["gpu"] == [tf.replace("tensorflow", "tensorflow[and-cuda]", 1)]


def test_tasks_needs_only_the_standard_library():
    import subprocess

    proc = subprocess.run([sys.executable, "-I", "-S", str(tasks.ROOT / "tasks.py")], capture_output=True, text=True,
                          timeout=60)  # -S: no site-packages, as on a fresh machine; no command: prints its usage
    assert proc.returncode == 2 and proc.stderr.startswith("usage: python3 tasks.py {run|test|test-all|setup}")


def test_test_all_runs_each_test_file_in_its_own_process(tmp_path, monkeypatch, capsys):
    """One process per file (memory tests measure the whole device); a file's failure is named, an empty
    selection (pytest's exit code 5) is not a failure."""
    for name, code in [("test_a.py", 0), ("test_b.py", 1), ("test_c.py", 5), ("helper.py", 1)]:
        (tmp_path / "tests").mkdir(exist_ok=True)
        (tmp_path / "tests" / name).write_text(f"raise SystemExit({code})\n")
    monkeypatch.setattr(tasks, "ROOT", tmp_path)
    runner = [sys.executable, "-c", "import runpy, sys; runpy.run_path(sys.argv[1])"]
    assert tasks.test_files_apart(runner, []) == 1
    assert capsys.readouterr().err.strip() == "failed in: test_b.py"
    (tmp_path / "tests" / "test_b.py").write_text("raise SystemExit(0)\n")
    assert tasks.test_files_apart(runner, []) == 0


def test_a_slow_case_naming_no_test_is_found_where_its_file_is_collected_whole():
    import conftest

    case = next(iter(conftest.SLOW_CASES))
    file, test = case.split("::", 1)
    renamed = f"{file}::{test}_renamed"
    assert conftest.stale_slow_cases([renamed], ["tests"]) == [case]
    assert conftest.stale_slow_cases([case], ["tests"]) == []
    assert conftest.stale_slow_cases([renamed], [f"{file}::{test}_renamed"]) == []  # narrowed: not judged
    assert conftest.stale_slow_cases(["tests/test_other.py::test_x"], ["tests"]) == []  # file not collected
