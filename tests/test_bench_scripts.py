"""The benchmark scripts' documented commands parse (running them takes minutes: they are run by hand)."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
REPEAT = ROOT / "docs" / "bench" / "planner" / "repeat_peaks.py"
ZOO = ROOT / "docs" / "bench" / "planner" / "zoo.py"


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeat_peaks_documented_commands_parse():
    module = _module(REPEAT)
    commands = [line.strip() for line in module.__doc__.splitlines() if "repeat_peaks.py" in line and "python" in line]
    assert len(commands) == 2, commands
    for command in commands:
        words = shlex.split(command.split("#")[0])  # python SCRIPT ARGS...
        args = module.build_parser().parse_args(words[2:])
        assert args.sections == 4 and args.steps == 60
    assert module.build_parser().parse_args(["--load", "2"]).load == 2


def test_repeat_peaks_help_runs_without_tensorflow():
    proc = subprocess.run([sys.executable, str(REPEAT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--gc-between" in proc.stdout and "--intra" in proc.stdout, proc.stderr


def test_zoo_documented_commands_parse():
    """zoo.py's own examples and the one docs/RUNNER.md and the README show (auto against fixed partitions)."""
    module = _module(ZOO)
    commands = [line.strip() for line in module.__doc__.splitlines() if "zoo.py" in line and "python" in line]
    for doc in (ROOT / "docs" / "RUNNER.md", ROOT / "README.md"):
        assert "`docs/bench/planner/zoo.py --fixed 2 4 8`" in doc.read_text(), doc
    commands.append("python docs/bench/planner/zoo.py --fixed 2 4 8")
    assert len(commands) == 5, commands
    for command in commands:
        words = shlex.split(command.split("#")[0])
        args = module.build_parser().parse_args(words[2:])
        assert set(args.models) <= set(module.ZOO) and all(0 < f < 1 for f in args.fractions)
    fixed = module.build_parser().parse_args(shlex.split(commands[2].split("#")[0])[2:])
    assert fixed.fixed == [2, 4, 8] and fixed.fractions == [0.5]
    searched = module.build_parser().parse_args(shlex.split(commands[3].split("#")[0])[2:])
    assert searched.batch_max and not module.build_parser().parse_args([]).batch_max


@pytest.mark.parametrize("model", ["resnet", "mobilenetv2", "resnet50v2"])
def test_zoo_batch_max_runs_compose_into_configs_the_runner_accepts(model, tmp_path):
    """The runner commands ``zoo.py --batch-max`` runs (both engines) compose and pass the runner's checks."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from runner.config import schema
    from runner.config.checks import check_config

    module = _module(ZOO)
    schema.register()
    for engine in ("whole", "auto"):
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=module.batch_max_overrides(model, engine, tmp_path / engine),
                          return_hydra_config=True)
        with open_dict(cfg):
            del cfg.hydra
        check_config(cfg)
        assert cfg.batch == "max" and cfg.data.train_size == 8 * module.ZOO[model][2]
    with pytest.raises(ValueError, match="image models"):
        module.runner_args("gpt2")


def test_fit_forms_documented_command_parses():
    module = _module(ROOT / "docs" / "bench" / "planner" / "fit_forms.py")
    commands = [line.strip() for line in module.__doc__.splitlines() if "fit_forms.py" in line and "python" in line]
    assert len(commands) == 1, commands
    args = module.build_parser().parse_args(shlex.split(commands[0])[2:])
    assert args.models == ["gpt2", "resnet", "efficientnetb0"]


def test_onednn_pointwise_documented_commands_parse():
    path = ROOT / "docs" / "bench" / "exactness" / "onednn_pointwise.py"
    module = _module(path)
    commands = [line.strip() for line in module.__doc__.splitlines() if "onednn_pointwise.py" in line and "python" in line]
    assert len(commands) == 2, commands
    runs = [module.build_parser().parse_args(shlex.split(c.split("#")[0])[2:]).runs for c in commands]
    assert runs == [200, 20]
    assert "docs/bench/exactness/onednn_pointwise.py" in (ROOT / "BENCHMARKS.md").read_text()
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "--runs" in proc.stdout, proc.stderr


def _documented_planner_command(name: str):
    """The one command a ``docs/bench/planner`` script's docstring shows, parsed by the script's own parser."""
    module = _module(ROOT / "docs" / "bench" / "planner" / name)
    commands = [line.strip() for line in module.__doc__.splitlines() if name in line and "python" in line]
    assert len(commands) == 1, commands
    return module.build_parser().parse_args(shlex.split(commands[0])[2:])


def test_least_plan_sections_documented_command_parses():
    args = _documented_planner_command("least_plan_sections.py")
    assert args.model in _module(ZOO).ZOO and args.device == 420
    assert "docs/bench/planner/least_plan_sections.py --model resnet50 --device 420" in (ROOT / "BENCHMARKS.md").read_text()


def test_span_count_documented_command_parses():
    args = _documented_planner_command("span_count.py")
    assert args.model in _module(ZOO).ZOO and args.spans == ["0:5", "8:12", "16:26", "43:51"]
    assert "docs/bench/planner/span_count.py --model resnet50 --spans 0:5 8:12 16:26 43:51" in \
        (ROOT / "BENCHMARKS.md").read_text()


def test_slack_documented_commands_parse_and_help_runs_without_tensorflow():
    path = ROOT / "docs" / "bench" / "planner" / "slack.py"
    module = _module(path)
    commands = [line.strip() for line in module.__doc__.splitlines() if "slack.py" in line and "python" in line]
    assert len(commands) == 2, commands
    parsed = [module.build_parser().parse_args(shlex.split(c)[2:]) for c in commands]
    assert [(a.model, a.device, a.processes, a.steps) for a in parsed] == [("resnet", 341, 3, 1),
                                                                          ("mobilenetv2", 461, 2, 2)]
    assert all(a.model in _module(ZOO).ZOO for a in parsed)
    assert "docs/bench/planner/slack.py --model resnet --device 341 --processes 3" in (ROOT / "BENCHMARKS.md").read_text()
    child = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.argv = ['slack.py', '--help']\n"
                            f"try:\n    runpy.run_path({str(path)!r}, run_name='__main__')\nexcept SystemExit:\n    pass\n"
                            f"print('tensorflow' in sys.modules)"], capture_output=True, text=True, timeout=60)
    assert "--processes" in child.stdout and child.stdout.strip().endswith("False"), child.stdout + child.stderr
