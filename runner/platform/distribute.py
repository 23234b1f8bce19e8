"""The `distribute` config group: check it against the environment, and make the `tf.distribute` strategy.

    check(cfg)               # no TensorFlow: the config, TF_CONFIG or SLURM, the batch where the replicas are known
    task(cfg)                # no TensorFlow: this process's place in a multi-worker cluster (None otherwise)
    strategy = make_strategy(cfg)   # None for distribute=none; call it before anything else runs TensorFlow
    replicas(strategy), devices(strategy), is_chief(strategy), summary(strategy)   # summary: for metrics.json

`distribute=none` makes no strategy (the engine's single-device path). `mirrored` is a `MirroredStrategy` over the
local GPUs, or over `cpu_devices` logical CPU devices (they must be configured before TensorFlow initializes its
devices). `multi_worker` is a `MultiWorkerMirroredStrategy` whose cluster comes from TF_CONFIG, or from SLURM through
`SlurmClusterResolver` when the process was started by srun. `batch` is the global batch: it must divide by the
number of replicas.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from runner.errors import ConfigError, RunnerError, apply_rule
from sections import rules

KINDS = ("none", "mirrored", "multi_worker")
CLUSTERS = ("auto", "tf_config", "slurm")
COMMUNICATION = ("auto", "ring", "nccl")
WORKER_TYPES = ("chief", "worker")
# What srun sets for each task of a job step; SlurmClusterResolver reads these.
SLURM_STEP = ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE")


@dataclass(frozen=True)
class Task:
    """This process's place in a multi-worker cluster, as TF_CONFIG or SLURM describe it."""

    source: str  # tf_config | slurm
    type: str  # chief | worker
    index: int
    workers: int  # chief and workers together
    has_chief: bool = False  # the cluster names a chief task

    @property
    def is_chief(self) -> bool:
        """The task that writes: the `chief` if the cluster has one, else worker 0 (TensorFlow's rule)."""
        return self.type == "chief" or (self.type == "worker" and self.index == 0 and not self.has_chief)


def check(cfg: DictConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[Task]:
    """Raise ConfigError for the first distribute setting that cannot work here; return the multi-worker task."""
    node = cfg.distribute
    _choice(node.kind, KINDS, "distribute.kind", " (pick one with distribute=<option>)")
    cpu = node.cpu_devices
    if cpu is not None:
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 1:
            raise ConfigError("distribute.cpu_devices", cpu, "must be a positive integer or null")
        if node.kind != "mirrored":
            raise ConfigError("distribute.cpu_devices", cpu, "only distribute=mirrored uses logical CPU devices "
                              f"(this run has distribute={node.kind})")
        check_batch(cfg.batch, cpu, f"{cpu} logical CPU devices")
    if node.kind != "multi_worker":
        return None
    _choice(node.cluster, CLUSTERS, "distribute.cluster")
    _choice(node.communication, COMMUNICATION, "distribute.communication")
    if isinstance(node.port_base, bool) or not 1 <= node.port_base <= 65535:
        raise ConfigError("distribute.port_base", node.port_base, "must be a port number (1-65535)")
    if node.timeout_seconds is not None and not node.timeout_seconds > 0:
        raise ConfigError("distribute.timeout_seconds", node.timeout_seconds, "must be a positive number or null")
    return task(cfg, environ)


def task(cfg: DictConfig, environ: Optional[Mapping[str, str]] = None) -> Optional[Task]:
    """This process's task for distribute=multi_worker (None for the others), read from TF_CONFIG or SLURM."""
    if cfg.distribute.kind != "multi_worker":
        return None
    env = os.environ if environ is None else environ
    source = cluster_source(cfg.distribute.cluster, env)
    return _tf_config_task(env["TF_CONFIG"]) if source == "tf_config" else _slurm_task(env)


def cluster_source(cluster: str, env: Mapping[str, str]) -> str:
    """Where the cluster comes from: tf_config or slurm, or a ConfigError saying what is missing."""
    has_tf_config = bool(env.get("TF_CONFIG", "").strip())
    missing = [name for name in SLURM_STEP if name not in env]
    if cluster == "tf_config" or (cluster == "auto" and has_tf_config):
        if not has_tf_config:
            raise ConfigError("distribute.cluster", cluster, "TF_CONFIG is not set; it must describe the cluster "
                              'and this task, e.g. {"cluster": {"worker": ["host1:2222", "host2:2222"]}, '
                              '"task": {"type": "worker", "index": 0}}')
        return "tf_config"
    if not missing:
        return "slurm"
    if cluster == "slurm":
        raise ConfigError("distribute.cluster", cluster,
                          f"not inside a SLURM job step ({', '.join(missing)} not set): start the runner with srun")
    raise ConfigError("distribute", "multi_worker", "needs a cluster: set TF_CONFIG (the cluster's workers and this "
                      "task's type and index) or start every worker with srun under SLURM")


def _tf_config_task(text: str) -> Task:
    def bad(why: str) -> ConfigError:
        return ConfigError("TF_CONFIG", _one_line(text), why + '; expected e.g. {"cluster": {"worker": '
                           '["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}')

    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise bad(f"not valid JSON ({err})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("cluster"), dict) or not isinstance(spec.get("task"),
                                                                                                   dict):
        raise bad('must be a JSON object with "cluster" and "task" objects')
    cluster, me = spec["cluster"], spec["task"]
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses or not all(_is_address(a) for a in addresses):
            raise bad(f'cluster["{job}"] must be a non-empty list of "host:port" strings')
    unknown = sorted(set(cluster) - set(WORKER_TYPES))
    if unknown:
        raise bad(f"job {', '.join(unknown)} in cluster: multi_worker trains with chief and worker tasks only")
    if "worker" not in cluster and "chief" not in cluster:
        raise bad("the cluster has no worker")
    if len(cluster.get("chief", [])) > 1:
        raise bad("a cluster has at most one chief")
    kind, index = me.get("type"), me.get("index", 0)
    if kind not in cluster:
        raise bad(f'task type {kind!r} is not a job of the cluster ({", ".join(cluster)})')
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
        raise bad(f"task index {index!r} is not one of the {len(cluster[kind])} {kind} addresses (0-based)")
    workers = sum(len(a) for a in cluster.values())
    return Task("tf_config", kind, index, workers, has_chief="chief" in cluster)


def _slurm_task(env: Mapping[str, str]) -> Task:
    rank, tasks = env["SLURM_PROCID"], env["SLURM_STEP_NUM_TASKS"]
    if not (rank.isdigit() and tasks.isdigit() and int(rank) < int(tasks)):
        raise ConfigError("SLURM_PROCID", f"{rank} (SLURM_STEP_NUM_TASKS={tasks})",
                          "must be a task rank below the number of tasks, as srun sets them")
    return Task("slurm", "worker", int(rank), int(tasks))


def check_batch(batch, replicas: int, where: str) -> None:
    """`batch` is the global batch; each replica takes an equal slice of it (the engine's rule, in config words)."""

    def reason(replicas):
        return (f"must divide by the {replicas} replicas ({where}); use a multiple of {replicas} such as "
                f"{replicas * max(1, batch // replicas)}")

    if isinstance(batch, int):
        apply_rule("batch", batch, rules.check_batch_divides, batch, replicas, wording={"batch_not_divisible": reason})


def make_strategy(cfg: DictConfig, environ: Optional[Mapping[str, str]] = None):
    """The `tf.distribute.Strategy` for `cfg.distribute` (None for distribute=none), checked against `cfg.batch`.

    Call before anything else runs TensorFlow: logical CPU devices (`cpu_devices`), and the CUDA_VISIBLE_DEVICES
    that SlurmClusterResolver sets per task, only take effect before TensorFlow initializes its devices.
    """
    me = check(cfg, environ)
    node = cfg.distribute
    if node.kind == "none":
        return None
    import tensorflow as tf

    key = json.dumps(OmegaConf.to_container(node), sort_keys=True)
    if node.kind == "mirrored":
        if node.cpu_devices is not None:
            _logical_cpus(tf, node.cpu_devices)
            # Reduced on CPU:0 rather than by collective ops, whose keys two strategies in a process would share.
            strategy = _cached(key, lambda: tf.distribute.MirroredStrategy(
                [f"/cpu:{i}" for i in range(node.cpu_devices)], cross_device_ops=tf.distribute.ReductionToOneDevice()))
        else:
            strategy = _cached(key, tf.distribute.MirroredStrategy)
    else:
        options = tf.distribute.experimental.CommunicationOptions(
            implementation={"auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
                            "ring": tf.distribute.experimental.CommunicationImplementation.RING,
                            "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL}[node.communication],
            timeout_seconds=node.timeout_seconds)
        resolver = (_slurm_resolver(tf, node.port_base, os.environ if environ is None else environ)
                    if me.source == "slurm" else tf.distribute.cluster_resolver.TFConfigClusterResolver())
        strategy = _cached(key, lambda: tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=resolver, communication_options=options))
    check_batch(cfg.batch, strategy.num_replicas_in_sync, f"distribute={node.kind} over {', '.join(devices(strategy))}"
                + (f" on each of {me.workers} workers" if me is not None and me.workers > 1 else ""))
    return strategy


_STRATEGIES: dict = {}


def _cached(key: str, make):
    # One strategy per setting per process: sweep jobs in one process reuse it (two strategies over the same
    # devices would share collective keys and clash), and TensorFlow allows one multi-worker set-up per process.
    if key not in _STRATEGIES:
        _STRATEGIES[key] = make()
    return _STRATEGIES[key]


@contextlib.contextmanager
def scratch_folder():
    """A temporary folder a non-chief worker writes into (checkpoints need every worker), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="sectionflow-worker-"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remove_worker_folder(out: Path) -> None:
    """Remove a non-chief worker's run folder if it holds only what Hydra wrote there (its log)."""
    out = Path(out)
    if out.is_dir() and all(p.name.endswith(".log") for p in out.iterdir()):
        shutil.rmtree(out, ignore_errors=True)


def replicas(strategy) -> int:
    """Replicas that share each global batch (1 without a strategy)."""
    return 1 if strategy is None else strategy.num_replicas_in_sync


def devices(strategy) -> list[str]:
    """This worker's replica devices, as TensorFlow names them (short names like `CPU:0` on one machine)."""
    import tensorflow as tf

    if strategy is None:
        return ["GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"]
    names = []
    for name in strategy.extended.worker_devices:
        spec = tf.DeviceSpec.from_string(name)
        short = f"{spec.device_type}:{spec.device_index}"
        names.append(short if spec.job in (None, "localhost") else f"{spec.job}:{spec.task}/{short}")
    return names


def workers(strategy) -> int:
    """Processes training together: the cluster's chief and workers for multi_worker, else 1."""
    resolver = getattr(strategy, "cluster_resolver", None) if strategy is not None else None
    if resolver is None:
        return 1
    spec = resolver.cluster_spec().as_dict()
    return max(1, sum(len(spec.get(job, [])) for job in WORKER_TYPES))


def summary(strategy) -> dict:
    """What metrics.json records about the topology: replicas, workers and this worker's devices."""
    return {"replicas": replicas(strategy), "workers": workers(strategy), "devices": devices(strategy)}


def is_chief(strategy) -> bool:
    """Whether this process writes the run folder, events, checkpoints and metrics (always, on one machine)."""
    return strategy is None or bool(strategy.extended.should_checkpoint)


def local_gpu_count(env: Mapping[str, str]) -> int:
    """NVIDIA GPUs this process may use, without initializing TensorFlow: CUDA_VISIBLE_DEVICES, else nvidia-smi -L."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def _slurm_resolver(tf, port_base: int, env: Mapping[str, str]):
    """SlurmClusterResolver: worker k of a node on port_base + k, each task its share of the node's GPUs.

    On nodes without GPUs it cannot place tasks (it steps through GPU ids), so the cluster it resolves with one
    notional GPU per task is handed to TensorFlow as a CPU-only cluster.
    """
    slurm = tf.distribute.cluster_resolver
    gpus = local_gpu_count(env)
    if gpus:
        return slurm.SlurmClusterResolver(port_base=port_base, gpus_per_node=gpus)
    per_node = max(int(n.split("(")[0]) for n in env["SLURM_STEP_TASKS_PER_NODE"].split(","))
    resolver = slurm.SlurmClusterResolver(port_base=port_base, gpus_per_node=per_node, gpus_per_task=1,
                                          auto_set_gpu=False)
    spec = resolver.cluster_spec()
    task_type, task_id = resolver.get_task_info()
    return slurm.SimpleClusterResolver(spec, task_type=task_type, task_id=task_id, num_accelerators={"GPU": 0},
                                       rpc_layer="grpc")


def _logical_cpus(tf, n: int) -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * n)
    except RuntimeError:  # devices already initialized: fine if they already are these n
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise RunnerError(f"distribute.cpu_devices={n}: TensorFlow already initialized {have} CPU device(s) in "
                              "this process; make the strategy before anything else runs TensorFlow") from None


def _choice(value, allowed: tuple, key: str, hint: str = "") -> None:
    if value not in allowed:
        raise ConfigError(key, value, f"allowed: {', '.join(allowed)}{hint}")


def _is_address(value) -> bool:
    return isinstance(value, str) and value.rpartition(":")[2].isdigit() and bool(value.rpartition(":")[0])


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."
