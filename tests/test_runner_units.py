"""Small runner pieces without a run: TensorFlow's start-up lines filtered, resume's change rules, the exactness
verdict on non-finite errors, the TensorBoard hint, op determinism between a sweep's jobs."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from runner.config.resume import differences, resumed_config
from runner.errors import ConfigError
from runner.platform.quiet import filtered

CAPTURED = """WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795356903.290916    5908 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795356903.291195    5908 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795356905.683404    5908 port.cc:153] oneDNN custom operations are on.
I0000 00:00:1795356905.684057    5908 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
E0000 00:00:1795356907.964201    5908 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error
E0000 00:00:1795356907.964201    5908 other.cc:1] something else went wrong
"""


def test_tensorflow_start_up_lines_once_each_and_no_cuda_probing_without_a_gpu():
    assert filtered(CAPTURED, has_gpu=False, min_level=0) == [
        "I0000 00:00:1795356903.290916    5908 port.cc:153] oneDNN custom operations are on.",
        "E0000 00:00:1795356907.964201    5908 other.cc:1] something else went wrong"]
    assert filtered(CAPTURED, has_gpu=False, min_level=2) == [
        "E0000 00:00:1795356907.964201    5908 other.cc:1] something else went wrong"]
    with_gpu = filtered(CAPTURED, has_gpu=True, min_level=0)
    assert len(with_gpu) == 4 and sum("cuInit" in line for line in with_gpu) == 1


def _saved_run(tmp_path, **changes):
    folder = tmp_path / "run"
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "ckpt-4.index").write_text("")
    saved = {"model": {"_target_": "models.build_mlp", "hidden": [8], "default_sections": None},
             "data": {"_target_": "models.data.digits"}, "batch": 16, "sections": None,
             "optimizer": {"_target_": "keras.optimizers.SGD", "learning_rate": 0.1, "momentum": 0.9},
             "engine": {"policy": "recompute"}, "train": {"steps": 4, "seed": 0}, "resume": None}
    OmegaConf.save(OmegaConf.create(saved), folder / "config.yaml")
    now = OmegaConf.merge(OmegaConf.create(saved), OmegaConf.create(changes), {"resume": str(folder)})
    now.train.setdefault("eval_every", 50)  # a key the saved run did not have: today's default fills it
    return folder, now


def test_resume_applies_partition_and_hyperparameter_changes(tmp_path):
    folder, now = _saved_run(tmp_path, sections=2, train={"steps": 8}, optimizer={"learning_rate": 0.01})
    cfg, changes = resumed_config(now, ["sections=2", "train.steps=8", "optimizer.learning_rate=0.01",
                                        f"resume={folder}"])
    assert changes == {"optimizer.learning_rate": (0.1, 0.01), "sections": (None, 2), "train.steps": (4, 8)}
    assert cfg.model.hidden == [8] and cfg.train.eval_every == 50 and cfg.resume == str(folder)


@pytest.mark.parametrize("override,changes,refused", [
    ("batch=32", {"batch": 32}, "batch (16 -> 32)"),
    ("train.seed=1", {"train": {"seed": 1}}, "train.seed (0 -> 1)"),
    ("optimizer.momentum=0", {"optimizer": {"momentum": 0.0}}, "optimizer.momentum (0.9 -> 0)"),
    ("model.hidden=[4]", {"model": {"hidden": [4]}}, "model.hidden ([8] -> [4])"),
])
def test_resume_refuses_what_the_checkpoint_fixes(tmp_path, override, changes, refused):
    folder, now = _saved_run(tmp_path, **changes)
    with pytest.raises(ConfigError, match="cannot change") as err:
        resumed_config(now, [override])
    assert refused in str(err.value) and "\n" not in str(err.value)


def test_resume_refusing_another_option_names_its_target_not_every_key(tmp_path):
    folder, now = _saved_run(tmp_path, data={"_target_": "models.data.synthetic", "noise": 0.5}, batch=32)
    with pytest.raises(ConfigError) as err:
        resumed_config(now, ["data=synthetic", "batch=32"])
    assert "cannot change batch (16 -> 32), data._target_ (models.data.digits -> models.data.synthetic) on" \
        in str(err.value) and "noise" not in str(err.value)


def test_resume_refuses_an_experiment(tmp_path):
    folder, now = _saved_run(tmp_path)
    with pytest.raises(ConfigError, match="experiment=.*give the keys to change"):
        resumed_config(now, ["experiment=partialflow_mnist"])


def test_differences_ignore_the_resume_key():
    a = OmegaConf.create({"resume": None, "x": {"y": 1}})
    b = OmegaConf.create({"resume": "/r", "x": {"y": 2}})
    assert differences(a, b) == {"x.y": (1, 2)}


def test_non_finite_gradient_error_is_not_exact(monkeypatch):
    from types import SimpleNamespace

    import sections

    from runner.run.train import verify_exact

    report = {"exact": True, "gradient_rel_error": math.nan, "state_max_abs_diff": 0.0, "worst_variable": "w"}
    monkeypatch.setattr(sections, "compare_with_whole", lambda engine, batch, examples: report)
    engine = SimpleNamespace(replicas=SimpleNamespace(count=1), strategy="sectioned",  # what verify_exact reads
                             kernel_faults=None)
    result = verify_exact(engine, {}, examples=4)
    assert result["exact"] is False and math.isnan(result["exact_gradient_rel_error"])


def test_a_job_without_determinism_after_one_with_it_runs_without():
    """Hydra runs a sweep's jobs in one process; op determinism is process-wide (and turns Keras's XLA off)."""
    from tensorflow.python.framework.config import is_op_determinism_enabled

    from runner.run.build import build
    from test_runner_config import TINY, composed

    try:
        for deterministic in (True, False):
            build(composed(*TINY, "data=synthetic", f"train.deterministic={str(deterministic).lower()}"))
            assert is_op_determinism_enabled() is deterministic
    finally:
        from runner.run.build import set_determinism

        set_determinism(False)


def test_metrics_carry_each_dry_steps_prediction_and_planning_in_steps():
    from types import SimpleNamespace

    from runner.run.train import planning_figures

    dry = [{"sections": 5, "predicted": 300, "measured": 290, "ran_out": False, "fits": True, "seconds": 2.0}]
    engine = SimpleNamespace(plan=object(), planning_seconds=30.0, dry_runs=dry, plan_remembered=True)
    assert planning_figures(engine, 3.0) == {"planning_dry_steps": dry, "planning_in_steps": 10.0,
                                             "plan_remembered": True}
    assert planning_figures(engine, float("nan"))["planning_in_steps"] is None
    assert planning_figures(SimpleNamespace(plan=None, planning_seconds=None, dry_runs=()), 3.0) == {}
