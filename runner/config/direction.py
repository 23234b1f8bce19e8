"""Which way a sweep should optimize the value each job returns: the direction of the data's metric.

Each job returns the data's eval metric (`accuracy` for images and sequences, `bits_per_char` for text; `eval_loss`
when a source names none). The data source classes declare `metric_direction`; the data builder's return type
says which class it makes, so the direction is known from `data._target_` before any job runs. Sweeper configs
use it as `direction: ${metric_direction:}` (`conf/experiment/optuna_*.yaml`).
"""

from __future__ import annotations

import typing

from omegaconf import OmegaConf

LOWER_IS_BETTER = ("loss", "eval_loss", "bits_per_char", "perplexity")


def metric_direction(*, _root_) -> str:
    """`maximize` or `minimize` for the data `_root_.data._target_` builds (an OmegaConf resolver)."""
    target = OmegaConf.select(_root_, "data._target_")
    if not isinstance(target, str):
        raise ValueError("metric_direction: the config has no data._target_ to read the metric from; set "
                         "hydra.sweeper.direction=maximize or minimize.")
    if OmegaConf.select(_root_, "data.label_format") == "float":  # float targets: mean absolute error
        return "minimize"
    if target == "models.data.tokens":  # labels: accuracy; none: bits per token
        return "maximize" if OmegaConf.select(_root_, "data.y_key") is not None else "minimize"
    return direction_of(target)


def direction_of(target: str) -> str:
    from hydra.utils import get_object

    builder = get_object(target)
    made = builder if isinstance(builder, type) else typing.get_type_hints(builder).get("return")
    classes = typing.get_args(made) or (made,)
    found = {_class_direction(c) for c in classes if isinstance(c, type)}
    if len(found) != 1:
        raise ValueError(f"metric_direction: cannot tell from {target}'s return type whether its metric is "
                         f"maximized or minimized; set hydra.sweeper.direction=maximize or minimize.")
    return found.pop()


def _class_direction(cls: type) -> str:
    declared = getattr(cls, "metric_direction", None)
    if declared in ("maximize", "minimize"):
        return declared
    return "minimize" if getattr(cls, "metric", None) in (None, *LOWER_IS_BETTER) else "maximize"


def register() -> None:
    """Make `${metric_direction:}` available to configs (idempotent)."""
    if not OmegaConf.has_resolver("metric_direction"):
        OmegaConf.register_new_resolver("metric_direction", metric_direction)
