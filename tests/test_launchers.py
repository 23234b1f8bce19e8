"""Sweeps on Hydra's real launchers and sweeper: submitit (local executor; SLURM composes) and Optuna."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from runner.app import CONF
from runner.config.schema import register

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
SMALL = ["model.hidden=[16]", "data.train_size=64", "data.test_size=32", "train=smoke", "train.steps=2",
         "train.verify_exact=false"]  # model=mlp data=synthetic, small


def runner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=300)


def hydra_config(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=True).hydra


def test_slurm_and_local_launchers_extend_the_plugin_configs():
    slurm = hydra_config("hydra/launcher=slurm").launcher
    assert slurm._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (slurm.timeout_min, slurm.gpus_per_node, slurm.cpus_per_task, slurm.mem_gb, slurm.array_parallelism) == (
        120, 1, 8, 64, 16)
    assert "qos" in slurm and "account" in slurm  # every field of the plugin's SlurmQueueConf
    with pytest.raises(ConfigCompositionException):  # and its types
        hydra_config("hydra/launcher=slurm", "hydra.launcher.timeout_min=two_hours")
    local = hydra_config("hydra/launcher=local").launcher
    assert local._target_.endswith("submitit_launcher.LocalLauncher") and local.timeout_min == 120
    for plugin in ("submitit_local", "submitit_slurm", "joblib"):  # the plugins' own configs stay reachable
        assert hydra_config(f"hydra/launcher={plugin}").launcher._target_.startswith("hydra_plugins.")


def test_optuna_experiment_searches_learning_rate_and_batch_maximizing_the_metric():
    sweeper = hydra_config("experiment=optuna_mlp").sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert dict(sweeper.params) == {"optimizer.learning_rate": "tag(log, interval(1e-4, 3e-2))",
                                    "batch": "choice(32, 64, 128)"}


@pytest.mark.parametrize("overrides,direction", [
    (["experiment=optuna_gpt"], "minimize"),                               # bits per character
    (["experiment=optuna_mlp", "model=gpt", "data=text"], "minimize"),     # the same experiment, text data
    (["experiment=optuna_mlp", "data=digits"], "maximize"),                # accuracy
    (["experiment=optuna_gpt", "hydra.sweeper.direction=maximize"], "maximize"),   # an explicit one wins
])
def test_optuna_direction_follows_the_datas_metric(overrides, direction):
    assert hydra_config(*overrides).sweeper.direction == direction


def test_metric_direction_of_each_data_source():
    from runner.config.direction import direction_of

    assert {name: direction_of(f"models.data.{name}") for name in ("digits", "mnist", "synthetic", "sequences",
                                                                   "text")} == {
        "digits": "maximize", "mnist": "maximize", "synthetic": "maximize", "sequences": "maximize",
        "text": "minimize"}


def job_folders(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)


@pytest.mark.slow  # ~15 s; the launcher configs compose and validate in the fast tests above
def test_two_job_sweep_through_submitit_local_runs_each_job_in_its_own_process(tmp_path):
    sweep = tmp_path / "sweep"
    proc = runner("-m", "model=mlp", "data=synthetic", *SMALL, "batch=8", "hydra/launcher=local",
                  "optimizer.learning_rate=0.001,0.01", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_folders(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    rates, pids = set(), set()
    for job in jobs:
        assert json.loads((job / "status.json").read_text())["status"] == "completed"
        assert json.loads((job / "metrics.json").read_text())["step"] == 2
        rates.add(OmegaConf.load(job / "config.yaml").optimizer.learning_rate)
        (events,) = job.glob("events.out.tfevents.*")
        pids.add(events.name.split(".")[-3])  # events.out.tfevents.<time>.<host>.<pid>.<n>.v2
    assert rates == {0.001, 0.01}
    assert len(pids) == 2 and str(os.getpid()) not in pids  # submitit ran them, not this process or the runner's
    assert len([p for p in (sweep / ".submitit").iterdir() if p.name.isdigit()]) == 2  # submitit's job folders
    assert "[sweep] 2 jobs, 2 completed, 0 failed" in proc.stdout
    assert "Submitit 'local' sweep output dir" in proc.stdout + proc.stderr


@pytest.mark.slow  # ~15 s; the sweep direction and config are checked in fast tests
def test_optuna_sweeps_four_trials_and_writes_the_best(tmp_path):
    sweep = tmp_path / "sweep"
    proc = runner("-m", "experiment=optuna_mlp", *SMALL, "hydra.sweeper.n_trials=4",  # a batch given here would fix it
                  f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = job_folders(sweep)
    assert [p.name for p in jobs] == ["0", "1", "2", "3"]
    trials = []
    for job in jobs:
        status = json.loads((job / "status.json").read_text())
        cfg = OmegaConf.load(job / "config.yaml")
        assert status["status"] == "completed" and 1e-4 <= cfg.optimizer.learning_rate <= 3e-2
        assert cfg.batch in (32, 64, 128) and cfg.model._target_ == "models.build_mlp"
        trials.append((status["value"], cfg.optimizer.learning_rate, cfg.batch))
    assert len({lr for _, lr, _ in trials}) == 4  # the sampler drew four learning rates
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    value, lr, batch = max(trials)
    assert best.best_value == value and math.isclose(best.best_params["optimizer.learning_rate"], lr)
    assert best.best_params.batch == batch
    assert "[sweep] 4 jobs, 4 completed, 0 failed" in proc.stdout


@pytest.mark.slow
def test_optuna_gpt_sweep_minimizes_bits_per_char(tmp_path):
    sweep = tmp_path / "sweep"
    proc = runner("-m", "experiment=optuna_gpt", "hydra.sweeper.n_trials=3", "train.steps=3", "batch=4",
                  "data.max_chars=60000", "data.eval_chars=2048", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Directions: ['minimize']" in proc.stdout + proc.stderr
    values = [json.loads((job / "status.json").read_text())["value"] for job in job_folders(sweep)]
    metrics = [json.loads((job / "metrics.json").read_text()) for job in job_folders(sweep)]
    assert [m["metric"] for m in metrics] == ["bits_per_char"] * 3
    assert values == [m["bits_per_char"] for m in metrics] and len(set(values)) == 3
    assert OmegaConf.load(sweep / "optimization_results.yaml").best_value == min(values)


FAKE_SBATCH = '''
import os, re, subprocess, sys
from pathlib import Path
here = Path(__file__).parent
script = here / "job.sbatch"
script.write_text(Path(sys.argv[-1]).read_text())
array = re.search(r"^#SBATCH --array=0-(\\d+)%\\d+$", script.read_text(), re.M)
for i in range(int(array.group(1)) + 1 if array else 1):
    name = f"4242_{i}" if array else "4242"
    env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_NTASKS="1", SLURM_PROCID="0", SLURM_LOCALID="0",
               SLURM_NODEID="0", SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", FAKE_SLURM_JOB=name)
    if array:
        env.update(SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID=str(i))
    (here / f"{name}.started").touch()
    subprocess.Popen(["/bin/sh", "-c", 'bash "$0"; echo $? > "$1"', str(script), str(here / f"{name}.exit")],
                     env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("Submitted batch job 4242")
'''
FAKE_SRUN = '''
import os, sys
args = sys.argv[1:]
job, files = os.environ["FAKE_SLURM_JOB"], {}
while args[0].startswith("-"):
    flag = args.pop(0)
    if flag in ("--output", "--error"):
        array_id, _, task = job.partition("_")
        files[flag] = args.pop(0).replace("%A", array_id).replace("%a", task).replace("%j", job).replace("%t", "0")
os.environ.update(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_NODELIST="localhost", SLURM_STEP_TASKS_PER_NODE="1")
for flag, fd in (("--output", 1), ("--error", 2)):
    if flag in files:
        os.dup2(os.open(files[flag], os.O_WRONLY | os.O_CREAT | os.O_APPEND), fd)
os.execvp(args[0], args)
'''
FAKE_SACCT = '''
from pathlib import Path
here = Path(__file__).parent
print("JobID|State|NodeList")
for started in sorted(here.glob("*.started")):
    done = here / (started.stem + ".exit")
    state = "RUNNING" if not done.exists() else "COMPLETED" if done.read_text().strip() == "0" else "FAILED"
    print(f"{started.stem}|{state}|localhost")
'''


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> Path:
    """sbatch, srun and sacct stand-ins: sbatch starts each array task at once on this machine, as srun would."""
    folder = tmp_path / "slurm"
    folder.mkdir()
    for name, body in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN), ("sacct", FAKE_SACCT)):
        (folder / name).write_text(f"#!{sys.executable}\n{body}")
        (folder / name).chmod(0o755)
    monkeypatch.setitem(ENV, "PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    return folder


@pytest.mark.slow
def test_two_job_sweep_through_the_slurm_launcher_submits_one_array(tmp_path, fake_slurm):
    sweep = tmp_path / "sweep"
    proc = runner("-m", "model=mlp", "data=synthetic", *SMALL, "batch=8", "hydra/launcher=slurm",
                  "hydra.launcher.partition=gpu", "optimizer.learning_rate=0.001,0.01", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    script = (fake_slurm / "job.sbatch").read_text()
    for line in ("--array=0-1%2", "--time=120", "--nodes=1", "--ntasks-per-node=1", "--gpus-per-node=1",
                 "--cpus-per-task=8", "--mem=64GB", "--partition=gpu", "--signal=USR2@120"):
        assert f"#SBATCH {line}\n" in script, line
    assert "\nsrun --unbuffered" in script and "submitit.core._submit" in script
    jobs = job_folders(sweep)
    assert [p.name for p in jobs] == ["0", "1"]
    for job in jobs:
        assert json.loads((job / "status.json").read_text())["status"] == "completed"
    assert "[sweep] 2 jobs, 2 completed, 0 failed" in proc.stdout


def test_optuna_experiments_let_a_failed_trial_go_by():
    for experiment in ("optuna_mlp", "optuna_gpt"):
        assert hydra_config(f"experiment={experiment}").sweeper.max_failure_rate == 1.0


@pytest.mark.slow  # ~20 s
def test_a_failing_optuna_trial_does_not_stop_the_study(tmp_path):
    """optuna 2.10 rejects the NaN a failed job returns; the trial is recorded as failed and the study goes on."""
    sweep = tmp_path / "sweep"
    proc = runner("-m", "experiment=optuna_mlp", *[a for a in SMALL if not a.startswith("train.steps")],
                  "hydra.sweeper.n_trials=4", "train.steps=choice(2,-1)", f"hydra.sweep.dir={sweep}")
    statuses = [json.loads((job / "status.json").read_text())["status"] for job in job_folders(sweep)]
    assert len(statuses) == 4 and "failed" in statuses and "completed" in statuses, (statuses, proc.stderr[-2000:])
    failed = statuses.count("failed")
    assert f"[sweep] 4 jobs, {4 - failed} completed, {failed} failed" in proc.stdout
    assert (sweep / "optimization_results.yaml").is_file()
