"""Config checks that need no TensorFlow: run before anything is built or written."""

from __future__ import annotations

import math

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.errors import ConfigError, apply_rule
from runner.platform.gpu_memory import check_gpu_memory
from runner.platform.precision import PRECISIONS
from sections import rules

PROGRESS = ("auto", "bar", "log")
RESUME_DATA = ("same", "changed")


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError for the first value that cannot work."""
    if cfg.batch != "max":
        if isinstance(cfg.batch, str):
            raise ConfigError("batch", cfg.batch, "must be a positive integer, or max (the largest batch whose step "
                              "fits the device)")
        _positive(cfg, "batch")
    check_sections(cfg.sections)
    _check_engine(cfg.engine)
    _check_train(cfg.train)
    _check_micro_batch(cfg)
    for group in ("model", "data", "optimizer"):
        node = cfg[group]
        if not isinstance(node, DictConfig) or not isinstance(node.get("_target_"), str):
            raise ConfigError(group, OmegaConf.to_yaml(node).strip() if node is not None else None,
                              f"must be a config with a _target_ (pick one with {group}=<option>)")
    default = cfg.model.get("default_sections")
    if default is not None:
        check_sections(default, key="model.default_sections")
    _check_optimizer(cfg.optimizer)
    budget = cfg.engine.memory_budget
    chosen = cfg.sections if cfg.sections is not None else cfg.model.get("default_sections")
    if isinstance(chosen, ListConfig):
        chosen = list(chosen)
    apply_rule("engine.memory_budget", budget, rules.check_sections_arg, 1 if chosen is None else chosen, budget,
               wording={"budget_needs_auto": lambda: f"only sections=auto plans to a budget; this run has "
                        f"sections={_shown(chosen)}: give sections=auto, or engine.memory_budget=null"})
    resume_data = cfg.get("resume_data", "same")
    if resume_data not in RESUME_DATA:
        raise ConfigError("resume_data", resume_data, "allowed: same (a resume refuses data that changed since the "
                          "run), changed (continue on the changed data knowingly, class numbers kept)")
    if cfg.resume is not None:
        from runner.config.resume import run_folder

        run_folder(cfg.resume)
    elif resume_data == "changed":
        raise ConfigError("resume_data", resume_data, "applies only with resume=<run folder>")


def _check_micro_batch(cfg: DictConfig) -> None:
    """`train.micro_batch`: null, max, or examples per micro-batch from 1 to the batch; not with batch=max (which
    finds the batch whose step fits whole) nor with the update in the backward (the gradients are held for the sum)."""
    value = cfg.train.get("micro_batch")
    if value is None:
        return
    batch = cfg.batch if cfg.batch != "max" else None
    allowed = (f"allowed: max (the largest micro-batch whose step fits the device), null (none), or examples per "
               f"micro-batch from 1 to the batch" + (f" ({batch})" if batch is not None else ""))
    if value != "max":
        apply_rule("train.micro_batch", value, rules.check_micro_batch, value, batch,
                   wording={"micro_batch_value": lambda batch: allowed,
                            "micro_batch_over_batch": lambda batch: f"larger than batch={batch}; {allowed}"})
    if cfg.batch == "max":
        raise ConfigError("train.micro_batch", value, "cannot go with batch=max, which finds the largest batch whose "
                          "step fits whole: give the batch to keep (batch=7500) and micro_batch cuts it to fit")
    if cfg.engine.get("apply") == "in_backward":
        raise ConfigError("engine.apply", "in_backward", f"cannot go with train.micro_batch={value}: the gradients "
                          f"are held and summed over the micro-batches, then applied once; give engine.apply=auto "
                          f"or at_end")


def _check_optimizer(optimizer: DictConfig) -> None:
    for key, value in optimizer.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"optimizer.{key}", value, "must be a finite number")
    lr = optimizer.get("learning_rate")
    if _number(lr) and not lr > 0:
        raise ConfigError("optimizer.learning_rate", lr, "must be a positive number")
    for key in ("beta_1", "beta_2", "rho"):  # Keras accepts any value; outside [0, 1) the averages diverge
        if _number(optimizer.get(key)) and not 0 <= optimizer[key] < 1:
            raise ConfigError(f"optimizer.{key}", optimizer[key], "must be a number from 0 to below 1")
    if _number(optimizer.get("epsilon")) and not optimizer.epsilon > 0:
        raise ConfigError("optimizer.epsilon", optimizer.epsilon, "must be a positive number")
    if _number(optimizer.get("weight_decay")) and optimizer.weight_decay < 0:
        raise ConfigError("optimizer.weight_decay", optimizer.weight_decay, "must be 0 or a positive number, or null "
                          "(a negative decay grows the weights)")
    for key in ("clipnorm", "clipvalue", "global_clipnorm"):  # Keras ignores a negative clipnorm silently
        if _number(optimizer.get(key)) and not optimizer[key] > 0:
            raise ConfigError(f"optimizer.{key}", optimizer[key], "must be a positive number, or null (no clipping)")


def _shown(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, (ListConfig, list)) else str(value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sections(value, memory_budget=None, key: str = "sections") -> None:
    if value is None:
        return
    if isinstance(value, ListConfig):
        value = list(value)
    apply_rule(key, value, rules.check_sections_arg, value, memory_budget)


def _check_engine(engine: DictConfig) -> None:
    if engine._target_ not in rules.TRAINERS:
        raise ConfigError("engine._target_", engine._target_, f"allowed: {', '.join(rules.TRAINERS)}")
    policy = list(engine.policy) if isinstance(engine.policy, ListConfig) else engine.policy
    apply_rule("engine.policy", policy, rules.check_policy_names, policy)
    if engine.memory_budget is not None:
        apply_rule("engine.memory_budget", engine.memory_budget, rules.parse_budget, engine.memory_budget,
                   "memory_budget", False)  # a bare number is refused: 1 byte or the whole device?
    apply_rule("engine.lean", engine.lean, rules.check_lean, engine.lean)
    apply_rule("engine.apply", engine.apply, rules.check_apply, engine.apply)


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
    check_gpu_memory(train.get("gpu_memory"))
    check_plan_cache(train.get("plan_cache"))
    if train.inter_op_threads not in (None, "auto"):
        value = train.inter_op_threads
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError("train.inter_op_threads", value, "allowed: auto, a positive integer, or null")
    if train.precision not in PRECISIONS:
        raise ConfigError("train.precision", train.precision, f"allowed: {', '.join(PRECISIONS)}")
    if not 0 <= train.seed < 2**32:
        raise ConfigError("train.seed", train.seed, f"must be an integer from 0 to {2**32 - 1}")
    window = train.get("profile_steps")
    if window is not None and (len(window) != 2 or not 1 <= window[0] <= window[1] <= train.steps):
        raise ConfigError("train.profile_steps", list(window), f"must be [first, last] with "
                          f"1 <= first <= last <= train.steps ({train.steps}), or null")


def check_plan_cache(value) -> None:
    """`train.plan_cache`: auto (the user's cache folder), null or false (none), or a folder (runner/run/plan_cache.py)."""
    if value is None or value is False or value == "auto":
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError("train.plan_cache", value, "allowed: auto (the user's cache folder), null or false (no "
                                                      "cache), or a folder")


def _positive(node: DictConfig, key: str, prefix: str = "") -> None:
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(prefix + key, value, "must be a positive integer")
