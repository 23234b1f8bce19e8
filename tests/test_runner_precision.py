"""`train.precision` in the runner: the dtype policy is set for the job and put back after it, mixed_float16
trains through a LossScaleOptimizer whose state the checkpoint holds, and resume continues it exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from models import build_mlp  # noqa: E402
from models.data import synthetic  # noqa: E402
from runner.app import CONF, run  # noqa: E402
from runner.config.checks import check_config  # noqa: E402
from runner.config.schema import register  # noqa: E402
from runner.errors import ConfigError  # noqa: E402
from runner.run.checkpoint import Checkpoints  # noqa: E402
from sections import Engine  # noqa: E402

TINY = ["model=mlp", "model.hidden=[8]", "data=synthetic", "data.train_size=64", "data.test_size=32",
        "train=smoke", "batch=8"]


def _compose(*overrides):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", return_hydra_config=True, overrides=list(overrides))


def _run(tmp, *overrides):
    """`python -m runner <overrides>` in this process (as Hydra would call it)."""
    from hydra.core.hydra_config import HydraConfig

    cfg = _compose(*overrides)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    run(cfg, tmp)
    return json.loads((tmp / "metrics.json").read_text())


def test_a_bad_precision_is_one_line_naming_the_allowed_values():
    with pytest.raises(ConfigError) as err:
        check_config(_compose("train.precision=float16"))
    assert str(err.value) == "train.precision=float16: allowed: float32, mixed_bfloat16, mixed_float16"


def test_a_mixed_float16_run_scales_its_loss_and_leaves_the_policy_as_it_found_it(tmp_path):
    assert keras.config.dtype_policy().name == "float32"
    metrics = _run(tmp_path, *TINY, "train.steps=2", "train.precision=mixed_float16")
    assert keras.config.dtype_policy().name == "float32"  # the next job (or this test session) builds in float32
    assert metrics["exact"] is True and np.isfinite(metrics["loss"])  # sectioned equals whole at float16 rounding
    saved = dict(tf.train.list_variables(str(tmp_path / "checkpoints" / "ckpt-2")))
    assert "optimizer/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE" in saved
    assert any(k.startswith("optimizer/inner_optimizer/") for k in saved)


def test_resume_cannot_turn_loss_scaling_on_or_off(tmp_path):
    _run(tmp_path, *TINY, "train.steps=2", "train.precision=mixed_bfloat16")
    with pytest.raises(ConfigError, match=r"cannot change train.precision \(mixed_bfloat16 -> mixed_float16\)"):
        _run(tmp_path, f"resume={tmp_path}", "train.steps=3", "train.precision=mixed_float16")
    assert keras.config.dtype_policy().name == "float32"


def test_the_loss_scale_state_is_checkpointed_and_restored_exactly(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        data = synthetic(train_size=64, test_size=16)
        # grows every step, so each step leaves a different scale behind
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), dynamic_growth_steps=1)
        engine = Engine(build_mlp(hidden=[8], dropout=0.3, **data.model_args), optimizer, sections=2)
        batches = iter(data.train_batches(16, 0))
        engine.build(next(iter(data.train_batches(16, 0))))
        ckpt = Checkpoints(tmp_path / "checkpoints", engine, batches, keep=2)
        engine.train_step(next(batches))
        ckpt.save(1)
        saved_scale = float(optimizer.dynamic_scale)
        after = [engine.train_step(next(batches))["loss"] for _ in range(2)]
        weights = [np.array(v) for v in engine.network.variables]
        assert float(optimizer.dynamic_scale) == 4 * saved_scale
        ckpt.restore()
        assert float(optimizer.dynamic_scale) == saved_scale
        assert [engine.train_step(next(batches))["loss"] for _ in range(2)] == after
        for a, v in zip(weights, engine.network.variables):
            np.testing.assert_array_equal(a, np.array(v))
    finally:
        keras.config.set_dtype_policy("float32")


def test_a_report_takes_ratios_against_float32_whole_and_names_the_precision(tmp_path):
    from runner.report import main

    def job(i, strategy, precision, peak_mib):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "metrics.json").write_text(json.dumps({
            "metric": "accuracy", "accuracy": 0.5, "strategy": strategy, "batch": 64, "num_sections": 1,
            "section_blocks": [1], "policies": ["recompute"], "median_step_seconds": 1.0, "exact": True,
            "step_peak_bytes": peak_mib * 2**20, "forward_runs_per_section": [1], "precision": precision}))

    job(0, "whole", "mixed_bfloat16", 60)  # one batch size only: nothing to fit, no crash
    job(1, "whole", "float32", 100)
    job(2, "sectioned", "mixed_bfloat16", 40)
    main([str(tmp_path)])
    rows = (tmp_path / "report.md").read_text().splitlines()
    assert any("| whole mixed_bfloat16 |" in r and "| 0.60 |" in r for r in rows), rows
    assert any("| sectioned mixed_bfloat16 |" in r and "| 0.40 |" in r for r in rows), rows
