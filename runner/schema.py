"""The typed schema of the runner's config, registered in Hydra's ConfigStore.

`conf/config.yaml` starts from `runner_schema` (which types `engine` and `train`); each `optimizer/` option starts
from `optimizer_<name>_schema`, so a wrong type or an unknown key fails when Hydra composes the config.
`model` and `data` are free-form (each builder has its own arguments) and are checked by `runner.checks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class EngineConfig:
    """Which trainer (`sections.Engine`, or a baseline `sections.WholeGraph` / `sections.RecomputeGrad`) and how."""

    _target_: str = "sections.Engine"
    policy: Any = "recompute"  # recompute | store | recreate, or a list with one per section
    jit_compile: bool = False
    check: bool = False  # compare the sectioned gradients with whole-graph ones
    memory_budget: Any = None  # bytes (int) or a size like "2GiB"; used by sections=auto
    probe_batch: Optional[int] = None  # examples the planner's per-block probe runs; null: the real batch
    lean: bool = True  # batch norm, leaky ReLU, softplus with gradients that keep less (same math); baselines ignore


@dataclass
class TrainConfig:
    """The training loop: length, evaluation, checkpoints and logging cadence."""

    steps: int = 200
    eval_every: int = 50  # 0: evaluate only at the end
    eval_batch: Optional[int] = None  # null: same as `batch`
    checkpoint_every: int = 50  # 0: checkpoint only at the end
    keep_checkpoints: int = 3
    log_every: int = 10  # plain log line cadence when stderr is not a terminal
    progress: str = "auto"  # auto | bar | log
    seed: int = 0
    deterministic: bool = False  # tf.config.experimental.enable_op_determinism()
    inter_op_threads: Optional[int] = None  # threads for independent ops; 1: one op order every step of a run
    verify_exact: bool = True  # before training: one step vs one whole-graph step (state restored after)
    profile_steps: Optional[List[int]] = None  # [first, last]: a TensorBoard profile of those steps
    precision: str = "float32"  # float32 | mixed_bfloat16 | mixed_float16 (Keras dtype policy; float16 scales the loss)


@dataclass
class OptimizerConfig:
    """A Keras optimizer by `_target_`; the fields every Keras optimizer accepts."""

    _target_: str = "keras.optimizers.Adam"
    learning_rate: float = 1e-3
    weight_decay: Optional[float] = None
    clipnorm: Optional[float] = None
    global_clipnorm: Optional[float] = None


@dataclass
class AdamConfig(OptimizerConfig):
    _target_: str = "keras.optimizers.Adam"
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False


@dataclass
class AdamWConfig(AdamConfig):
    _target_: str = "keras.optimizers.AdamW"
    weight_decay: Optional[float] = 0.004


@dataclass
class SGDConfig(OptimizerConfig):
    _target_: str = "keras.optimizers.SGD"
    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False


@dataclass
class RMSpropConfig(OptimizerConfig):
    _target_: str = "keras.optimizers.RMSprop"
    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False


@dataclass
class DistributeConfig:
    """How a run spreads over devices and workers (`runner.distribute`): none | mirrored | multi_worker."""

    kind: str = "none"
    cpu_devices: Optional[int] = None  # mirrored: N logical CPU devices instead of the local GPUs
    cluster: str = "auto"  # multi_worker: auto | tf_config | slurm
    communication: str = "auto"  # multi_worker: auto | ring | nccl
    port_base: int = 8888  # multi_worker under SLURM: first port on each node
    timeout_seconds: Optional[float] = None  # multi_worker: collective-op timeout


@dataclass
class Config:
    """The whole run. `sections`: null (the model's default, else 1), an int, a list of boundary names, or auto."""

    model: Any = MISSING
    data: Any = MISSING
    optimizer: Any = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    distribute: DistributeConfig = field(default_factory=DistributeConfig)
    batch: int = 256
    sections: Any = None
    resume: Optional[str] = None


def register() -> None:
    """Put the schema in Hydra's ConfigStore (idempotent)."""
    from runner.direction import register as register_direction

    register_direction()  # ${metric_direction:}, for sweeper configs
    cs = ConfigStore.instance()
    cs.store(name="runner_schema", node=Config)
    for name, node in [("adam", AdamConfig), ("adamw", AdamWConfig), ("sgd", SGDConfig), ("rmsprop", RMSpropConfig),
                       ("custom", OptimizerConfig)]:
        cs.store(name=f"optimizer_{name}_schema", node=node)
