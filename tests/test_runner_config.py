"""The runner's configs and its answers to bad input: composition, --help, one-line errors, output folders."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from runner.app import CONF
from runner.hydra_callbacks import claim_folder
from runner.config.schema import register

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
TINY = ["model=resnet", "model.widths=[4,4,4]", "model.depths=[1,1,1]", "batch=8", "train.steps=1"]


def runner(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env or ENV, capture_output=True,
                          text=True, timeout=120)


def composed(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


def test_help_lists_the_groups_without_importing_tensorflow():
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "runner", "--help"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    for group in ("model:", "data:", "optimizer:", "engine:", "train:", "experiment:"):
        assert group in proc.stdout
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "hydra" in imported and not {m for m in imported if m.split(".")[0] in ("tensorflow", "keras")}


def test_default_config_is_resnet_on_digits_with_its_sections():
    cfg = composed()
    assert cfg.model._target_ == "models.build_resnet" and cfg.data._target_ == "models.data.digits"
    assert cfg.sections is None and len(cfg.model.default_sections) == 3
    assert cfg.optimizer._target_ == "keras.optimizers.Adam"


def test_partialflow_mnist_experiment_is_the_notebook_setting():
    cfg = composed("experiment=partialflow_mnist")
    assert cfg.batch == 7500 and cfg.optimizer.learning_rate == 1e-4
    assert cfg.optimizer._target_ == "keras.optimizers.Adam" and cfg.model._target_ == "models.build_resnet"
    assert cfg.sections is None and len(cfg.model.default_sections) + 1 == 4


@pytest.mark.parametrize("option", sorted(p.stem for p in (Path(CONF) / "optimizer").glob("*.yaml")))
def test_every_optimizer_option_builds(option):
    from hydra.utils import instantiate

    optimizer = instantiate(composed(f"optimizer={option}").optimizer)
    assert optimizer.learning_rate.numpy() > 0


def test_schema_types_every_engine_and_train_field():
    cfg = composed("engine=store", "train=smoke")
    assert OmegaConf.get_type(cfg, "engine").__name__ == "EngineConfig"
    assert OmegaConf.get_type(cfg, "train").__name__ == "TrainConfig"
    assert cfg.engine.policy == "store" and cfg.train.steps == 4


def _fake_run(folder: Path) -> Path:
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "checkpoint").write_text("")
    (folder / "checkpoints" / "ckpt-1.index").write_text("")
    (folder / "config.yaml").write_text("model:\n  _target_: models.build_mlp\n  hidden: [8]\n"
                                        "data:\n  _target_: models.data.digits\n"
                                        "optimizer:\n  _target_: keras.optimizers.Adam\n  learning_rate: 0.001\n"
                                        "batch: 256\n")
    return folder


BAD = [
    (["foo=1"], "foo=1: unknown key; the top level has: model"),
    (["train.stepz=3"], "train.stepz=3: unknown key (did you mean 'steps'?); train has: steps"),
    (["optimizer.learning_rate=abc"], "optimizer.learning_rate=abc: must be a number"),
    (["optimizer.learning_rate=inf"], "optimizer.learning_rate=inf: must be a finite number"),
    (["optimizer.learning_rate=nan"], "optimizer.learning_rate=nan: must be a finite number"),
    (["optimizer=sgd", "optimizer.momentum=abc"], "optimizer.momentum=abc: must be a number"),
    (["optimizer.beta_1=2"], "optimizer.beta_1=2.0: must be a number from 0 to below 1"),
    (["optimizer=rmsprop", "optimizer.epsilon=0"], "optimizer.epsilon=0.0: must be a positive number"),
    (["train.seed=-1"], "train.seed=-1: must be an integer from 0 to 4294967295"),
    (["train.profile_steps=[3,1]"], "train.profile_steps=[3,1]: must be [first, last]"),
    (["sections=[a"], "sections=[a: not valid override syntax"),
    (["model=resnte"], "model=resnte: unknown option (did you mean 'resnet'?); allowed: attention"),
    (["optimizer.beta1=0.5"], "optimizer.beta1=0.5: unknown key (did you mean 'beta_1'?)"),
    (["batch=abc"], "batch=abc: must be a positive integer, or max"),
    (["engine.jit_compile=maybe"], "engine.jit_compile=maybe: must be true or false"),
    (["model=nope"], "model=nope: unknown option; allowed: attention, gpt, keras_app, keras_file, keras_hub, mlp, resnet"),
    (["data=nope"], "data=nope: unknown option; allowed: arrays, digits, image_folder"),
    (["optimizer=nope"], "optimizer=nope: unknown option; allowed: adam"),
    (["optimizer.bogus=1"], "optimizer.bogus=1: unknown key; optimizer has: _target_, learning_rate"),
    (["model=mlp", "model.hiddn=[3]"], "model.hiddn=[3]: unknown key (did you mean 'hidden'?); model has: _target_, default_sections, hidden"),
    (["data.max_shif=1"], "data.max_shif=1: unknown key (did you mean 'max_shift'?); data has: _target_, test_fraction"),
    # a node given whole is what a later key under it is checked against (it read "model.args has: no keys")
    (["model=keras_hub", "model.args={{num_layers: 2}}", "model.args.hidden_dim=64"],
     "model.args.hidden_dim=64: unknown key; model.args has: num_layers (+model.args.hidden_dim=... adds a new key)"),
    (["model=keras_hub", "model.argz={{num_layers: 2}}"], "model.argz={{num_layers: 2}}: unknown key (did you mean 'args'?)"),
    (["batch=0"], "batch=0: must be a positive integer"),
    (["~batch"], "~batch: cannot be deleted: the runner needs it; set it instead (batch=<value>)"),
    (["batch=-5"], "batch=-5: must be a positive integer"),
    (["sections=0"], "sections=0: must be at least 1"),
    (["sections=[a,a]"], "sections=[a,a]: Section boundaries ['a', 'a'] name the same place twice"),
    (["batch=lots"], "batch=lots: must be a positive integer, or max (the largest batch whose step fits the device)"),
    (["sections=auto", "engine.memory_budget=150%"], "engine.memory_budget=150%: a percentage of the device's memory must be in (0%, 100%]"),
    (["engine.policy=bad"], "engine.policy=bad: Unknown policy 'bad'; allowed: ['recompute', 'store', 'recreate']"),
    (["engine.policy=stor"], "(did you mean 'store'?)"),
    (["engine.memory_budget=abc"], "engine.memory_budget=abc: must be a size with a unit (2GiB, 512MiB"),
    (["engine.lean=deep"], "engine.lean=deep: must be true, false or recompute"),
    (["engine._target_=bad"], "engine._target_=bad: allowed: sections.Engine, sections.WholeGraph, sections.RecomputeGrad"),
    (["train.progress=x"], "train.progress=x: allowed: auto, bar, log"),
    (["train.inter_op_threads=0"], "train.inter_op_threads=0: allowed: auto, a positive integer, or null"),
    (["train.inter_op_threads=many"], "train.inter_op_threads=many: allowed: auto, a positive integer, or null"),
    (["train.gpu_memory=lots"], "train.gpu_memory=lots: allowed: a size such as 16GiB or 850MiB (a number: bytes), or null"),
    # checked once TensorFlow is loaded (no GPU here): the CPU's own way to emulate a device is named
    (["train.gpu_memory=2GiB"], "train.gpu_memory=2GiB: this process has no GPU; on the CPU a device of N MiB is "
                                "emulated with TF_CPU_BFC_MEM_LIMIT_IN_MB=N in the environment"),
    (["resume=/no/such/run"], "resume=/no/such/run: no such folder"),
    (["resume={tmp}/other", "model=resnet"], "cannot change model._target_ (models.build_mlp -> models.build_resnet)"),
    (["resume={tmp}/other", "optimizer=adamw"], "cannot change optimizer._target_"),
    (["resume={tmp}/other", "batch=7"], "cannot change batch (256 -> 7) on resume"),
    (["resume={tmp}/nope"], "resume={tmp}/nope: no such folder"),
    (["resume={tmp}/other", "+data.extra=1"], "cannot change data.extra (null -> 1) on resume"),
    (["-m", "resume={tmp}/other", "train.steps=3,4"], "it cannot be part of a sweep (-m)"),
    pytest.param([*TINY, "sections=99"], "sections=99: this model has 5 blocks; allowed: 1 to 5", marks=pytest.mark.slow),
    pytest.param([*TINY, "sections=[scale1,nope]"], "sections=[scale1,nope]: unknown boundary name(s) nope; allowed: initial_conv", marks=pytest.mark.slow),
    pytest.param([*TINY, "optimizer._target_=keras.optimizers.Nope"], "optimizer._target_=keras.optimizers.Nope: cannot build", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join((c.values if hasattr(c, "values") else c)[0][-1:])
                                                    for c in BAD])
def test_bad_input_exits_with_one_line_naming_the_key(args, message, tmp_path):
    _fake_run(tmp_path / "other")
    out = tmp_path / "run"
    proc = runner(*(a.format(tmp=tmp_path) for a in args), f"hydra.run.dir={out}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message.format(tmp=tmp_path) in last, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists() or sorted(p.name for p in out.iterdir()) == ["runner.log"]


@pytest.mark.parametrize("args,message", [
    (["~batch"], "~batch: cannot be deleted"), (["~model"], "~model: cannot be deleted"),
    (["~train.seed"], "~train.seed: cannot be deleted"), (["~sections"], "~sections: cannot be deleted"),
    (["~bench"], "Could not delete 'bench'"),
])
def test_deleting_a_needed_key_is_refused_before_composing(args, message):
    """`~key` has no `=`; a required key deleted used to reach Hydra or the run and end in a traceback."""
    from runner.config.overrides import check_overrides
    from runner.errors import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_overrides(args, CONF)
    for fine in (["~model.dropout"], ["~experiment"]):  # a builder argument's default, an optional group
        check_overrides(fine, CONF)


def test_full_error_env_shows_the_traceback(tmp_path):
    proc = runner("batch=0", f"hydra.run.dir={tmp_path / 'run'}", env={**ENV, "HYDRA_FULL_ERROR": "1"})
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "batch=0" in proc.stderr


def test_runs_started_together_never_share_a_folder(tmp_path):
    out = tmp_path / "same"
    cmd = [sys.executable, "-m", "runner", "batch=0", f"hydra.run.dir={out}"]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(3)]
    assert [p.wait(60) for p in procs] == [2, 2, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same", "same-1", "same-2"]
    assert all((tmp_path / name / "runner.log").is_file() for name in ("same", "same-1", "same-2"))


def test_claim_folder_adds_a_suffix_when_taken(tmp_path):
    assert [claim_folder(tmp_path / "a" / "12-00-00").name for _ in range(3)] == ["12-00-00", "12-00-00-1",
                                                                                   "12-00-00-2"]


def test_run_function_trains_in_process(tmp_path):
    """The template's in-process check: compose with Hydra's API, call the run function, read its record."""
    import json

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.app import run

    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True, overrides=[
            "model=mlp", "model.hidden=[8]", "data=synthetic", "data.train_size=64", "data.test_size=32",
            "train=smoke", "train.steps=2", "train.verify_exact=false", "batch=8"])
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    value = run(cfg, tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["step"] == 2 and value == metrics["accuracy"] and 0 <= value <= 1
    assert OmegaConf.load(tmp_path / "config.yaml").model.hidden == [8]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index")) == ["ckpt-2.index"]


def test_train_options_are_the_default_plus_changes():
    smoke = OmegaConf.load(Path(CONF) / "train" / "smoke.yaml")
    assert list(smoke.defaults) == ["default", "_self_"] and "seed" not in smoke
    cfg = composed("train=smoke")
    assert cfg.train.steps == 4 and cfg.train.seed == 0 and cfg.train.profile_steps is None


def test_an_uncreatable_run_folder_is_one_line(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = runner("batch=8", f"hydra.run.dir={blocker / 'run'}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: hydra.run.dir={blocker / 'run'}: cannot create the run folder"), proc.stderr


def test_help_with_a_sweep_on_the_command_line_shows_help_not_a_traceback():
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, "-m", "runner", "-m", "batch=16,32", "model=mlp", "--help"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "sweep values left out: batch=16,32" in proc.stdout and "== Config (override any key" in proc.stdout
