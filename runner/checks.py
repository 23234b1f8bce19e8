"""Config checks that need no TensorFlow: run before anything is built or written."""

from __future__ import annotations

import math
import re

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.errors import ConfigError

STRATEGIES = ("sectioned", "whole", "recompute_grad")
POLICIES = ("recompute", "store")
PROGRESS = ("auto", "bar", "log")
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*([kKMGT]i?B|B)?\s*$")


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value that cannot work."""
    _positive(cfg, "batch")
    check_sections(cfg.sections, cfg.engine.memory_budget)
    _check_engine(cfg.engine)
    _check_train(cfg.train)
    for group in ("model", "data", "optimizer"):
        node = cfg[group]
        if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
            raise ConfigError(group, OmegaConf.to_yaml(node).strip() if node is not None else None,
                              f"must be a config with a _target_ (pick one with {group}=<option>)")
    default = cfg.model.get("default_sections")
    if default is not None:
        check_sections(default, cfg.engine.memory_budget, key="model.default_sections")
    _check_optimizer(cfg.optimizer)
    if cfg.resume is not None:
        from runner.resume import run_folder

        run_folder(cfg.resume)


def _check_optimizer(optimizer: DictConfig) -> None:
    for key, value in optimizer.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"optimizer.{key}", value, "must be a finite number")
    lr = optimizer.get("learning_rate")
    if isinstance(lr, (int, float)) and not isinstance(lr, bool) and not lr > 0:
        raise ConfigError("optimizer.learning_rate", lr, "must be a positive number")


def check_sections(value, memory_budget=None, key: str = "sections") -> None:
    allowed = "must be a positive integer, a list of boundary names like [scale1,scale2], auto, or null"
    if value is None:
        return
    if isinstance(value, bool) or (isinstance(value, int) and value < 1):
        raise ConfigError(key, value, allowed)
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(key, value, allowed)
        if memory_budget is None:
            raise ConfigError(key, value, "auto needs engine.memory_budget (bytes or a size like 2GiB)")
    if isinstance(value, (list, ListConfig)):
        names = list(value)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError(key, names, "a list of sections must hold one or more boundary names (strings)")
        if len(set(names)) != len(names):
            raise ConfigError(key, names, "boundary names must not repeat")
    elif not isinstance(value, (int, str)):
        raise ConfigError(key, value, allowed)


def _check_engine(engine: DictConfig) -> None:
    if engine.strategy not in STRATEGIES:
        raise ConfigError("engine.strategy", engine.strategy, f"allowed: {', '.join(STRATEGIES)}")
    policies = list(engine.policy) if isinstance(engine.policy, ListConfig) else [engine.policy]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        raise ConfigError("engine.policy", engine.policy,
                          f"allowed: {' or '.join(POLICIES)}, or a list with one of them per section")
    budget = engine.memory_budget
    if budget is not None and (isinstance(budget, bool) or not (
            (isinstance(budget, int) and budget > 0) or (isinstance(budget, str) and _SIZE.match(budget)))):
        raise ConfigError("engine.memory_budget", budget, "must be a byte count or a size like 512MiB or 2GB")


def _check_train(train: DictConfig) -> None:
    _positive(train, "steps", "train.")
    _positive(train, "keep_checkpoints", "train.")
    _positive(train, "log_every", "train.")
    for key in ("eval_every", "checkpoint_every"):
        if train[key] < 0:
            raise ConfigError(f"train.{key}", train[key], "must be 0 (only at the end) or a positive number of steps")
    if train.eval_batch is not None:
        _positive(train, "eval_batch", "train.")
    if train.progress not in PROGRESS:
        raise ConfigError("train.progress", train.progress, f"allowed: {', '.join(PROGRESS)}")
    if not 0 <= train.seed < 2**32:
        raise ConfigError("train.seed", train.seed, f"must be an integer from 0 to {2**32 - 1}")
    window = train.get("profile_steps")
    if window is not None and (len(window) != 2 or not 1 <= window[0] <= window[1] <= train.steps):
        raise ConfigError("train.profile_steps", list(window), f"must be [first, last] with "
                          f"1 <= first <= last <= train.steps ({train.steps}), or null")


def _positive(node: DictConfig, key: str, prefix: str = "") -> None:
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(prefix + key, value, "must be a positive integer")
