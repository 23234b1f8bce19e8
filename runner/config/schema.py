"""The typed schema of the runner's config, registered in Hydra's ConfigStore.

`conf/config.yaml` starts from `runner_schema` (which types `engine` and `train`); each `optimizer/` option starts
from `optimizer_<name>_schema`, so a wrong type or an unknown key fails when Hydra composes the config. The
defaults of `engine`, `train`, `distribute` and the top-level keys are the YAML's (`conf/engine/default.yaml`,
`conf/train/default.yaml`, `conf/distribute/*.yaml`, `conf/config.yaml`): the schema types them and reads their
values from there; the optimizer options' YAML sets what the schema leaves MISSING.
`model` and `data` are free-form (each builder has its own arguments) and are checked by `runner.config.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


CONF = Path(__file__).resolve().parents[2] / "conf"


def defaults_from(sources):
    """A dataclass whose field defaults are read from the YAML in `conf/`, where each default and its comment are
    written (once). ``sources``: a file (every annotated field, and no other key, must be in it), or
    ``{file: [fields]}`` (those fields from that file). A field the YAML lacks, or a key the class does not type,
    fails at import: the two cannot drift apart."""

    def wrap(cls):
        for yaml_file, keys in ({sources: None} if isinstance(sources, str) else sources).items():
            values = OmegaConf.to_container(OmegaConf.load(CONF / yaml_file))
            values.pop("defaults", None)
            typed = list(keys if keys is not None else cls.__annotations__)
            extra = [k for k in values if k not in cls.__annotations__] if keys is None else []
            missing = [k for k in typed if k not in values]
            if missing or extra:
                raise TypeError(f"conf/{yaml_file} and runner.config.schema.{cls.__name__} disagree: "
                                f"{'not in the YAML: ' + ', '.join(missing) if missing else ''}"
                                f"{'; ' if missing and extra else ''}"
                                f"{'not typed: ' + ', '.join(extra) if extra else ''}")
            for key in typed:
                value = values[key]
                setattr(cls, key, field(default_factory=lambda v=value: list(v)) if isinstance(value, list) else value)
        return dataclass(cls)

    return wrap


@defaults_from("engine/default.yaml")
class EngineConfig:
    """Which trainer (`sections.Engine`, or a baseline `sections.WholeGraph` / `sections.RecomputeGrad`) and how."""

    _target_: str
    policy: Any
    jit_compile: bool
    check: bool
    memory_budget: Any
    lean: Any  # true, false or recompute (runner.config.checks)
    apply: str  # auto, in_backward or at_end (sections.step.update)
    probe_batch: Optional[int]


@defaults_from("train/default.yaml")
class TrainConfig:
    """The training loop: length, evaluation, checkpoints and logging cadence."""

    steps: int
    eval_every: int
    eval_batch: Optional[int]
    micro_batch: Any  # null, a positive int or max (checks.py)
    checkpoint_every: int
    keep_checkpoints: int
    log_every: int
    progress: str
    seed: int
    deterministic: bool
    gpu_memory: Any  # a size or null (runner.platform.gpu_memory)
    plan_cache: Any  # auto, null/false or a folder (runner.run.plan_cache)
    inter_op_threads: Any  # auto, a positive int or null (checks.py)
    verify_exact: bool
    profile_steps: Optional[List[int]]
    oom_breakdown: bool
    precision: str
    save_model: Any


# Each optimizer/ option's YAML sets `_target_`, `learning_rate` and what it changes from Keras's defaults; the
# schema types those (MISSING: the YAML's value) and holds Keras's defaults for the rest.
@dataclass
class OptimizerConfig:
    """A Keras optimizer by `_target_`; the fields every Keras optimizer accepts."""

    _target_: str = MISSING
    learning_rate: float = MISSING
    weight_decay: Optional[float] = None
    clipnorm: Optional[float] = None
    global_clipnorm: Optional[float] = None


@dataclass
class AdamConfig(OptimizerConfig):
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False


@dataclass
class AdamWConfig(AdamConfig):
    weight_decay: Optional[float] = MISSING


@dataclass
class SGDConfig(OptimizerConfig):
    momentum: float = MISSING
    nesterov: bool = MISSING


@dataclass
class RMSpropConfig(OptimizerConfig):
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False


@defaults_from({"distribute/none.yaml": ["kind"], "distribute/mirrored.yaml": ["cpu_devices"],
                "distribute/multi_worker.yaml": ["cluster", "communication", "port_base", "timeout_seconds"]})
class DistributeConfig:
    """How a run spreads over devices and workers (`runner.platform.distribute`); each field's default and meaning
    are in the `distribute/` option that uses it."""

    kind: str
    cpu_devices: Optional[int]
    cluster: str
    communication: str
    port_base: int
    timeout_seconds: Optional[float]


@defaults_from({"config.yaml": ["batch", "sections", "resume", "resume_data"]})
class Config:
    """The whole run (`conf/config.yaml` says what `batch`, `sections`, `resume` and `resume_data` hold)."""

    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    batch: Any  # a positive int, or max (the largest batch that fits: runner/run/batch_max.py)
    sections: Any
    resume: Optional[str]
    resume_data: str  # same or changed (runner.config.checks; runner.run.datafeed.resumed_data)


def register() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent)."""
    from runner.config.direction import register as register_direction

    register_direction()  # ${metric_direction:}, for sweeper configs
    cs = ConfigStore.instance()
    cs.store(name="runner_schema", node=Config)
    for name, node in [("adam", AdamConfig), ("adamw", AdamWConfig), ("sgd", SGDConfig), ("rmsprop", RMSpropConfig),
                       ("custom", OptimizerConfig)]:
        cs.store(name=f"optimizer_{name}_schema", node=node)
