"""Hard faults (issue 20): NaN weights under a finite loss, one writer per run folder, resume overrides judged
against the run's own config, retention after a garbled state file, full disks, impossible batches, small checks.

Most cases run the runner in process (`guarded(run, cfg)`, as `python -m runner` does after composing), on a tiny
mlp; the few subprocess runs are combined."""

from __future__ import annotations

import errno
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from runner.app import CONF
from runner.config.schema import register
from runner.errors import ConfigError, RunnerError

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
SMALL = ["model=mlp", "model.hidden=[8]", "data=synthetic", "data.train_size=64", "data.test_size=32",
         "train=smoke", "train.verify_exact=false", "train.progress=log", "batch=16"]


def nan_pixel(**kwargs):
    """`data=synthetic` with one NaN pixel in the first training image (the weights go NaN, the loss stays finite)."""
    from models.data import synthetic
    from models.data._source import ImageSource

    data = synthetic(**kwargs)
    (x, y), test = data._train, data._test
    x = x.astype(np.float32)
    x[0, 3, 3, 0] = np.nan
    return ImageSource("nan_pixel", (x, y), test, scale=1 / 255, num_classes=data.num_classes)


def composed(out: Path, *overrides: str, sweep: bool = False, base: list = SMALL):
    """The config `python -m runner` would run, with Hydra's runtime set as for a run (or a sweep job) in `out`."""
    from hydra.core.hydra_config import HydraConfig

    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[*base, *overrides])
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(out)
        cfg.hydra.mode = "MULTIRUN" if sweep else "RUN"
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    return cfg


def run_in_process(out: Path, *overrides: str, sweep: bool = False, base: list = SMALL):
    """`guarded(run, cfg)`: returns (value, exit code or None, stderr lines)."""
    from runner.app import run
    from runner.job import guarded

    out.mkdir(parents=True, exist_ok=True)
    cfg = composed(out, *overrides, sweep=sweep, base=base)
    code, value = None, None
    try:
        value = guarded(run, cfg)
    except SystemExit as done:
        code = done.code
    return value, code


def runner(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# 1. Non-finite weights ------------------------------------------------------------------------------------------

def test_nan_weights_under_a_finite_loss_stop_the_run_naming_step_and_variable(tmp_path, capsys):
    data = [f"data._target_={__name__}.nan_pixel", "train.steps=6"]
    value, code = run_in_process(tmp_path / "sweep_job", *data, sweep=True)
    status = json.loads((tmp_path / "sweep_job" / "status.json").read_text())
    assert status["status"] == "failed" and np.isnan(value) and code is None
    error = status["error"]
    assert error.startswith("step ") and "holds NaN or Inf (loss " in error, error
    step = int(error.split()[1].rstrip(":"))
    assert "/" in error.split(":")[1]  # a variable's path (dense_0/.../kernel)
    saved = sorted(int(p.stem.split("-")[1]) for p in (tmp_path / "sweep_job" / "checkpoints").glob("*.index"))
    newest = f"ckpt-{max(saved)}" if saved else "none (none saved yet)"
    assert error.endswith(newest) and all(s < step for s in saved)
    assert not (tmp_path / "sweep_job" / "metrics.json").exists()

    capsys.readouterr()
    _, code = run_in_process(tmp_path / "run", *data)  # a single run exits 3, like a NaN loss
    err = capsys.readouterr().err
    assert code == 3 and err.strip().count("\n") == 0 and "holds NaN or Inf" in err, err


# 2. One writer per run folder -----------------------------------------------------------------------------------

def _lock_of(pid: int) -> str:
    from runner.platform.lock import _start_ticks

    return json.dumps({"pid": pid, "host": platform.node(), "started": "then", "start_ticks": _start_ticks(pid)})


def test_the_lock_refuses_a_live_holder_takes_over_a_dead_one_and_is_released(tmp_path):
    from runner.platform.lock import LOCK, FolderLocked, holding

    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        (tmp_path / LOCK).write_text(_lock_of(live.pid))
        with pytest.raises(FolderLocked) as err:
            with holding(tmp_path):
                pass
        assert f"PID {live.pid} on {platform.node()}" in str(err.value) and "\n" not in str(err.value)
        (tmp_path / LOCK).write_text(_lock_of(dead.pid))  # kill -9 left it: its PID no longer runs
        with pytest.raises(RuntimeError):
            with holding(tmp_path) as path:
                assert json.loads(path.read_text())["pid"] == os.getpid()
                raise RuntimeError("any exit releases it")
        assert not (tmp_path / LOCK).exists()
        # a PID reused by another process (started at another time) does not hold the lock either
        (tmp_path / LOCK).write_text(json.dumps({**json.loads(_lock_of(live.pid)), "start_ticks": "1"}))
        with holding(tmp_path):
            pass
    finally:
        live.kill()
        live.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _sgd_run(tmp_path) -> Path:
    run = tmp_path / "run"
    _, code = run_in_process(run, "optimizer=sgd", "train.steps=2")
    assert code is None
    return run


@pytest.mark.slow  # ~10 s: three runs
def test_resume_of_a_held_folder_refuses_and_an_sgd_run_takes_a_new_momentum(tmp_path, capsys):
    """Another process holds the folder: one line naming it. Once it is gone (its lock stale), the resume runs,
    judging `optimizer.momentum=0.5` against the run's own SGD config (not the default Adam's keys)."""
    run = _sgd_run(tmp_path)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (run / "run.lock").write_text(_lock_of(holder.pid))
        _, code = run_in_process(tmp_path / "hydra", f"resume={run}", "train.steps=4")
        err = capsys.readouterr().err
        assert code == 2 and err.strip().count("\n") == 0, err
        assert err.startswith(f"error: {run} is in use by another run (PID {holder.pid} on {platform.node()}"), err
    finally:
        holder.kill()
        holder.wait()
    proc = runner(f"resume={run}", "train.steps=4", "optimizer.momentum=0.5", "model.hidden=[8]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "optimizer.momentum 0.9 -> 0.5" in proc.stdout and "taking over the lock" in proc.stdout + proc.stderr
    assert OmegaConf.load(run / "config.yaml").optimizer.momentum == 0.5
    assert not (run / "run.lock").exists()


@pytest.mark.slow  # ~25 s: three runner processes
def test_two_resumes_racing_on_one_folder_one_refuses(tmp_path):
    run = _sgd_run(tmp_path)
    first = subprocess.Popen([sys.executable, "-m", "runner", f"resume={run}", "train.steps=100000",
                              "train.checkpoint_every=0"], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:
            if "step 4/" in line:
                break
        second = runner(f"resume={run}", "train.steps=100000")
        assert second.returncode == 2 and f"(PID {first.pid} on " in last_line(second.stderr), second.stderr[-2000:]
    finally:
        first.kill()  # kill -9: the lock stays, stale
        first.wait()
    assert json.loads((run / "run.lock").read_text())["pid"] == first.pid
    third = runner(f"resume={run}", "train.steps=3")
    assert third.returncode == 0, third.stderr[-3000:]


# 3. Resume overrides against the run's own config ---------------------------------------------------------------

def _saved(tmp_path, optimizer: dict, model: dict | None = None) -> Path:
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "ckpt-2.index").write_text("")
    OmegaConf.save(OmegaConf.create({"model": model or {"_target_": "models.build_mlp", "hidden": [8]},
                                     "data": {"_target_": "models.data.synthetic"}, "optimizer": optimizer}),
                   folder / "config.yaml")
    return folder


def test_resume_overrides_are_judged_against_the_runs_own_groups(tmp_path):
    from runner.config.overrides import check_overrides
    from runner.config.resume import resume_arguments

    folder = _saved(tmp_path, {"_target_": "keras.optimizers.SGD", "learning_rate": 0.1, "momentum": 0.9})
    args = [f"resume={folder}", "optimizer.momentum=0.5", "model.hidden=[8]", "train.steps=4"]
    rewritten = resume_arguments(args)
    assert rewritten == [f"resume={folder}", "++optimizer.momentum=0.5", "++model.hidden=[8]", "train.steps=4"]
    check_overrides(rewritten, CONF)  # composes with the default (Adam, resnet) options: no unknown key
    with pytest.raises(ConfigError) as err:
        resume_arguments([f"resume={folder}", "optimizer.beta_1=0.5"])
    assert str(err.value) == ("optimizer.beta_1=0.5: unknown key for the resumed run; its optimizer has: _target_, "
                              "learning_rate, momentum")


def test_a_config_yaml_that_is_not_utf8_is_one_line_on_resume(tmp_path):
    from runner.config.resume import resume_arguments

    folder = _saved(tmp_path, {"_target_": "keras.optimizers.SGD"})
    (folder / "config.yaml").write_bytes(b"model:\n  hidden: \xff\xfe\x00[8]\n")
    with pytest.raises(ConfigError, match=r"its config.yaml is not UTF-8 text \(byte \d+") as err:
        resume_arguments([f"resume={folder}", "train.steps=4"])
    assert "\n" not in str(err.value)


# 4. Retention after a garbled state file ------------------------------------------------------------------------

def _checkpoints(directory, keep):
    import keras

    from models import build_mlp
    from models.data import synthetic
    from runner.run.checkpoint import Checkpoints
    from sections import Engine

    keras.utils.set_random_seed(0)
    data = synthetic(train_size=32, test_size=16)
    engine = Engine(build_mlp(hidden=[4], **data.model_args), optimizer=keras.optimizers.Adam(1e-2))
    batches = iter(data.train_batches(16, 0))
    engine.build(next(iter(data.train_batches(16, 0))))
    return Checkpoints(directory, engine, batches, keep)


def test_retention_recovers_from_a_garbled_state_file(tmp_path):
    ckpt = _checkpoints(tmp_path, keep=3)
    for step in (1, 2, 3):
        ckpt.save(step)
    (tmp_path / "checkpoint").write_bytes(b"\x00garbage{{{ not a proto")
    ckpt = _checkpoints(tmp_path, keep=3)
    for step in (4, 5, 6):
        ckpt.save(step)
    assert sorted(p.name for p in tmp_path.glob("*.index")) == ["ckpt-4.index", "ckpt-5.index", "ckpt-6.index"]
    (tmp_path / "checkpoint").unlink()  # missing altogether: the files on disk count too
    ckpt = _checkpoints(tmp_path, keep=2)
    ckpt.save(7)
    assert sorted(p.name for p in tmp_path.glob("*.index")) == ["ckpt-6.index", "ckpt-7.index"]


# 5. Full disks --------------------------------------------------------------------------------------------------

def _full(what: str):
    import tensorflow as tf

    return tf.errors.ResourceExhaustedError(None, None, f"{what}; No space left on device")


@pytest.mark.slow  # ~5 s: a run on a full disk
def test_a_full_disk_while_writing_events_is_one_line_and_keeps_what_was_written(tmp_path, monkeypatch, capsys):
    import tensorflow as tf

    scalar, calls = tf.summary.scalar, []

    def filling(name, data, step=None, **kwargs):  # the disk fills during step 3's scalars
        calls.append(step)
        if tf.summary.experimental.get_step() == 3:
            raise _full("Could not flush events file")
        return scalar(name, data, step=step, **kwargs)

    monkeypatch.setattr(tf.summary, "scalar", filling)
    out = tmp_path / "run"
    _, code = run_in_process(out, "train.steps=6")
    err = capsys.readouterr().err
    assert code == 1 and err.strip().count("\n") == 0, err
    assert err.startswith(f"error: could not write the TensorBoard event file in {out}: Could not flush events file; "
                          f"No space left on device; stopped"), err
    assert sorted(p.name for p in (out / "checkpoints").glob("*.index")) == ["ckpt-2.index"]
    assert len(list(out.glob("events.out.tfevents.*"))) == 1 and not (out / "metrics.json").exists()
    monkeypatch.setattr(tf.summary, "scalar", scalar)
    # space is back: the resume continues from step 2
    _, code = run_in_process(tmp_path / "hydra", f"resume={out}", "train.steps=6")
    assert code is None and json.loads((out / "metrics.json").read_text())["step"] == 6

@pytest.mark.slow  # ~6 s; a full disk stays fast through the event-file case

def test_a_full_disk_while_rewriting_config_yaml_keeps_the_old_one(tmp_path, monkeypatch, capsys):
    import runner.platform.files

    out = tmp_path / "run"
    _, code = run_in_process(out, "train.steps=2")
    assert code is None
    before = (out / "config.yaml").read_text()
    write = runner.platform.files._write

    def filling(path, text):
        if Path(path).name.startswith(".config.yaml"):
            Path(path).write_text(text[:10])
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, text)

    monkeypatch.setattr(runner.platform.files, "_write", filling)
    capsys.readouterr()
    _, code = run_in_process(tmp_path / "hydra", f"resume={out}", "train.steps=4", "optimizer.learning_rate=0.002")
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == (f"error: could not write {out / 'config.yaml'}: No space left on device; "
                                         f"stopped, files written before it kept"), err
    assert (out / "config.yaml").read_text() == before and not list(out.glob(".*partial"))
    assert not (out / "run.lock").exists()
    monkeypatch.setattr(runner.platform.files, "_write", write)
    _, code = run_in_process(tmp_path / "hydra", f"resume={out}", "train.steps=4", "optimizer.learning_rate=0.002")
    assert code is None and "learning_rate: 0.002" in (out / "config.yaml").read_text()
    assert json.loads((out / "metrics.json").read_text())["step"] == 4

@pytest.mark.slow  # ~4 s

def test_an_interrupted_event_file_trim_is_recovered_and_a_full_one_is_one_line(tmp_path, monkeypatch):
    import tensorflow as tf

    from runner.record.tb import truncate_after

    out = tmp_path / "run"
    _, code = run_in_process(out, "train.steps=4")
    assert code is None
    (events,) = out.glob("events.out.tfevents.*")
    whole = events.read_bytes()
    leftover = events.with_name(events.name + ".truncating")
    leftover.write_bytes(whole[:50])  # a resume killed (or out of space) while trimming
    writer = tf.io.TFRecordWriter

    class Full:
        def __init__(self, path):
            self.path = path
            Path(path).write_bytes(b"partial")

        def __enter__(self):
            return self

        def write(self, record):
            raise _full(f"{self.path}")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(tf.io, "TFRecordWriter", Full)
    with pytest.raises(RunnerError, match="could not write .*No space left on device; stopped") as err:
        truncate_after(out, 2)
    assert "\n" not in str(err.value) and events.read_bytes() == whole and not leftover.exists()
    monkeypatch.setattr(tf.io, "TFRecordWriter", writer)
    leftover.write_bytes(whole[:50])
    for p in (out / "checkpoints").glob("ckpt-4.*"):
        p.unlink()  # resume from step 2: its events after step 2 are trimmed
    _, code = run_in_process(tmp_path / "hydra", f"resume={out}", "train.steps=4")
    assert code is None and not leftover.exists()
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(out), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("loss/train")] == [1, 2, 3, 4]


# 7. Impossible sizes --------------------------------------------------------------------------------------------

def test_a_batch_larger_than_memory_is_refused_before_allocation(tmp_path, capsys):
    from runner.platform.sizes import machine_memory

    memory, example = machine_memory(), 28 * 28 * 4 + 4  # a 28x28x1 float32 image and an int32 label
    _, code = run_in_process(tmp_path / "run", "batch=1000000000")  # the examples alone do not fit
    err = capsys.readouterr().err
    assert code == 2 and err.strip().count("\n") == 0, err
    assert err.startswith("error: batch=1000000000: a step needs at least 2924.4 GiB (3.1 KiB each), more than "
                          "this machine's "), err
    assert int(err.split("allowed: at most ")[1].split()[0]) == memory // example
    # the examples fit (half the memory), their blocks' outputs do not: the network is probed on one example
    batch = memory // (2 * example)
    _, code = run_in_process(tmp_path / "resnet", f"batch={batch}", "model=resnet", "model.widths=[4,4,4]",
                             "model.depths=[1,1,1]", base=[o for o in SMALL if not o.startswith("model")])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: batch={batch}: a step needs at least ") and \
        " each: 3.1 KiB of input, " in err and " of block outputs), more than this machine's" in err, err
    assert int(err.split("allowed: at most ")[1].split()[0]) < batch
    assert not (tmp_path / "resnet" / "checkpoints").exists()


# 8. Small checks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("override,message", [
    ("optimizer.weight_decay=-1", "optimizer.weight_decay=-1.0: must be 0 or a positive number, or null (a negative "
                                  "decay grows the weights)"),
    ("optimizer.clipnorm=-1", "optimizer.clipnorm=-1.0: must be a positive number, or null (no clipping)"),
    ("+optimizer.clipvalue=0", "optimizer.clipvalue=0: must be a positive number, or null (no clipping)"),
    ("engine.memory_budget=1GiB", "engine.memory_budget=1GiB: only sections=auto plans to a budget; this run has "
                                  "sections=[logits]: give sections=auto, or engine.memory_budget=null"),
])
def test_small_config_checks_are_one_line(override, message, tmp_path):
    from runner.config.checks import check_config

    optimizer = ["optimizer=adamw"] if "weight_decay" in override else []
    cfg = composed(tmp_path, *optimizer, override)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == message


def test_a_file_that_is_no_npz_gets_no_pickle_advice(tmp_path):
    from models.data import mnist

    text = tmp_path / "passwd"
    text.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(ValueError) as err:
        mnist(path=str(text))
    message = str(err.value)
    assert "is not a Keras-format mnist.npz" in message and str(text) in message
    assert "pickle" not in message and "delete" not in message.lower() and text.is_file()


def test_a_failed_download_leaves_no_empty_folder(tmp_path):
    from models.data import mnist

    path = tmp_path / "new" / "deeper" / "mnist.npz"
    with pytest.raises(FileNotFoundError, match="downloading .* failed"):
        mnist(path=str(path), origin="http://127.0.0.1:9/mnist.npz")
    assert sorted(tmp_path.iterdir()) == []


# 6. Sweeps survive dying workers --------------------------------------------------------------------------------

def test_a_log_file_on_a_full_disk_warns_once(tmp_path, capsys):
    import logging

    from runner.job import _log_files_survive_a_full_disk

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    handler = logging.FileHandler(tmp_path / "runner.log", delay=True)
    handler.stream = Full()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        _log_files_survive_a_full_disk()
        for n in range(3):
            logging.getLogger("runner").warning(f"message {n}")
    finally:
        root.removeHandler(handler)
    err = capsys.readouterr().err
    assert err == f"warning: {tmp_path / 'runner.log'}: No space left on device; the log file stops here\n"


def test_a_sweep_job_whose_process_dies_is_recorded_with_the_cause(tmp_path):
    import signal

    from runner.platform.isolate import run_in_child

    recorded = []
    assert run_in_child(lambda: 0.25, recorded.append, "job 0") == 0.25 and recorded == []
    value = run_in_child(lambda: os.kill(os.getpid(), signal.SIGKILL), recorded.append, "job 1")
    assert np.isnan(value) and len(recorded) == 1 and recorded[0]["status"] == "failed"
    assert recorded[0]["error"].startswith("job 1: its process (PID ") and "killed by SIGKILL (kill -9, or the " \
        "kernel's out-of-memory killer" in recorded[0]["error"]
    assert np.isnan(run_in_child(lambda: os._exit(7), recorded.append, "job 2"))
    assert recorded[1]["error"].endswith("exited with code 7 without a result")


@pytest.mark.slow  # ~40 s: a joblib sweep of 4 jobs, each in its own TensorFlow process
def test_a_joblib_sweep_goes_on_when_a_worker_is_killed(tmp_path):
    import signal

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "runner", "-m", *SMALL, "train.steps=2,100000,2,2", "train.checkpoint_every=0",
           "train.eval_every=0", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock, deadline = sweep / "1" / "run.lock", time.monotonic() + 180
        while not list((sweep / "1").glob("events.out.tfevents.*")) and time.monotonic() < deadline:
            time.sleep(0.2)  # job 1 trains (until killed)
        time.sleep(1)
        os.kill(json.loads(lock.read_text())["pid"], signal.SIGKILL)  # as the out-of-memory killer would
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "4 jobs, 3 completed, 1 failed" in stdout and "Traceback" not in stderr, stdout + stderr[-3000:]
    statuses = {n: json.loads((sweep / n / "status.json").read_text()) for n in "0123"}
    assert [statuses[n]["status"] for n in "0123"] == ["completed", "failed", "completed", "completed"]
    assert "killed by SIGKILL" in statuses["1"]["error"] and "killed by SIGKILL" in stderr.split("failed jobs:")[1]


@pytest.mark.slow  # ~60 s under load: two jobs, one after the other, each in a child of the launcher
def test_a_basic_sweep_goes_on_when_a_jobs_process_is_killed(tmp_path):
    import signal

    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "runner", "-m", *SMALL, "train.steps=100000,2", "train.checkpoint_every=0",
           "train.eval_every=0", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not list((sweep / "0").glob("events.out.tfevents.*")) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1)
        pid = json.loads((sweep / "0" / "run.lock").read_text())["pid"]
        assert pid != proc.pid  # the job trains in a process of its own
        os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "2 jobs, 1 completed, 1 failed" in stdout, stdout + stderr[-3000:]
    assert "killed by SIGKILL" in json.loads((sweep / "0" / "status.json").read_text())["error"]
    assert json.loads((sweep / "1" / "status.json").read_text())["status"] == "completed"


@pytest.mark.slow  # ~100 s under load; needs root for a real tmpfs (skipped otherwise: the tests above patch the writers)
def test_a_real_full_disk_mid_run_then_resume(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run, filler = disk / "run", disk / "filler"
        cmd = [sys.executable, "-m", "runner", *SMALL, "train.steps=100000", "train.checkpoint_every=50",
               "train.eval_every=0", "train.log_every=100000", f"hydra.run.dir={run}"]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 180
            while not list((run / "checkpoints").glob("ckpt-*.index")) and time.monotonic() < deadline:
                time.sleep(0.2)
            with open(filler, "wb") as f:  # fill the disk
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            _, err = proc.communicate(timeout=180)
        finally:
            proc.kill()
        lines = [line for line in err.strip().splitlines() if not line.endswith("the log file stops here")]
        assert proc.returncode == 1 and len(lines) == 1 and "No space left on device; stopped" in lines[0], err[-3000:]
        saved = max(int(p.stem.split("-")[1]) for p in (run / "checkpoints").glob("ckpt-*.index"))
        still_full = runner(f"resume={run}", f"train.steps={saved + 5}")
        assert still_full.returncode == 1 and "No space left on device" in last_line(still_full.stderr)
        assert "Traceback" not in still_full.stderr and not list(run.glob("*.truncating"))
        filler.unlink()
        resumed = runner(f"resume={run}", f"train.steps={saved + 5}")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert json.loads((run / "metrics.json").read_text())["step"] == saved + 5
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
