"""Issue 51, item 6: `python -m runner resume=outputs/multirun/<date>/<time>` continues a killed sweep: finished jobs
kept, interrupted ones resumed from their checkpoints, those never started run; the summary covers every job.

The fast tests check each part without TensorFlow (what a job's folder says, the command line the sweep is
continued with, the folder reused); the slow ones kill a real sweep (basic launcher, joblib) with a Hydra callback
(tests/sweep_hooks.py) that SIGKILLs the sweep's process group right after job 1's first checkpoint, then continue
it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.hydra_callbacks import JOB_STATUS, UniqueOutputDir, earlier_attempt
from runner.config.resume import RESUMING, SWEEP_RECORD, resume_arguments
from runner.errors import ConfigError, RunnerError

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model=mlp", "model.hidden=[8]", "data=synthetic", "data.train_size=64", "data.test_size=32",
         "train.verify_exact=false", "train.progress=log", "batch=16", "train.eval_every=0"]


def job(folder: Path, status: dict | None = None, checkpoint: bool = False) -> Path:
    folder.mkdir(parents=True)
    (folder / "runner.log").write_text("")
    if status is not None:
        (folder / JOB_STATUS).write_text(json.dumps(status))
    if checkpoint:
        (folder / "config.yaml").write_text("batch: 16\n")
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "ckpt-2.index").write_text("")
    return folder


def test_a_jobs_folder_says_whether_it_is_kept_resumed_or_run(tmp_path):
    mine = ["optimizer.learning_rate=0.01"]
    assert earlier_attempt(tmp_path / "fresh", mine) == ("run", None)  # a fresh sweep's folder: nothing there
    done = job(tmp_path / "0", {"overrides": mine, "status": "completed", "value": 0.75})
    assert earlier_attempt(done, mine) == ("kept", 0.75)
    assert earlier_attempt(job(tmp_path / "1", checkpoint=True), mine) == ("resume", None)  # killed: no status
    killed = job(tmp_path / "2", {"overrides": mine, "status": "failed", "error": "killed by SIGKILL"}, True)
    assert earlier_attempt(killed, mine) == ("resume", None)
    assert earlier_attempt(job(tmp_path / "3"), mine) == ("run", None)  # killed before its first checkpoint
    searching = job(tmp_path / "5")
    (searching / "config.yaml").write_text("batch: max\n")  # a batch=max search killed before any checkpoint
    assert earlier_attempt(searching, mine) == ("resume", None)
    (tmp_path / "4").mkdir()
    (tmp_path / "4" / JOB_STATUS).write_text('{"overrides": ["optimizer.learning_r')  # cut short by the kill
    assert earlier_attempt(tmp_path / "4", mine) == ("run", None)
    with pytest.raises(RunnerError, match=r"holds the job optimizer.learning_rate=0.01, not optimizer.learning_rate"
                                          r"=0.02: the sweep continued is not the sweep that ran there"):
        earlier_attempt(done, ["optimizer.learning_rate=0.02"])


def sweep_folder(tmp_path: Path, sweeper: str = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper") -> Path:
    folder = tmp_path / "multirun" / "12-00-00"
    folder.mkdir(parents=True)
    (folder / SWEEP_RECORD).write_text(json.dumps({
        "task": ["model=mlp", "optimizer.learning_rate=0.001,0.01"],
        "hydra": ["hydra.mode=MULTIRUN", "hydra/launcher=joblib", "hydra.sweep.dir='/old/place'"],
        "sweeper": sweeper}))
    return folder


def test_resume_of_a_sweep_folder_is_the_sweeps_own_command_line_into_that_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(RESUMING, raising=False)
    folder = sweep_folder(tmp_path)
    args = resume_arguments([f"resume={folder}", "hydra.launcher.n_jobs=4"])
    assert args == ["-m", "model=mlp", "optimizer.learning_rate=0.001,0.01", "hydra.mode=MULTIRUN",
                    "hydra/launcher=joblib", f"hydra.sweep.dir='{folder}'", "hydra.launcher.n_jobs=4"]
    assert os.environ[RESUMING] == str(folder.resolve())
    with pytest.raises(ConfigError, match=r"continues the sweep as it was launched: train.steps=9 would change its "
                                          r"jobs \(only Hydra's settings may be added"):
        resume_arguments([f"resume={folder}", "train.steps=9"])
    older = tmp_path / "older"  # a sweep from before sweep.json: its multirun.yaml (the basic sweeper's)
    older.mkdir()
    OmegaConf.save({"hydra": {"overrides": {"task": ["batch=8,16"], "hydra": ["hydra.mode=MULTIRUN"]},
                              "sweeper": {"_target_": "basic"}}}, older / "multirun.yaml")
    assert resume_arguments([f"resume={older}"]) == ["-m", "batch=8,16", "hydra.mode=MULTIRUN",
                                                     f"hydra.sweep.dir='{older}'"]


OPTUNA = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def optuna_sweep(tmp_path: Path, storage, n_trials=5) -> Path:
    folder = sweep_folder(tmp_path, OPTUNA)
    record = json.loads((folder / SWEEP_RECORD).read_text())
    record["optuna"] = {"storage": storage, "study_name": "s", "n_trials": n_trials}
    (folder / SWEEP_RECORD).write_text(json.dumps(record))
    return folder


def test_an_optuna_sweep_continues_from_its_studys_storage(tmp_path, monkeypatch, capsys):
    """Finished trials stay in the study, an interrupted one is failed and asked again with its parameters, only the
    missing trials run, in job folders of their own."""
    import optuna

    monkeypatch.delenv(RESUMING, raising=False)
    monkeypatch.chdir(tmp_path)
    study = optuna.create_study(study_name="s", storage="sqlite:///optuna.db")
    for value in (0.5, 0.7):
        trial = study.ask()
        trial.suggest_float("lr", 1e-4, 1e-1, log=True)
        study.tell(trial, value)
    interrupted = study.ask()
    lr = interrupted.suggest_float("lr", 1e-4, 1e-1, log=True)  # killed: left RUNNING
    folder = optuna_sweep(tmp_path, "sqlite:///optuna.db")
    args = resume_arguments([f"resume={folder}"])
    assert args[-2:] == ["hydra.sweeper.n_trials=3", "hydra.sweep.subdir=c1_${hydra.job.num}"], args
    assert "2 of 5 trials finished; 1 interrupted (asked again with their parameters, from the start); 3 to run" \
        in capsys.readouterr().out
    states = [t.state for t in optuna.load_study(study_name="s", storage="sqlite:///optuna.db").get_trials()]
    assert states.count(optuna.trial.TrialState.FAIL) == 1 and states.count(optuna.trial.TrialState.WAITING) == 1
    asked = optuna.load_study(study_name="s", storage="sqlite:///optuna.db").ask()
    assert asked.suggest_float("lr", 1e-4, 1e-1, log=True) == lr  # the interrupted trial's parameters, first
    (folder / "c1_0").mkdir()
    assert resume_arguments([f"resume={folder}"])[-1] == "hydra.sweep.subdir=c2_${hydra.job.num}"


@pytest.mark.parametrize("storage, n_trials, message", [
    (None, 5, r"kept its study in memory \(hydra.sweeper.storage=null\)"),
    ("sqlite:///elsewhere.db", 5, r"storage sqlite:///elsewhere.db is not found from .*; run resume= from the folder"),
    ("sqlite:///optuna.db", 1, r"already has 1 finished trials of n_trials=1: nothing to continue"),
])
def test_an_optuna_sweep_that_cannot_be_continued_says_why(tmp_path, monkeypatch, storage, n_trials, message):
    import optuna

    monkeypatch.delenv(RESUMING, raising=False)
    monkeypatch.chdir(tmp_path)
    study = optuna.create_study(study_name="s", storage="sqlite:///optuna.db")
    study.tell(study.ask(), 0.5)
    with pytest.raises(ConfigError, match=message):
        resume_arguments([f"resume={optuna_sweep(tmp_path, storage, n_trials)}"])


def test_a_continued_sweep_reuses_its_folder_and_a_new_one_records_its_command_line(tmp_path, monkeypatch, capsys):
    def config(folder: Path):
        return OmegaConf.create({"hydra": {"sweep": {"dir": str(folder)}, "sweeper": {"_target_": "basic"},
                                           "overrides": {"task": ["batch=8,16"], "hydra": ["hydra.mode=MULTIRUN"]}}})

    folder = tmp_path / "sweep"
    fresh = config(folder)
    monkeypatch.delenv(RESUMING, raising=False)
    UniqueOutputDir().on_multirun_start(fresh)
    assert fresh.hydra.sweep.dir == str(folder) and folder.is_dir()
    assert json.loads((folder / SWEEP_RECORD).read_text()) == {
        "task": ["batch=8,16"], "hydra": ["hydra.mode=MULTIRUN", f"hydra.sweep.dir='{folder}'"], "sweeper": "basic"}
    again = config(folder)
    UniqueOutputDir().on_multirun_start(again)  # a new sweep never writes into an earlier one's folder
    assert again.hydra.sweep.dir == f"{folder}-1"
    monkeypatch.setenv(RESUMING, str(folder))
    continued = config(folder)
    UniqueOutputDir().on_multirun_start(continued)
    assert continued.hydra.sweep.dir == str(folder) and not Path(f"{folder}-2").exists()
    assert f"[sweep] {folder}: continued (finished jobs kept" in capsys.readouterr().out


def killed_then_continued(tmp_path: Path, *launcher: str, wait_for_job0: bool = False, one_at_a_time: bool = True):
    """A 3-job sweep killed (SIGKILL of its process group) right after job 1's first checkpoint, then continued."""
    sweep, marker = tmp_path / "sweep", tmp_path / "killed"
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop(RESUMING, None)
    hook = ["+hydra.callbacks.kill._target_=sweep_hooks.KillAfterCheckpoint", "+hydra.callbacks.kill.job=1",
            f"+hydra.callbacks.kill.marker={marker}"]
    if wait_for_job0:
        hook.append(f"+hydra.callbacks.kill.wait_for={sweep / '0' / JOB_STATUS}")
    first = subprocess.run([sys.executable, "-m", "runner", "-m", *SMALL, "train.steps=4", "train.checkpoint_every=2",
                            "optimizer.learning_rate=0.001,0.002,0.003", *launcher, *hook, f"hydra.sweep.dir={sweep}"],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert marker.read_text() == "killed after the checkpoint of step 2\n"
    assert json.loads((sweep / "0" / JOB_STATUS).read_text())["status"] == "completed"
    assert not (sweep / "1" / JOB_STATUS).exists() and (sweep / "1" / "checkpoints" / "ckpt-2.index").is_file()
    if one_at_a_time:
        assert not (sweep / "2").exists()  # never started
    kept = (sweep / "0" / "metrics.json").stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-m", "runner", f"resume={sweep}"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "[sweep] 3 jobs, 3 completed, 0 failed" in again.stdout, again.stdout[-2000:]
    assert (sweep / "0" / "metrics.json").stat().st_mtime_ns == kept  # kept, not run again
    log1 = (sweep / "1" / "runner.log").read_text()
    assert "sweep job 1: interrupted in the sweep's earlier run; continues from its newest checkpoint" in log1
    assert "sweep job 0: completed in the sweep's earlier run; kept" in (sweep / "0" / "runner.log").read_text()
    for n, rate in enumerate((0.001, 0.002, 0.003)):
        metrics = json.loads((sweep / str(n) / "metrics.json").read_text())
        assert metrics["step"] == 4 and OmegaConf.load(sweep / str(n) / "config.yaml").optimizer.learning_rate == rate
    return sweep, again


@pytest.mark.slow  # ~40 s: two sweeps of TensorFlow jobs; the fast tests above check each part
def test_a_killed_basic_sweep_is_continued(tmp_path):
    killed_then_continued(tmp_path)


@pytest.mark.slow  # ~60 s: joblib's worker processes, two sweeps
def test_a_killed_joblib_sweep_is_continued(tmp_path):
    # two at a time: job 2 may have started when job 0 ended, just before the kill; it runs (or resumes) either way
    killed_then_continued(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", wait_for_job0=True,
                          one_at_a_time=False)


@pytest.mark.slow  # ~60 s: two Optuna sweeps of TensorFlow jobs
def test_a_killed_optuna_sweep_with_storage_is_continued(tmp_path):
    sweep, marker = tmp_path / "sweep", tmp_path / "killed"
    env = {**os.environ, "HYDRA_FULL_ERROR": "", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    env.pop(RESUMING, None)
    hook = ["+hydra.callbacks.kill._target_=sweep_hooks.KillAfterCheckpoint", "+hydra.callbacks.kill.job=1",
            f"+hydra.callbacks.kill.marker={marker}"]
    study = ["experiment=optuna_mlp", *SMALL, "train.steps=4", "train.checkpoint_every=2",
             "hydra.sweeper.n_trials=3", "hydra.sweeper.storage=sqlite:///optuna.db", "hydra.sweeper.study_name=t"]
    first = subprocess.run([sys.executable, "-m", "runner", "-m", *study, *hook, f"hydra.sweep.dir={sweep}"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, start_new_session=True)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    again = subprocess.run([sys.executable, "-m", "runner", f"resume={sweep}"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "1 of 3 trials finished; 1 interrupted" in again.stdout and "2 to run" in again.stdout, again.stdout
    assert "[sweep] 4 jobs, 3 completed, 1 failed" not in again.stdout  # the interrupted job's folder has no status
    import optuna

    states = [t.state for t in optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
              .get_trials()]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3 and states.count(optuna.trial.TrialState.FAIL) == 1
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir() and (p / JOB_STATUS).is_file()) == ["0", "c1_0",
                                                                                                     "c1_1"]


@pytest.mark.slow  # ~60 s: submitit's local executor starts the 3 jobs at once, in processes of their own
def test_a_killed_submitit_sweep_is_continued(tmp_path):
    killed_then_continued(tmp_path, "hydra/launcher=local", "hydra.launcher.gpus_per_node=0", wait_for_job0=True,
                          one_at_a_time=False)
