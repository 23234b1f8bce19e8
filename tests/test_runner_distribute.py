"""The runner under tf.distribute: a mirrored run in process (2 logical CPU devices, tests/conftest.py), and two
workers from TF_CONFIG in their own processes. A model without batch norm or dropout trains the same global
batches to the same losses on one device, two replicas or two workers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow as tf
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from runner.app import run
from runner.config.schema import register
from test_distribute_config import free_ports

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
MLP = ["model=mlp", "model.hidden=[16]", "data=synthetic", "data.train_size=96", "data.test_size=32",
       "train=smoke", "train.steps=3", "batch=16", "sections=2", "train.eval_every=3"]


def run_in_process(out: Path, *overrides: str) -> dict:
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[*MLP, *overrides])
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    run(cfg, out)
    return json.loads((out / "metrics.json").read_text())


@pytest.mark.slow  # ~14 s; the engine under MirroredStrategy is tested in process (test_engine_distribute)
@pytest.mark.skipif(len(tf.config.list_logical_devices("CPU")) < 2, reason="needs 2 logical CPU devices")
def test_a_mirrored_run_trains_like_one_device_and_records_its_replicas(tmp_path):
    one = run_in_process(tmp_path / "one")
    two = run_in_process(tmp_path / "two", "distribute=mirrored", "distribute.cpu_devices=2")
    assert (one["replicas"], one["devices"]) == (1, ["CPU:0"])
    assert (two["replicas"], two["workers"], two["devices"]) == (2, 1, ["CPU:0", "CPU:1"])
    assert two["exact"] is True  # the sectioned step equals the whole-graph step under the same strategy
    assert two["forward_runs_per_section"] == [2, 1]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    # Checkpoints save and restore under the strategy: 2 steps, then resumed to 3, equals 3 uninterrupted.
    mirrored = ["distribute=mirrored", "distribute.cpu_devices=2"]
    run_in_process(tmp_path / "part", *mirrored, "train.steps=2")
    resumed = run_in_process(tmp_path / "part", *mirrored, f"resume={tmp_path / 'part'}", "train.steps=3")
    assert (resumed["step"], resumed["loss"]) == (3, two["loss"])


@pytest.mark.slow  # two TensorFlow processes: ~40 s on the shared 2-core machine
def test_two_workers_train_like_one_device_and_only_the_chief_writes(tmp_path):
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "runner", *MLP, "distribute=multi_worker", f"hydra.run.dir={tmp_path / f'w{i}'}"],
        cwd=ROOT, env={**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    chief = json.loads((tmp_path / "w0" / "metrics.json").read_text())
    assert (chief["replicas"], chief["workers"], chief["devices"]) == (2, 2, ["worker:0/CPU:0"])
    assert "ckpt-3.index" in {p.name for p in (tmp_path / "w0" / "checkpoints").glob("*.index")}
    assert not (tmp_path / "w1").exists()  # the other worker wrote into a scratch folder it deleted
    one = subprocess.run([sys.executable, "-m", "runner", *MLP, f"hydra.run.dir={tmp_path / 'one'}"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    single = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert chief["loss"] == pytest.approx(single["loss"], rel=1e-5)
    assert chief["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
