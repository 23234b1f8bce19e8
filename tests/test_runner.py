"""End-to-end runs of `python -m runner`: run folder, TensorBoard events, sweeps, resume, signals, NaN, profiler."""

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
STEP_TAGS = {"loss/train", "memory_MiB/step_peak", "time/step_seconds", "throughput/examples_per_second",
             "memory_MiB/section_0", "memory_MiB/section_1", "memory_MiB/section_2",
             "forward_runs/section_0", "forward_runs/section_1", "forward_runs/section_2"}
EVAL_TAGS = {"loss/eval", "accuracy/eval"}


def runner(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def events(folder: Path):
    """The run's event files, loaded as TensorBoard does: (tensor tag -> [(step, value)], hparams plugin content)."""
    from tensorboard.backend.event_processing import event_accumulator as ea
    from tensorboard.util import tensor_util

    assert glob.glob(str(folder / "events.out.tfevents.*"))
    acc = ea.EventAccumulator(str(folder), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    value = lambda e: tensor_util.make_ndarray(e.tensor_proto).tolist()  # noqa: E731
    scalars = {tag: [(e.step, value(e)) for e in acc.Tensors(tag)] for tag in acc.Tags()["tensors"]}
    return scalars, acc.PluginTagToContent("hparams")


def session_hparams(content: dict) -> dict:
    from tensorboard.plugins.hparams import metadata

    info = metadata.parse_session_start_info_plugin_data(content["_hparams_/session_start_info"])
    values = {k: v.number_value if v.HasField("number_value") else v.string_value for k, v in info.hparams.items()}
    return values, info.group_name


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("single") / "run"
    proc = runner(*TINY, "train.profile_steps=[2,3]", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_run_folder_holds_config_table_metrics_and_checkpoints(tiny_run):
    out, proc = tiny_run
    for name in ("config.yaml", "partition.txt", "metrics.json", "runner.log", "run.json"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in (out / "checkpoints").glob("*.index")) == ["ckpt-2.index", "ckpt-4.index"]
    table = (out / "partition.txt").read_text()
    assert "scale1/block_0" in table and table in proc.stdout + "\n"
    session = json.loads((out / "run.json").read_text())["sessions"][0]
    assert session["command"].startswith("python -m runner model=resnet") and session["device"].startswith(("CPU", "1"))
    assert set(session["versions"]) >= {"tensorflow", "keras", "hydra"}
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["metric"] == "accuracy" and 0 <= metrics["accuracy"] <= 1
    assert metrics["median_step_seconds"] > 0 and metrics["examples_per_second"] > 0
    assert len(metrics["peak_bytes_per_section"]) == 3 and metrics["forward_runs_per_section"] == [2, 2, 1]
    assert "step 4/4" in proc.stdout


@pytest.mark.slow  # ~6 s: a run and tensorboard's start
def test_console_is_short_and_the_tensorboard_hint_runs(tiny_run):
    out, proc = tiny_run
    assert "cuInit" not in proc.stderr and "absl::InitializeLog" not in proc.stderr
    assert "_target_" not in proc.stdout  # the composed config went to config.yaml and the log file, not the console
    assert "_target_: models.build_resnet" in (out / "runner.log").read_text()
    assert "done:" in proc.stdout and "eval accuracy" in proc.stdout and '{"strategy"' not in proc.stdout
    hint = proc.stdout.strip().splitlines()[-1]
    assert hint.startswith("TensorBoard: ") and "--logdir" in hint
    command = hint.split(": ", 1)[1].split(" --logdir")[0]
    version = subprocess.run([*command.split(), "--version_tb"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr[-2000:]


def test_profiler_writes_a_trace_of_the_chosen_steps(tiny_run):
    out, proc = tiny_run
    assert glob.glob(str(out / "plugins" / "profile" / "*" / "*.xplane.pb")), sorted(out.rglob("*"))
    assert "profile of steps 2-3" in proc.stdout


def test_flops_per_section_are_counted(tiny_run):
    out, proc = tiny_run
    metrics = json.loads((out / "metrics.json").read_text())
    flops = metrics["flops_per_section"]
    assert len(flops) == 3 and all(f["forward"] > 0 and f["backward"] > f["forward"] for f in flops)
    assert metrics["rerun_flops"] == sum((r - 1) * f["forward"]
                                         for r, f in zip(metrics["forward_runs_per_section"], flops))
    assert "FLOPs" in (out / "partition.txt").read_text()


def test_event_file_holds_every_tag_text_and_hparams(tiny_run):
    out, _ = tiny_run
    scalars, hparams = events(out)
    metrics = json.loads((out / "metrics.json").read_text())
    # This tiny model's tensors lie near oneDNN's allocator resolution (256 KiB): in some processes no step is
    # measured (1 suite run in 4 this session), and then no memory tag is written at all, never a 0.
    measured = metrics["step_peak_bytes"] is not None
    memory = {t for t in STEP_TAGS if t.startswith("memory_MiB/")}
    assert (STEP_TAGS - memory) | EVAL_TAGS | {"config", "partition"} <= set(scalars)
    assert [s for s, _ in scalars["loss/train"]] == [1, 2, 3, 4]
    assert [s for s, _ in scalars["accuracy/eval"]] == [2, 4]
    assert [v for _, v in scalars["forward_runs/section_0"]] == [2, 2, 2, 2]
    # A section's own window can read nothing where the step as a whole read something: its tag is written
    # exactly where metrics.json has its peak.
    sections = {f"memory_MiB/section_{k}" for k, p in enumerate(metrics["peak_bytes_per_section"]) if p is not None}
    assert memory & set(scalars) == ({"memory_MiB/step_peak"} if measured else set()) | sections
    if measured:  # MiB, not bytes: the largest logged step peak is metrics.json's step_peak_bytes / 2**20
        assert max(v for _, v in scalars["memory_MiB/step_peak"]) == pytest.approx(metrics["step_peak_bytes"] / 2**20)
    assert {t for t in scalars if t.startswith("final/")} == {
        "final/loss", "final/eval_loss", "final/accuracy", "final/median_step_seconds",
        "final/examples_per_second", *(["final/step_peak_MiB"] if measured else [])}
    values, trial = session_hparams(hparams)
    assert values["batch"] == "16" and values["model"] == "resnet" and values["sections"] == "[scale1,final_pool]"
    assert trial.startswith("model=resnet model.widths=[4,4,4]")
    from tensorboard.plugins.custom_scalar import layout_pb2

    (_, raw), = scalars["custom_scalars__config__"]
    charts = {c.title: list(c.multiline.tag) for cat in layout_pb2.Layout.FromString(raw).category for c in cat.chart}
    assert {tuple(tags) for tags in charts.values()} >= {(r"memory_MiB/section_\d+",), (r"forward_runs/section_\d+",)}
    assert any("MiB" in title for title in charts)

@pytest.mark.slow  # ~8 s; the event file's tags are read in the fast set

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

@pytest.mark.slow  # ~40 s; resume through the CLI stays in the fast set via test_runner_faults (overrides on resume) and in-process checkpoint tests

def test_resume_continues_in_the_same_folder_from_its_own_config(tiny_run, tmp_path):
    full, _ = tiny_run
    run = tmp_path / "run"
    proc = runner(*TINY, "train.steps=2", f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # no overrides repeated; a different partition does not change the math
    proc = runner(f"resume={run}", "train.steps=4", "sections=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    losses, reference = dict(events(run)[0]["loss/train"]), dict(events(full)[0]["loss/train"])
    assert sorted(losses) == [1, 2, 3, 4]
    assert [losses[s] for s in (1, 2)] == [reference[s] for s in (1, 2)]
    assert [losses[s] for s in (3, 4)] == pytest.approx([reference[s] for s in (3, 4)], rel=1e-5)
    assert events(run)[0]["accuracy/eval"][-1][1] == pytest.approx(events(full)[0]["accuracy/eval"][-1][1], abs=1e-6)
    assert json.loads((run / "metrics.json").read_text())["step"] == 4
    assert "sections: 2" in (run / "config.yaml").read_text()
    assert "sections: null" in (run / "config.1.yaml").read_text()

    # a new learning rate is applied after restoring (the checkpoint's value would win) and recorded
    proc = runner(f"resume={run}", "train.steps=5", "optimizer.learning_rate=0.0005")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer.learning_rate 0.001 -> 0.0005 (applied" in proc.stdout
    import tensorflow as tf

    reader = tf.train.load_checkpoint(str(run / "checkpoints" / "ckpt-5"))
    (key,) = [k for k in reader.get_variable_to_shape_map() if k.startswith("optimizer/_learning_rate/")]
    assert reader.get_tensor(key) == pytest.approx(0.0005)
    assert "learning_rate: 0.0005" in (run / "config.yaml").read_text()
    assert "learning_rate: 0.001" in (run / "config.2.yaml").read_text()
    assert len(json.loads((run / "run.json").read_text())["sessions"]) == 3

    # the optimizer's class cannot change under its saved state
    proc = runner(f"resume={run}", "train.steps=6", "optimizer=sgd")
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: resume=")
    assert "optimizer._target_ (keras.optimizers.Adam -> keras.optimizers.SGD)" in line


@pytest.mark.slow  # ~20 s; test_runner_checkpoint restores seed states in process and repeats the draws
def test_killed_run_with_dropout_resumes_bit_identically(tmp_path):
    """kill -9 mid-run, resume: the losses equal an uninterrupted run's (dropout's seed state is checkpointed)."""
    args = ["model=mlp", "model.hidden=[32]", "model.dropout=0.3", "data=synthetic", "batch=32",
            "train.verify_exact=false", "train.eval_every=0", "train.checkpoint_every=4", "train.progress=log",
            "train.log_every=1", "train.deterministic=true"]
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "runner", *args, "train.steps=100000", f"hydra.run.dir={killed}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "step 6/" in line:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    saved = max(int(p.stem.split("-")[1]) for p in (killed / "checkpoints").glob("ckpt-*.index"))
    steps = saved + 2
    proc = runner(f"resume={killed}", f"train.steps={steps}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = tmp_path / "whole"
    proc = runner(*args, f"train.steps={steps}", f"hydra.run.dir={whole}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = events(killed)[0]["loss/train"], events(whole)[0]["loss/train"]
    assert [s for s, _ in resumed] == list(range(1, steps + 1))  # the killed run's tail was dropped
    assert resumed == reference

@pytest.mark.slow  # ~23 s; test_failing_sweep_job_does_not_stop_the_others runs a sweep in the fast set

def test_sweep_makes_one_run_per_job_with_hparams_and_clean_state(tmp_path):
    sweep = tmp_path / "sweep"
    # both jobs in one process, with one inter-op thread (set once, kept for the second job)
    proc = runner("-m", *TINY, "train.steps=2", "batch=8", "sections=2,3", "train.inter_op_threads=1",
                  f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    seen, losses = set(), []
    for job in jobs:
        scalars, hparams = events(job)
        values, _ = session_hparams(hparams)
        seen.add((int(values["batch"]), int(values["sections"])))
        losses.append([v for _, v in scalars["loss/train"]])
        assert json.loads((job / "status.json").read_text())["status"] == "completed"
    assert seen == {(8, 2), (8, 3)}
    # the partition does not change the math; state leaked from the first job into the second would
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert "2 jobs, 2 completed, 0 failed" in proc.stdout


@pytest.mark.slow  # ~14 s: a three-job sweep
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

@pytest.mark.slow  # ~10 s; the non-finite stop stays fast in test_runner_faults (NaN weights, in process)

def test_nan_loss_stops_naming_the_newest_all_finite_checkpoint(tmp_path):
    import numpy as np
    import tensorflow as tf

    out = tmp_path / "nan"
    # the setting: the update that makes the loss NaN one step later already poisons the weights; the
    # run stops at that update, naming the first variable it made non-finite
    proc = runner(*TINY, "optimizer=sgd", "optimizer.learning_rate=100", "train.steps=60", "train.eval_every=0",
                  "train.checkpoint_every=1", "train.keep_checkpoints=60", "train.verify_exact=false",
                  f"hydra.run.dir={out}")
    assert proc.returncode == 3, proc.stderr[-3000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: step ") and " holds NaN or Inf (loss " in line and "Traceback" not in proc.stderr
    saved = sorted(int(p.stem.split("-")[1]) for p in (out / "checkpoints").glob("ckpt-*.index"))
    assert line.endswith(f"checkpoint: {out / 'checkpoints' / f'ckpt-{max(saved)}'}")
    assert line.startswith(f"error: step {max(saved) + 1}: ")  # checkpoint_every=1: the step after the newest
    for step in saved:
        reader = tf.train.load_checkpoint(str(out / "checkpoints" / f"ckpt-{step}"))
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype.is_floating:
                assert np.isfinite(reader.get_tensor(key)).all(), (step, key)
    assert not (out / "metrics.json").exists()


@pytest.mark.slow  # ~10 s; a signal before training stays in the fast set
@pytest.mark.parametrize("sig,code,name", [pytest.param(signal.SIGINT, 130, "Ctrl-C", marks=pytest.mark.slow),
                                           (signal.SIGTERM, 143, "SIGTERM")],  # one handler for both
                         ids=["ctrl-c", "sigterm"])
def test_signal_saves_a_checkpoint_and_exits(sig, code, name, tmp_path):
    out = tmp_path / "interrupted"
    cmd = [sys.executable, "-m", "runner", *TINY, "train.steps=100000", "train.eval_every=0",
           "train.checkpoint_every=0", f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "step 3/" in line:
                break
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert f"{name} at step" in err and f"resume={out}" in err
    step = int(err.split(f"{name} at step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"ckpt-{step}.index").is_file()
    assert dict(events(out)[0]["loss/train"]).keys() == set(range(1, step + 1))


@pytest.mark.parametrize("args", [
    pytest.param(["model=mlp", "model.hidden=[16]"], marks=pytest.mark.slow),  # ~8 s; tiny_run and resnet-auto stay
    pytest.param(["model=attention", "model.filters=[4,4]", "model.hidden=8"], marks=pytest.mark.slow),  # ~11 s
    pytest.param(["model=seq2seq", "data=sequences", "model.units=8", "model.embed_dim=4", "data.eval_size=32"],
                 marks=pytest.mark.slow),  # ~15 s; seq2seq's engine equivalence is in test_models
    pytest.param(["model=resnet", "model.widths=[4,4,4]", "model.depths=[1,1,1]", "data=synthetic", "sections=auto",
                  "engine.memory_budget=1GiB"], marks=pytest.mark.slow),  # ~12 s; the planner runs in test_planner
], ids=["mlp", "attention", "seq2seq", "resnet-auto"])
def test_every_model_runs_end_to_end_and_is_exact(args, tmp_path):
    proc = runner(*args, "train=smoke", "batch=16", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["exact"] is True and metrics["step"] == 4


@pytest.mark.parametrize("sig,code,name", [pytest.param(signal.SIGINT, 130, "Ctrl-C", marks=pytest.mark.slow),
                                           (signal.SIGTERM, 143, "SIGTERM")],  # one handler for both
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_before_training_is_one_line(sig, code, name, tmp_path):
    """While TensorFlow loads and the engine builds: no traceback (Ctrl-C) and no silent exit (SIGTERM)."""
    out = tmp_path / "early"
    cmd = [sys.executable, "-m", "runner", *TINY, f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # run.lock is taken inside the job's signal handling and before TensorFlow loads (seconds before the run
        # folder is announced): a signal sent as it appears lands while the job starts up, however loaded the CPU.
        deadline = time.monotonic() + 60
        while not (out / "run.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(sig)
        stdout, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "run folder:" not in stdout, "the signal came after start-up; the test needs an earlier moment"
    assert proc.returncode == code, err[-3000:]
    assert err.strip().splitlines() == [f"{name}: stopped without saving; nothing was saved"]
