"""End-to-end runs of `python -m runner`: run folder, TensorBoard events, sweeps, resume, Ctrl-C, NaN."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
# A 4-block resnet (initial_conv, scale0, scale1, scale2, final_pool blocks) on the bundled digits; a step is ms.
TRAIN = ["data=digits", "batch=16", "train.steps=4", "train.eval_every=2", "train.eval_batch=180",
         "train.checkpoint_every=2", "train.log_every=1", "train.deterministic=true"]
TINY = ["model=resnet", "model.widths=[4,4,4]", "model.depths=[1,1,1]", "model.default_sections=[scale1,final_pool]",
        *TRAIN]
STEP_TAGS = {"loss/train", "memory/step_peak", "time/step_seconds", "throughput/examples_per_second",
             "memory/section_0", "memory/section_1", "memory/section_2",
             "recompute/section_0", "recompute/section_1", "recompute/section_2"}
EVAL_TAGS = {"loss/eval", "accuracy/eval"}


def runner(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def events(folder: Path):
    """The run's event file, loaded: (tensor tag -> [(step, value)], hparams plugin tag -> content)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    (path,) = glob.glob(str(folder / "events.out.tfevents.*"))
    acc = ea.EventAccumulator(path, size_guidance={ea.TENSORS: 0})
    acc.Reload()
    value = lambda e: tensor_util.make_ndarray(e.tensor_proto).tolist()  # noqa: E731
    scalars = {tag: [(e.step, value(e)) for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
    return scalars, acc.PluginTagToContent("hparams")


def session_hparams(content: dict) -> dict:
    from tensorboard.plugins.hparams import metadata

    info = metadata.parse_session_start_info_plugin_data(content["_hparams_/session_start_info"])
    return {k: v.number_value if v.HasField("number_value") else v.string_value for k, v in info.hparams.items()}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("single") / "run"
    proc = runner(*TINY, f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_run_folder_holds_config_table_metrics_and_checkpoints(tiny_run):
    out, proc = tiny_run
    for name in ("config.yaml", "partition.txt", "metrics.json", "runner.log"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").glob("*.index")) == ["ckpt-2.index", "ckpt-4.index"]
    table = (out / "partition.txt").read_text()
    assert "scale1/block_0" in table and table in proc.stdout + "\n"
    assert "tensorboard --logdir" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["metric"] == "accuracy" and 0 <= metrics["accuracy"] <= 1
    assert metrics["median_step_seconds"] > 0 and metrics["examples_per_second"] > 0
    assert len(metrics["peak_bytes_per_section"]) == 3 and metrics["forward_runs_per_section"] == [2, 2, 1]
    assert "step 4/4" in proc.stdout


def test_event_file_holds_every_tag_text_and_hparams(tiny_run):
    out, _ = tiny_run
    scalars, hparams = events(out)
    assert STEP_TAGS | EVAL_TAGS | {"config", "partition"} <= set(scalars)
    assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["accuracy/eval"]] == [2, 4]
    assert [v for _, v in scalars["recompute/section_0"]] == [2, 2, 2, 2]
    values = session_hparams(hparams)
    assert values["batch"] == 16 and values["model"] == "resnet" and values["sections"] == "[scale1,final_pool]"


def test_tensorboard_serves_the_scalar_tags(tiny_run):
    out, _ = tiny_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tensorboard = Path(sys.executable).with_name("tensorboard")
    proc = subprocess.Popen([str(tensorboard), "--logdir", str(out.parent), "--port", str(port), "--host",
                             "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
    try:
        tags, deadline = {}, time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/tags", timeout=5) as r:
                    tags = json.load(r)
                if STEP_TAGS <= set(tags.get(out.name, {})):
                    break
            except OSError:
                pass
            time.sleep(1)
        assert STEP_TAGS | EVAL_TAGS <= set(tags.get(out.name, {})), tags
    finally:
        proc.terminate()
        proc.wait(10)


def test_resumed_run_has_the_uninterrupted_losses(tiny_run, tmp_path):
    full, _ = tiny_run
    first, second = tmp_path / "first", tmp_path / "second"
    proc = runner(*TINY, "train.steps=2", f"hydra.run.dir={first}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = runner(*TINY, f"resume={first}", f"hydra.run.dir={second}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    losses = {**dict(events(first)[0]["loss/train"]), **dict(events(second)[0]["loss/train"])}
    assert losses == dict(events(full)[0]["loss/train"])
    assert events(second)[0]["accuracy/eval"][-1] == events(full)[0]["accuracy/eval"][-1]


def test_sweep_2x2_makes_four_runs_with_hparams_and_clean_state(tmp_path):
    sweep = tmp_path / "sweep"
    proc = runner("-m", *TINY, "train.steps=2", "batch=8,16", "sections=2,3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    seen, losses = set(), {}
    for job in jobs:
        scalars, hparams = events(job)
        values = session_hparams(hparams)
        seen.add((values["batch"], values["sections"]))
        losses.setdefault(values["batch"], []).append([v for _, v in scalars["loss/train"]])
        assert json.loads((job / "status.json").read_text())["status"] == "completed"
    assert seen == {(8, 2), (8, 3), (16, 2), (16, 3)}
    for runs in losses.values():  # the partition does not change the math; a leaked state would
        assert runs[0] == pytest.approx(runs[1], rel=1e-5)
    assert "4 jobs, 4 completed, 0 failed" in proc.stdout


def test_failing_sweep_job_does_not_stop_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    proc = runner("-m", *TINY, "train.steps=1", "batch=0,8", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                  f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 1
    assert json.loads((sweep / "0" / "status.json").read_text())["status"] == "failed"
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "completed"
    assert "2 jobs, 1 completed, 1 failed" in proc.stdout
    assert "batch=0: must be a positive integer" in proc.stderr.split("[sweep] failed jobs:")[1]
    assert "Traceback" not in proc.stderr


def test_nan_loss_stops_naming_the_step_and_keeps_good_checkpoints(tmp_path):
    out = tmp_path / "nan"
    proc = runner("model=mlp", "model.hidden=[16]", *TRAIN, "optimizer=sgd",
                  "optimizer.learning_rate=1e10", "train.steps=20", "train.checkpoint_every=1",
                  f"hydra.run.dir={out}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: loss is") and " at step " in line and "Traceback" not in proc.stderr
    bad = int(line.split(" at step ")[1].split(";")[0])
    saved = sorted(int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("ckpt-*.index"))
    assert saved and max(saved) == bad - 1
    assert not (out / "metrics.json").exists()


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "runner", *TINY, "train.steps=100000", "train.eval_every=0",
           "train.checkpoint_every=0", f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "step 3/" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert "interrupted at step" in err and f"resume={out}" in err
    step = int(err.split("interrupted at step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"ckpt-{step}.index").is_file()
    assert dict(events(out)[0]["loss/train"]).keys() == set(range(1, step + 1))


@pytest.mark.parametrize("args", [
    ["model=mlp", "model.hidden=[16]"],
    ["model=attention", "model.filters=[4,4]", "model.hidden=8"],
    ["model=seq2seq", "data=sequences", "model.units=8", "model.embed_dim=4", "data.eval_size=32"],
    ["model=resnet", "model.widths=[4,4,4]", "model.depths=[1,1,1]", "data=synthetic", "sections=auto",
     "engine.memory_budget=1GiB"],
], ids=["mlp", "attention", "seq2seq", "resnet-auto"])
def test_every_model_runs_end_to_end_and_is_exact(args, tmp_path):
    proc = runner(*args, "train=smoke", "batch=16", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["exact"] is True and metrics["step"] == 4
