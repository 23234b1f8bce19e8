"""`train.micro_batch` in the runner: the config's checks, a run's record (header, metrics.json, the exactness
check over micro-batches), resume, `max` (its search, and on an emulated device where the whole batch does not
fit, with `sections=auto`), and a sweep over it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
# A tiny MLP on synthetic images: each step is milliseconds.
SMALL = ["model=mlp", "model.hidden=[8]", "data=synthetic", "data.train_size=64", "data.test_size=32",
         "train=smoke", "batch=8", "train.progress=log"]


def composed(*overrides: str, hydra: bool = False):
    from hydra import compose, initialize_config_dir

    from runner.config.schema import register

    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def run_in_process(out: Path, *overrides: str) -> dict:
    """`python -m runner <overrides>` in this process (Hydra's compose API); returns its metrics.json."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.app import run

    cfg = composed(*overrides, hydra=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out)  # what Hydra sets when it runs a job
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    run(cfg, out)
    folder = Path(cfg.resume) if cfg.resume else out
    return json.loads((folder / "metrics.json").read_text())


@pytest.mark.parametrize("overrides,message", [
    (["train.micro_batch=0"], "train.micro_batch=0: allowed: max (the largest micro-batch whose step fits the "
                              "device), null (none), or examples per micro-batch from 1 to the batch (8)"),
    (["train.micro_batch=-2"], "train.micro_batch=-2: allowed: max"),
    (["train.micro_batch=2.5"], "train.micro_batch=2.5: allowed: max"),
    (["train.micro_batch=some"], "train.micro_batch=some: allowed: max"),
    (["train.micro_batch=9"], "train.micro_batch=9: larger than batch=8; allowed: max"),
    (["batch=max", "train.micro_batch=4"], "train.micro_batch=4: cannot go with batch=max"),
    (["train.micro_batch=4", "engine.apply=in_backward"], "engine.apply=in_backward: cannot go with "
                                                          "train.micro_batch=4"),
], ids=["zero", "negative", "fraction", "word", "above-the-batch", "batch-max", "in-backward"])
def test_a_bad_micro_batch_is_refused_in_one_line_naming_it(overrides, message):
    from runner.config.checks import check_config

    with pytest.raises(ConfigError) as err:
        check_config(composed(*SMALL, *overrides))
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("value", ["null", "max", "1", "8"])
def test_good_micro_batches_pass_the_checks(value):
    from runner.config.checks import check_config

    check_config(composed(*SMALL, f"train.micro_batch={value}"))


def _search(batch: int, fits, again=None) -> list[int]:
    """The micro-batches `micro_batch=max` tries where a micro-batch fits when `fits(micro)` (and, checked again
    after later trials, when `again(micro)`)."""
    from runner.run.batch_max import TOLERANCE
    from runner.run.micro import search, sizes

    def attempt(count):
        micro = sizes(batch, count)
        return micro, fits(micro), None, "", micro if fits(micro) else None

    recheck = (lambda micro: (again(micro), None, "")) if again else None
    best, kept, trials = search(batch, attempt, recheck, TOLERANCE, collect=lambda: None)
    assert kept == (sizes(batch, best) if best else None)
    return [m for m, *_ in trials]


def test_micro_batch_max_tries_the_whole_batch_then_doubles_the_cuts_then_bisects():
    assert _search(7500, lambda m: m <= 2600) == [7500, 3750, 1875, 2500]
    assert _search(7500, lambda m: True) == [7500]  # the whole batch fits: no micro-batches
    assert _search(7500, lambda m: m <= 1000) == [7500, 3750, 1875, 938, 1250, 1072]
    assert _search(6, lambda m: False) == [6, 3, 2, 1]  # nothing fits: the run stops in one line
    assert _search(100, lambda m: m <= 40) == [100, 50, 25, 34]


def test_micro_batch_max_checks_its_best_again_and_searches_below_where_it_no_longer_fits():
    # 1875 fits and 2500 does not after it: 1875 is stepped once more; where it no longer fits there (the second
    # 1875), the search goes on below it (938 fits, then bisected up to 1500, the last trial: not checked again)
    assert _search(7500, lambda m: m <= 2000, again=lambda m: m != 1875) == [7500, 3750, 1875, 2500, 1875, 938,
                                                                              1250, 1500]
    assert _search(7500, lambda m: m <= 2000, again=lambda m: True) == [7500, 3750, 1875, 2500]



def test_a_micro_batched_run_says_so_and_checks_a_micro_batched_step(tmp_path, caplog):
    caplog.set_level("INFO", logger="runner")
    metrics = run_in_process(tmp_path, *SMALL, "train.steps=2", "train.micro_batch=3", "sections=2")
    assert metrics["batch"] == 8 and metrics["micro_batch"] == 3 and metrics["micro_batches"] == 3
    assert metrics["apply"] == "at_end" and "summed over 3 micro-batches" in metrics["apply_reason"]
    assert metrics["exact"] is True and metrics["exact_micro_batches"] == 3
    assert metrics["exact_one_step_rel_error"] < 1e-5  # an MLP: no batch statistics
    text = caplog.text
    assert "micro-batches: 3 of 2-3 examples per batch of 8" in text
    assert "batch statistics are per micro-batch" in text
    assert "both cut into the same 3 micro-batches" in text
    assert OmegaConf.load(tmp_path / "config.yaml").train.micro_batch == 3


def test_micro_batch_max_where_the_whole_batch_fits_runs_it_whole(tmp_path, caplog):
    """A fixed partition on this machine's memory: the first trial (the whole batch, two steps within the budget)
    fits, so no micro-batches; the run's config.yaml records the micro-batch found (the batch)."""
    caplog.set_level("INFO", logger="runner")
    metrics = run_in_process(tmp_path, *SMALL, "train.steps=1", "train.micro_batch=max", "train.verify_exact=false",
                             "train.save_model=false")
    assert "micro_batch=max: micro-batch 8 (1 per batch of 8) fits" in caplog.text
    assert "the whole batch of 8 in one step (no micro-batches)" in caplog.text
    assert OmegaConf.load(tmp_path / "config.yaml").train.micro_batch == 8
    assert metrics["step"] == 1 and "micro_batches" not in metrics


@pytest.mark.slow  # three runs (8-25 s); resume itself is tested fast in test_runner*.py
def test_a_resumed_micro_batched_run_equals_an_uninterrupted_one(tmp_path):
    run = [*SMALL, "train.steps=4", "train.checkpoint_every=2", "train.eval_every=0", "train.micro_batch=3",
           "train.verify_exact=false", "train.save_model=false"]
    whole = run_in_process(tmp_path / "whole", *run)
    run_in_process(tmp_path / "part", *run, "train.steps=2")
    resumed = run_in_process(tmp_path / "unused", f"resume={tmp_path / 'part'}", "train.steps=4")
    assert resumed["step"] == whole["step"] == 4
    assert resumed["loss"] == whole["loss"] and resumed["eval_loss"] == whole["eval_loss"]
    assert resumed["micro_batch"] == 3
    sessions = json.loads((tmp_path / "part" / "run.json").read_text())["sessions"]
    assert [s["start_step"] for s in sessions] == [0, 2]  # continued from its checkpoint at step 2


ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": "", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "96",
       "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_ENABLE_ONEDNN_OPTS": "0"}


@pytest.mark.slow
def test_micro_batch_max_keeps_a_batch_whose_step_does_not_fit_the_device(tmp_path):
    """On a 96 MiB device an MLP's batch of 8192 has no plan under sections=auto; micro_batch=max cuts it into
    micro-batches whose plan fits (2048 on 2026-11-28: 8192 and 4096 did not fit, 2731 did not; 4 trials, 4 min
    on 2 busy cores), trains, and records the cut. Small inputs (8x8), so that the data's own buffers, which share
    the emulated device, do not decide."""
    args = ["model=mlp", "model.hidden=[1024,1024]", "data=synthetic", "data.image_shape=[8,8,1]",
            "data.train_size=8192", "data.test_size=64", "train=smoke", "train.steps=3", "train.eval_every=0",
            "batch=8192", "sections=auto",
            "train.micro_batch=max", "train.verify_exact=false", "train.save_model=false"]
    out = tmp_path / "run"  # a folder that exists already gets a suffix (runner.hydra_callbacks.claim_folder)
    args.append(f"hydra.run.dir={out}")
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    micro = OmegaConf.load(out / "config.yaml").train.micro_batch
    assert metrics["batch"] == 8192 and metrics["micro_batch"] == micro and 1 <= micro < 8192
    assert metrics["step"] == 3 and metrics["micro_batches"] == -(-8192 // micro)
    assert "micro_batch=max: micro-batch 8192 (1 per batch of 8192) does not fit" in proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_sweep_over_micro_batches(tmp_path):
    args = ["-m", *SMALL, "train.steps=2", "train.micro_batch=2,4", "train.verify_exact=false",
            "train.save_model=false", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
    proc = subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = sorted(json.loads(p.read_text())["micro_batches"] for p in (tmp_path / "sweep").glob("*/metrics.json"))
    assert found == [2, 4]
