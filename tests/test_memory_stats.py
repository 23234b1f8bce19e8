"""Memory is measured on every CPU (the runner and the tests set the CPU allocator up before TensorFlow loads),
and where it cannot be, nothing reads it as 0 bytes or plans on it."""

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sections.allocator import BFC, MARKER, ONEDNN, configure, describe

ROOT = Path(__file__).resolve().parents[1]
QUICK = ["model=mlp", "data=digits", "batch=32", "train.steps=2", "train.eval_every=0", "train.checkpoint_every=0",
         "train.verify_exact=false", "train.progress=log", "train.log_every=1"]


def clean_env(**extra) -> dict:
    """This process's environment without the allocator settings the test session made (conftest)."""
    env = {k: v for k, v in os.environ.items() if k not in (BFC, ONEDNN, MARKER)}
    return {**env, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": "", **extra}


def run(args, env, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_configure_sets_the_bfc_allocator_unless_the_user_chose():
    env = {}
    assert "set by sectionflow" in configure(env, tensorflow_loaded=False)
    if platform.machine() == "x86_64":  # oneDNN on (its allocator keeps statistics): no BFC needed
        assert env == {ONEDNN: "1", MARKER: ONEDNN}
    else:
        assert env[BFC] == "true" and env[MARKER] == BFC
    theirs = {ONEDNN: "0"}
    configure(theirs, tensorflow_loaded=False)
    assert theirs == {ONEDNN: "0", BFC: "true", MARKER: BFC}  # statistics without overriding their oneDNN choice
    mine = {BFC: "false", ONEDNN: "0"}
    line = configure(mine, tensorflow_loaded=False)
    assert mine == {BFC: "false", ONEDNN: "0"}
    assert f"{BFC}=false (yours)" in line and f"{ONEDNN}=0 (yours)" in line
    late = {}
    configure(late, tensorflow_loaded=True)  # too late to matter: nothing is set
    assert late == {}
    assert describe({ONEDNN: "1"}) == f"CPU allocator: {BFC} unset, {ONEDNN}=1 (yours)"


def test_runner_measures_memory_with_onednn_off(tmp_path):
    """TF_ENABLE_ONEDNN_OPTS=0 is what TensorFlow does on CPUs without AVX512_VNNI/BF16 or AMX: no statistics
    unless the runner sets the allocator up; it does, and says so in the header."""
    out = tmp_path / "run"
    proc = run(["-m", "runner", *QUICK, f"hydra.run.dir={out}"], clean_env(**{ONEDNN: "0"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["memory_measured"] is True and metrics["step_peak_bytes"] > 0
    assert all(p > 0 for p in metrics["peak_bytes_per_section"])
    log = (out / "runner.log").read_text()
    assert "memory: measured on CPU:0; device memory CPU:0: " in log
    assert f"; CPU allocator: {BFC}=true (set by sectionflow), {ONEDNN}=0 (yours)" in log


def test_without_statistics_nothing_reads_zero_and_nothing_plans(tmp_path):
    env = clean_env(**{ONEDNN: "0", BFC: "false"})
    out = tmp_path / "run"
    proc = run(["-m", "runner", *QUICK, f"hydra.run.dir={out}"], env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["memory_measured"] is False and metrics["step_peak_bytes"] is None
    assert metrics["peak_bytes_per_section"] == [None] * metrics["num_sections"]
    log = (out / "runner.log").read_text()
    assert "memory: NOT MEASURED" in log and "peak not measured" in log and "peak 0 B" not in log
    # sections=auto's refusal without statistics: in the library test below (one subprocess fewer here)


@pytest.mark.slow  # ~6 s: a subprocess
def test_a_library_user_who_loaded_tensorflow_first_gets_one_warning():
    script = textwrap.dedent("""
        import warnings
        import tensorflow as tf, keras, numpy as np
        from sections import Engine, Network
        from sections.backend.memory import MemoryMeter
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            MemoryMeter(); MemoryMeter()
        print("warnings", sum("keeps no memory statistics" in str(w.message) for w in caught))
        print("names", all("TF_CPU_ALLOCATOR_USE_BFC=true" in str(w.message) for w in caught))
        def net():
            inp = keras.Input((4,)); return Network.from_keras(keras.Model(inp, keras.layers.Dense(2)(inp)),
                lambda out, b: tf.reduce_mean(out ** 2), inputs="x")
        batch = {"x": np.ones((8, 4), "float32")}
        print("peak", Engine(net(), keras.optimizers.SGD(0.1), sections=1).train_step(batch)["step_peak_bytes"])
        try:
            Engine(net(), keras.optimizers.SGD(0.1), sections="auto", memory_budget="1GiB").build(batch)
        except ValueError as err:
            print("auto", err)
    """)
    proc = run(["-c", script], clean_env(**{ONEDNN: "0", BFC: "false"}))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "warnings 1" in out and "names True" in out and "peak None" in out, out
    assert "auto sections='auto' plans on measured memory" in out and f"set {BFC}=true" in out, out


@pytest.mark.parametrize("columns,bar", [(0, False), (80, True)])
def test_progress_bar_needs_a_terminal_with_columns(monkeypatch, columns, bar):
    from runner.run import progress

    monkeypatch.setattr(progress.sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(progress.os, "get_terminal_size", lambda fd: os.terminal_size((columns, 24)))
    p = progress.Progress(total=3, start=0, mode="auto", log_every=1)
    try:
        assert (p.bar is not None) is bar
    finally:
        p.close()
