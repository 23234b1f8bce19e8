"""`batch=max` as a run lives it: stops that always stop (also where the signal lands in a finalizer), trials kept
in the run folder as they end and a killed search continued by `resume=`, a search that says what it does, and
the batch found surviving evaluation and later steps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.platform.journal import TRIALS, append_trial, recorded_trials
from runner.run.batch_max import Trial, largest_batch, recorded

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
# A 2-section MLP on 300 tiny synthetic images: a trial is its engine's tracing and two steps (seconds); the
# training set caps the search at 300.
TINY = ["model=mlp", "model.hidden=[8]", "model.default_sections=[logits]", "data=synthetic",
        "data.image_shape=[4,4,1]", "data.train_size=300", "data.test_size=64", "batch=max", "train.steps=2",
        "train.eval_every=1", "train.checkpoint_every=1", "train.log_every=1", "train.progress=log",
        "train.verify_exact=false", "train.save_model=false"]


def worker(moment: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tests/stop_worker.py", moment, *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def runner(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


# ---------------------------------------------------------------------------------------------- stops
class _SendsFromItsFinalizer:
    def __init__(self, sig):
        self.sig = sig

    def __del__(self):
        signal.raise_signal(self.sig)  # Python runs the handler right here, inside the finalizer


@pytest.mark.parametrize("sig, raised", [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")])
def test_a_signal_landing_in_a_finalizer_still_stops_within_moments(sig, raised):
    """A raise inside `__del__` is printed as 'Exception ignored' and lost (3 of 3 probes of a stop at a batch=max
    trial's end went on searching): the handler sends it again once the finalizer has returned."""
    from runner import job

    stopped = None
    with job._signals_before_the_loop(sweep=False):
        try:
            _SendsFromItsFinalizer(sig)  # dropped at once: its finalizer runs the handler
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # ordinary Python work, as a search's would be
                sum(range(100))
        except BaseException as err:  # noqa: BLE001 - the stop itself is what is looked for
            stopped = err
    assert type(stopped).__name__ == raised, f"the signal was lost in the finalizer ({stopped!r})"


def test_a_stop_whose_raise_something_swallowed_is_raised_at_the_next_safe_point():
    from runner.platform import stops

    with stops.catching():
        try:
            signal.raise_signal(signal.SIGTERM)
        except BaseException:  # noqa: BLE001 - as a library's catch-all would
            pass
        with pytest.raises(stops.Terminated):
            stops.check()  # between trials, after planning, before the training loop
    with stops.catching():
        stops.check()  # a new run starts with nothing recorded


def test_sigterm_in_a_finalizer_at_a_trials_end_stops_the_search_in_one_line(tmp_path):
    """SIGTERM sent from inside a finalizer that runs as trial 1's engine is freed: the run stops there (exit
    143, one line) with trial 1 recorded and nothing half-written; before, the search went on."""
    out = tmp_path / "run"
    proc = worker("term-in-finalizer-at-trial-end", *TINY, f"hydra.run.dir={out}")
    assert proc.returncode == 143, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"SIGTERM: stopped during the batch=max search; its 1 trial is kept in {out / TRIALS}: "
                      f"resume={out} continues it"], proc.stderr[-3000:]
    assert "trial 2" not in proc.stdout + proc.stderr, "the search went on after the stop"
    assert [t["batch"] for t in recorded_trials(out)] == [32]
    assert (out / "config.yaml").is_file() and not list(out.glob(".*.partial")) and not (out / "run.lock").exists()


@pytest.mark.slow  # ~40 s; the fast set stops at a trial's end (above) and in a finalizer in-process
def test_ctrl_c_in_a_finalizer_while_planning_stops_in_one_line(tmp_path):
    out = tmp_path / "run"
    proc = worker("int-in-finalizer-while-planning", *TINY, f"hydra.run.dir={out}")
    assert proc.returncode == 130, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("Ctrl-C: stopped during the batch=max search; its 1 "
                                                     "trial is kept"), proc.stderr[-3000:]
    assert "Exception ignored" not in proc.stderr and not list(out.glob("checkpoints/ckpt-*"))


# ---------------------------------------------------------------------------------------------- a search that survives
def test_the_search_continues_from_recorded_trials_and_builds_the_best_ones_engine_again(tmp_path, monkeypatch):
    """Trials 32 and 256 fitted in a stopped session: they are not run again; the search goes on from them, and
    the engine of the best batch recorded is built again by one more trial (which may find it no longer fits)."""
    for r in ({"trial": 1, "batch": 32, "fits": True, "peak_bytes": 10, "seconds": 2.0},
              {"trial": 2, "batch": 256, "fits": True, "peak_bytes": 80, "seconds": 3.0}):
        append_trial(tmp_path, r)
    from runner.run import batch_max

    monkeypatch.setattr(batch_max.gc, "collect", lambda *args: 0)  # nothing to free here; a collection costs 0.15 s
    earlier, said = recorded(recorded_trials(tmp_path), 1)
    assert said == "continuing the stopped search from its 2 recorded trial(s): 32 fits, 256 fits"
    tried = []

    def try_batch(b):
        tried.append(b)
        return Trial(b, b <= 300, b, "", kept=f"engine {b}")

    (batch, engine), search = largest_batch(try_batch, 1, budget=10**6, folder=tmp_path, earlier=earlier)
    assert 32 not in tried and tried[0] > 256, tried
    assert 300 / 1.1 <= batch <= 300 and engine == f"engine {batch}"
    lines = recorded_trials(tmp_path)
    assert [r["trial"] for r in lines] == list(range(1, len(lines) + 1)) and len(lines) == len(search.trials)
    assert all(r["seconds"] is not None for r in lines)
    assert search.seconds >= 5.0 and all("seconds" in r for r in search.records())

    # the best recorded batch is rebuilt where no later trial fitted above it
    tried.clear()
    (batch, engine), _ = largest_batch(lambda b: (tried.append(b), Trial(b, b <= 256, b, "", kept=f"e{b}"))[1], 1,
                                       budget=10**6, earlier=earlier[:2] + [Trial(280, False)])
    assert tried == [256] and (batch, engine) == (256, "e256")
    assert recorded([], 1) == ([], "the stopped search recorded no trial; starting it again")


def test_a_torn_or_foreign_line_in_the_trials_file_is_skipped(tmp_path):
    (tmp_path / TRIALS).write_text('{"trial": 1, "batch": 32, "fits": true}\n{"trial": 2, "bat')
    assert [t["batch"] for t in recorded_trials(tmp_path)] == [32]


def _compose(*overrides):
    from hydra import compose, initialize_config_dir

    from runner.config.schema import register

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_resume_of_a_stopped_search_and_batch_max_repeated_on_a_finished_one(tmp_path):
    from omegaconf import OmegaConf

    from runner.config.resume import resumed_config, run_folder, stopped_search
    from runner.errors import ConfigError

    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "config.yaml").write_text(OmegaConf.to_yaml(_compose("batch=max")))
    assert stopped_search(stopped) and run_folder(str(stopped)) == stopped  # no checkpoints, yet a run folder
    merged, _ = resumed_config(_compose(f"resume={stopped}"), [f"resume={stopped}"])
    assert merged.batch == "max"

    finished = tmp_path / "finished"
    (finished / "checkpoints").mkdir(parents=True)
    (finished / "checkpoints" / "ckpt-2.index").write_bytes(b"")
    (finished / "config.yaml").write_text(OmegaConf.to_yaml(_compose("batch=256")))
    given = [f"resume={finished}", "batch=max"]
    with pytest.raises(ConfigError, match=r"^batch=max: this run trains at batch 256.*drop the override"):
        resumed_config(_compose(*given), given)  # a batch given by hand: the override is the mistake
    append_trial(finished, {"trial": 1, "batch": 256, "fits": True})
    assert not stopped_search(finished)
    merged, changes = resumed_config(_compose(*given), given)  # its own search found it: kept
    assert merged.batch == 256 and "batch" not in changes


@pytest.mark.slow  # ~60-90 s (two runs); the fast set continues recorded trials and resumes a stopped search's
# config in-process (above), and stops a search in a subprocess
def test_a_killed_search_is_continued_by_resume_and_says_what_it_does(tmp_path):
    """kill -9 as trial 2's line lands: the folder holds run.lock, config.yaml and two trial lines, no checkpoint.
    `resume=` continues from trial 3, trains, and `metrics.json` has every trial's seconds and the total. The
    first session's log is the search's own account: header, cap, each trial's start and verdict, INFO only."""
    out = tmp_path / "run"
    killed = worker("kill-after-trial-2", *TINY, f"hydra.run.dir={out}")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (out / "run.lock").exists() and not list(out.glob("checkpoints/ckpt-*"))
    first, second = [t["batch"] for t in recorded_trials(out)]
    assert first == 32 and second > 32
    said = [line.split("] ", 1)[1] for line in (killed.stdout + killed.stderr).splitlines() if "batch=max:" in line]
    assert said[0].startswith("batch=max: searching the largest batch whose step fits: model mlp, engine Engine, "
                              "sections=['logits']; budget ")
    assert "(the device's memory, CPU:0: " in said[0]
    assert "batch=max: at most the training set's size, 300 examples" in said[2]
    assert said[3] == "batch=max: trial 1: batch 32" and said[4].startswith("batch=max: trial 1: batch 32 fits in ")
    assert said[5] == f"batch=max: trial 2: batch {second}"
    assert not [line for line in killed.stdout.splitlines() if "[WARNING]" in line and "batch=max" in line]

    resumed = runner(f"resume={out}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stdout + resumed.stderr
    assert "taking over the lock of PID" in log
    assert (f"batch=max: resume: continuing the stopped search from its 2 recorded trial(s): 32 fits, {second} "
            f"fits") in log
    assert "trial 1: batch" not in log and "batch=max: trial 3: batch " in log
    metrics = json.loads((out / "metrics.json").read_text())
    trials = metrics["batch_max_trials"]
    assert [t["batch"] for t in trials[:2]] == [32, second] and len(trials) >= 3 and metrics["step"] == 2
    assert all(t["seconds"] > 0 for t in trials)
    assert metrics["batch_max_seconds"] == pytest.approx(sum(t["seconds"] for t in trials), abs=0.01)
    assert metrics["batch"] == max(t["batch"] for t in trials if t["fits"])

    assert not (out / "run.lock").exists()


# ---------------------------------------------------------------------------------------------- the batch survives
def test_an_evaluation_that_runs_out_of_memory_is_made_again_at_half_its_batch():
    """An evaluation at the batch found (or train.eval_batch) that does not fit the device: halved until it does,
    for the rest of the run, instead of ending the run with a traceback."""
    import numpy as np
    import tensorflow as tf

    from runner.run.train import EvalBatch, evaluate

    class Data:
        def eval_batches(self, n):
            for start in range(0, 200, n):
                yield {"x": np.zeros([min(n, 200 - start), 1], np.float32)}

    class Engine:
        replicas = type("R", (), {"count": 1})()

        def evaluate(self, batch):
            if batch["x"].shape[0] > 50:
                raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[...]")
            return {"loss": 1.0}

    size = EvalBatch(200)
    assert evaluate(Engine(), Data(), size) == {"loss": 1.0} and size.size == 50


@pytest.mark.slow  # minutes: each trial that runs out waits out the allocator's 10 s retry; the fast set halves an
# evaluation in-process (above)
def test_the_batch_found_trains_evaluates_and_checkpoints_within_the_device(tmp_path):
    """On a 350 MiB emulated device: the batch found trains three steps with an evaluation after each and a
    checkpoint after each, every step within the device; an evaluation set of 2048 at once does not fit there and
    is evaluated at half its batch (before, the run ended in a traceback at the first evaluation)."""
    from sections.allocator import BFC, LIMIT, ONEDNN

    env = {k: v for k, v in ENV.items() if k not in (BFC, ONEDNN, LIMIT, "SECTIONFLOW_ALLOCATOR_SET")}
    env[LIMIT] = "350"
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "runner", "model=resnet", "model.widths=[16,32,64]", "model.depths=[2,2,2]",
         "data=synthetic", "data.image_shape=[32,32,3]", "data.train_size=2048", "data.test_size=2048",
         "engine=whole", "batch=max", "train.steps=3", "train.eval_every=1", "train.eval_batch=2048",
         "train.checkpoint_every=1", "train.log_every=1", "train.progress=log", "train.verify_exact=false",
         "train.save_model=false", f"hydra.run.dir={out}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 3 and metrics["step_peak_bytes"] <= 350 * 2**20
    assert metrics["batch"] == max(t["batch"] for t in metrics["batch_max_trials"] if t["fits"])
    assert (out / "checkpoints" / "ckpt-3.index").is_file()
    assert "evaluation: batch 2048 ran out of the device's memory; evaluating at 1024" in proc.stdout + proc.stderr
    assert metrics["accuracy"] is not None
