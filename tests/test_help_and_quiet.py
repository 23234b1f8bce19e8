"""Issue 51, item 8: `--help` shows the sweep launchers, `sections=auto` and `batch=max` examples and the default
model's cut names, not the internal `bench` group; the test processes print no TensorFlow start-up lines."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_UP = re.compile(r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl)", re.M)


def test_help_shows_launchers_auto_and_max_examples_and_the_resnets_cut_names_not_bench():
    env = {**os.environ, "HYDRA_FULL_ERROR": ""}
    proc = subprocess.run([sys.executable, "-m", "runner", "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "== Sweep launchers (with -m: hydra/launcher=<choice>) ==" in out
    for launcher in ("basic", "joblib", "local", "slurm", "submitit_local", "submitit_slurm"):
        assert re.search(rf"\b{launcher}\b", out.split("== Sweep launchers")[1].split("== Config (")[0]), launcher
    examples = out.split("Examples:")[1]
    assert re.search(r"python -m runner sections=auto\s", examples)
    assert "python -m runner sections=auto batch=max" in examples and "hydra/launcher=slurm" in examples
    assert not re.search(r"^bench:", out, re.M) and re.search(r"^model: .*resnet", out, re.M)
    assert "== Cut names of resnet" in out and "16 names" in out
    assert "initial_conv, scale0, scale0/block_0," in out and out.rstrip().endswith("final_pool")


def test_the_listed_resnet_names_are_the_built_networks():
    from omegaconf import OmegaConf

    import models
    from runner.help import resnet_block_names

    for split in (False, True):
        model = OmegaConf.create({"depths": [1, 2], "widths": [4, 8], "split_blocks": split})
        net = models.build_resnet(num_classes=3, input_shape=(8, 8, 1), widths=[4, 8], depths=[1, 2],
                                  split_blocks=split)
        assert resnet_block_names(model) == list(net.block_names)


def test_a_test_process_prints_no_tensorflow_start_up_lines():
    """What an xdist worker runs first (tests/conftest.py, which imports TensorFlow and lists its devices)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", "import conftest, tensorflow as tf; tf.zeros(1)"],
                          cwd=ROOT / "tests", env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not START_UP.search(proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-2000:]
