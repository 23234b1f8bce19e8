"""The `distribute` group: its configs, the checks of config and environment (no TensorFlow), and the strategies.

Strategies are made in fresh processes (tests/distribute_worker.py): logical CPU devices only take effect before
TensorFlow initializes its devices, and a multi-worker cluster needs one process per worker.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.app import CONF
from runner.config.schema import register
from runner.errors import ConfigError
from runner.platform import distribute

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "distribute_worker.py")
# No GPU for the strategies below, whatever the machine has; SLURM variables of the machine running the tests removed.
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TF_CONFIG"))},
       "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
TWO_WORKERS = {"cluster": {"worker": ["localhost:2222", "localhost:2223"]}, "task": {"type": "worker", "index": 1}}
SRUN = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def composed(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def refused(cfg, environ: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        distribute.check(cfg, environ)
    message = str(caught.value)
    assert caught.value.exit_code == 2 and "\n" not in message
    return message


def test_none_is_the_default_and_every_option_composes():
    assert composed().distribute.kind == "none"
    assert composed("distribute=mirrored", "distribute.cpu_devices=2").distribute.cpu_devices == 2
    node = composed("distribute=multi_worker").distribute
    assert (node.kind, node.cluster, node.communication) == ("multi_worker", "auto", "auto")
    with pytest.raises(ConfigCompositionException):
        composed("distribute=mirrored", "distribute.cpu_devices=two")  # the schema types every field


@pytest.mark.parametrize("overrides, environ, message", [
    (["distribute=mirrored", "distribute.cpu_devices=2", "batch=7"], {},
     "batch=7: must divide by the 2 replicas (2 logical CPU devices); use a multiple of 2 such as 6"),
    (["distribute=multi_worker"], {},
     "distribute=multi_worker: needs a cluster: set TF_CONFIG (the cluster's workers and this task's type and "
     "index) or start every worker with srun under SLURM"),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": '},
     'TF_CONFIG={"cluster": {"worker": ["a:1"]}, "task":: not valid JSON (Expecting value: line 1 column 42'),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:1"]}}'},
     'must be a JSON object with "cluster" and "task" objects'),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", '
                                                '"index": 1}}'},
     "task index 1 is not one of the 1 worker addresses (0-based)"),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a"]}, "task": {"type": "worker"}}'},
     'cluster["worker"] must be a non-empty list of "host:port" strings'),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a:1"], "ps": ["b:2"]}, '
                                                '"task": {"type": "worker"}}'},
     "job ps in cluster: multi_worker trains with chief and worker tasks only"),
    (["distribute=multi_worker"], {"TF_CONFIG": '{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief"}}'},
     "task type 'chief' is not a job of the cluster (worker)"),
    (["distribute=multi_worker", "distribute.cluster=slurm"], {"TF_CONFIG": json.dumps(TWO_WORKERS)},
     "distribute.cluster=slurm: not inside a SLURM job step (SLURM_PROCID, SLURM_STEP_NUM_TASKS, "
     "SLURM_STEP_NODELIST, SLURM_STEP_TASKS_PER_NODE not set): start the runner with srun"),
    (["distribute=multi_worker", "distribute.cluster=tf_config"], SRUN, "distribute.cluster=tf_config: TF_CONFIG is "
                                                                        "not set"),
    (["distribute=multi_worker", "distribute.cluster=mpi"], SRUN,
     "distribute.cluster=mpi: allowed: auto, tf_config, slurm"),
    (["distribute=multi_worker", "distribute.communication=gloo"], SRUN,
     "distribute.communication=gloo: allowed: auto, ring, nccl"),
    (["distribute=multi_worker", "distribute.timeout_seconds=0"], SRUN,
     "distribute.timeout_seconds=0.0: must be a positive number or null"),
    (["distribute=multi_worker"], {**SRUN, "SLURM_PROCID": "2"},
     "SLURM_PROCID=2 (SLURM_STEP_NUM_TASKS=2): must be a task rank below the number of tasks, as srun sets them"),
    (["distribute.cpu_devices=2"], {}, "distribute.cpu_devices=2: only distribute=mirrored uses logical CPU devices "
                                       "(this run has distribute=none)"),
    (["distribute=mirrored", "distribute.cpu_devices=0"], {}, "distribute.cpu_devices=0: must be a positive integer"),
    (["distribute.kind=pipeline"], {}, "distribute.kind=pipeline: allowed: none, mirrored, multi_worker"),
], ids=["batch-not-divisible", "multi-worker-no-cluster", "tf-config-not-json", "tf-config-no-task",
        "tf-config-index-out-of-range", "tf-config-no-port", "tf-config-ps-job", "tf-config-unknown-type",
        "slurm-not-under-srun", "tf-config-not-set", "unknown-cluster", "unknown-communication", "zero-timeout",
        "slurm-rank-out-of-range",
        "cpu-devices-without-mirrored", "zero-cpu-devices", "unknown-kind"])
def test_bad_distribute_input_is_one_line_naming_the_value(overrides, environ, message):
    assert message in refused(composed(*overrides), environ)


def test_the_chief_is_the_chief_task_else_worker_0_else_slurm_rank_0():
    cfg = composed("distribute=multi_worker")
    task = lambda spec: distribute.check(cfg, {"TF_CONFIG": json.dumps(spec)})  # noqa: E731
    assert task(TWO_WORKERS) == distribute.Task("tf_config", "worker", 1, 2)
    assert not task(TWO_WORKERS).is_chief
    assert task({**TWO_WORKERS, "task": {"type": "worker", "index": 0}}).is_chief
    with_chief = {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}}
    assert not task({**with_chief, "task": {"type": "worker", "index": 0}}).is_chief
    assert task({**with_chief, "task": {"type": "chief", "index": 0}}).workers == 2
    assert distribute.check(cfg, SRUN) == distribute.Task("slurm", "worker", 1, 2)
    assert distribute.check(cfg, {**SRUN, "SLURM_PROCID": "0"}).is_chief
    assert distribute.check(composed("distribute=mirrored"), {}) is None


def test_checks_do_not_import_tensorflow():
    code = ("import sys; from omegaconf import OmegaConf; from runner.platform import distribute; "
            "from runner.config.schema import Config; cfg = OmegaConf.merge(OmegaConf.structured(Config), {'distribute': {'kind': 'multi_worker'}}); "
            "print(distribute.check(cfg, {'TF_CONFIG': sys.argv[1]}).is_chief, 'tensorflow' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({**TWO_WORKERS, "task": {"type": "worker"}})],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["True", "False"], proc.stderr[-2000:]


def worker(overrides: dict, batch: int = 8, *then: dict, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, json.dumps(overrides), str(batch), *map(json.dumps, then)],
                            cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outcome(proc: subprocess.Popen) -> list[dict]:
    try:
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]

@pytest.mark.slow  # ~5 s; the engine under 2 logical CPUs stays in test_engine_distribute

def test_mirrored_over_two_logical_cpu_devices_has_two_replicas():
    seen, again = outcome(worker({"kind": "mirrored", "cpu_devices": 2}, 8, {"kind": "mirrored", "cpu_devices": 4}))
    assert seen == {"replicas": 2, "workers": 1, "devices": ["CPU:0", "CPU:1"], "chief": True, "task_chief": None,
                    "sum": 3.0}
    assert again["error"] == ("distribute.cpu_devices=4: TensorFlow already initialized 2 CPU device(s) in this "
                              "process; make the strategy before anything else runs TensorFlow")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow  # ~30 s on the shared 2-core machine; the runner's multi-worker test covers TF_CONFIG by default
def test_two_workers_from_tf_config_all_reduce_over_both():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [worker({"kind": "multi_worker"}, env={**ENV, "TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}})}) for i in range(2)]
    (first,), (second,) = [outcome(p) for p in procs]
    assert first == {"replicas": 2, "workers": 2, "devices": ["worker:0/CPU:0"], "chief": True, "task_chief": True,
                     "sum": 3.0}
    assert second == {"replicas": 2, "workers": 2, "devices": ["worker:1/CPU:0"], "chief": False,
                      "task_chief": False, "sum": 3.0}


@pytest.mark.slow
def test_two_slurm_tasks_on_a_cpu_node_all_reduce_over_both():
    (port,) = free_ports(1)  # SlurmClusterResolver puts task k of a node on port_base + k
    slurm = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "localhost", "SLURM_STEP_TASKS_PER_NODE": "2"}
    procs = [worker({"kind": "multi_worker", "port_base": port}, env={**ENV, **slurm, "SLURM_PROCID": str(i)})
             for i in range(2)]
    (first,), (second,) = [outcome(p) for p in procs]
    assert (first["replicas"], first["workers"], first["chief"], first["sum"]) == (2, 2, True, 3.0)
    assert (second["replicas"], second["chief"], second["devices"]) == (2, False, ["worker:1/CPU:0"])


@pytest.mark.slow
def test_a_dead_worker_makes_the_other_fail_instead_of_hanging():
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    procs = [worker({"kind": "multi_worker"}, env={**ENV, "TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": i}}), **extra})
        for i, extra in enumerate([{"FAKE_WORKER_WAITS": "3"}, {"FAKE_WORKER_DIES": "1"}])]
    try:
        out, err = procs[0].communicate(timeout=180)  # a hang fails here
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode != 0 and "UnavailableError" in err and "/job:worker/replica:0/task:1" in err
