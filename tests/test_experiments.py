"""Every experiment config composes, and the GPT benchmark's cases are the strategies BENCHMARKS.md reports."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from runner.app import CONF
from runner.config.checks import check_config
from runner.config.schema import register


def composed(*overrides):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


@pytest.mark.parametrize("name", sorted(p.stem for p in (Path(CONF) / "experiment").glob("*.yaml")))
def test_experiment_composes_and_passes_the_config_checks(name):
    params = composed(f"experiment={name}").hydra.sweeper.get("params") or {}
    # The first job of a basic sweep (Optuna's distributions are left to the sweeper).
    first = [f"{k}={str(v).split(',')[0]}" for k, v in params.items() if "(" not in str(v)]
    check_config(composed(f"experiment={name}", *first))


def test_bench_gpt_sweeps_whole_recompute_grad_sectioned_and_auto_at_1024_characters():
    cfg = composed("experiment=bench_gpt")
    cases = cfg.hydra.sweeper.params["+bench"].split(",")
    assert cfg.data.seq_len == 1024 and cfg.model._target_ == "models.build_gpt"
    got = {}
    for case in cases:
        c = composed("experiment=bench_gpt", f"+bench={case}")
        check_config(c)
        got[case] = (c.engine._target_, c.sections, c.engine.memory_budget)
    assert got == {
        "whole": ("sections.WholeGraph", 1, None),
        "gpt_recompute_grad_8": ("sections.RecomputeGrad", 8, None),
        "gpt_sectioned_8": ("sections.Engine", 8, None),
        "gpt_auto_400MiB": ("sections.Engine", "auto", "400MiB"),
        "gpt_auto_250MiB": ("sections.Engine", "auto", "250MiB"),
    }
