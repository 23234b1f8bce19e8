"""The entry point: compose the config, check it, build data, model and engine, train, return the eval metric."""

from __future__ import annotations

from pathlib import Path

import hydra
from omegaconf import DictConfig

from runner import schema
from runner.checks import check_config
from runner.job import guarded

CONF = str(Path(__file__).resolve().parent.parent / "conf")
schema.register()


@hydra.main(version_base="1.3", config_path=CONF, config_name="config")
def main(cfg: DictConfig) -> float:
    """One run (or one sweep job); returns the data's metric on the eval split, the value sweeps optimize."""
    return guarded(run, cfg)


def run(cfg: DictConfig, out: Path) -> float:
    check_config(cfg)
    from runner.build import build
    from runner.train import fit

    return fit(cfg, build(cfg), out)
