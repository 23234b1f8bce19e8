"""Plans remembered across processes (`Engine(plan_store=...)`, the runner's `train.plan_cache`): a remembered plan
is dry-run first and runs where the planner makes it again and it fits; anything else is a fresh search."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import keras
import pytest

from engine_nets import conv_stack, make_batch


def built(store, batch, **kw):
    """A fresh model (names numbered from the start, as in a new process) planned with ``store``."""
    from sections import Engine

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    engine = Engine(conv_stack(depth=6), keras.optimizers.Adam(1e-3), sections="auto", memory_budget="1GiB",
                    plan_store=store, **kw)
    engine.build(batch)
    return engine


@pytest.fixture(scope="module")
def first():
    """One search's engine, its store and batch (a 3-section least-memory plan, then 1 section chosen)."""
    batch = make_batch(n=32, size=16, classes=10)
    store = {}
    engine = built(store, batch)
    return engine, dict(store), batch


def test_a_remembered_plan_runs_with_one_dry_step_and_a_record_of_another_plan_is_searched_past(first, caplog):
    first, store, batch = first
    assert first.calibrator.from_record is None and len(store) == 1
    (key, record), = store.items()
    assert key == first.plan_key and record["schedule"]["starts"] == list(first.schedule.starts)
    json.dumps(record)  # plain data: what a file keeps
    counted = first.calibrator._plan_of(first.calibrator._candidate(first.plan))  # the planner's, not the adopted
    assert record["plan"]["modelled"] == counted.predicted_peak - counted.base_bytes != \
        first.plan.predicted_peak - first.plan.base_bytes
    again = built(dict(store), batch)
    assert again.plan_key == key and again.calibrator.from_record is True
    assert again.schedule == first.schedule and len(again.dry_runs) == 1
    # its prediction: what its dry step measured where it was chosen
    assert again.dry_runs[0]["predicted"] == record["dry_step"] == first.dry_runs[-1]["measured"]
    # a record of sections these blocks do not have, or no record at all: searched past, said in one line
    calibrator = again.calibrator
    with caplog.at_level(logging.INFO, logger="sections"):
        assert not calibrator._try_record({**record, "schedule": {**record["schedule"], "starts": [99]}}, batch)
    assert "the remembered record does not describe a plan of these blocks; searching" in caplog.text
    assert calibrator._remade({"something": "else"}) is None
    assert calibrator._remade(record).schedule == first.schedule
    assert len(again.dry_runs) == 1  # neither was dry-run


def test_a_remembered_plan_whose_dry_step_does_not_fit_is_searched_past(first, monkeypatch, caplog):
    from sections.step.calibrate import Calibrator

    first, store, batch = first
    real = Calibrator._dry_run

    def over_the_budget(self, candidate, batch, why, predicted=None):
        real(self, candidate, batch, why, predicted)
        if why == "the plan remembered for this set-up":  # as if this process's heap held it over the budget
            step = self.search.steps[-1]
            self.search.steps[-1] = type(step)(step.candidate, self.budget + 1, 0, False, step.predicted)

    monkeypatch.setattr(Calibrator, "_dry_run", over_the_budget)
    with caplog.at_level(logging.INFO, logger="sections"):
        again = built(dict(store), batch)
    assert again.calibrator.from_record is False and "does not fit in this process; searching" in caplog.text
    # the search went on from this process's least-memory plan (another plan than the remembered one-section plan;
    # its count, kernels' work buffers included, can differ from the first build's)
    least = again.calibrator._least_plan().schedule
    assert least != first.schedule and again.dry_runs[1]["sections"] == least.num_sections
    assert len(again.dry_runs) <= 3


def test_the_key_names_what_the_plan_depends_on(first):
    from sections.step.remembered import plan_key

    engine = first[0]
    args = dict(network=engine.network, borders=engine.borders, optimizer=engine.optimizer,
                budget=engine.memory_budget, device=engine.device_memory.describe(), lean=engine.lean,
                jit_compile=False, apply_reason=engine.apply_reason)
    assert plan_key(**args) == engine.plan_key
    changed = [dict(budget=engine.memory_budget // 2), dict(device="GPU:0: 16.0 GiB"), dict(lean=False),
               dict(jit_compile=True), dict(optimizer=keras.optimizers.SGD()), dict(apply_reason="at_end")]
    keys = {plan_key(**{**args, **change}) for change in changed}
    assert len(keys) == len(changed) and engine.plan_key not in keys


def test_a_keras_models_cut_blocks_have_a_key():
    """``Network.from_keras`` blocks are cuts of the model's graph, not Keras layers (the runner's keras_app)."""
    from sections import Engine, Network
    from sections.step.remembered import plan_key

    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    outputs = keras.layers.Dense(10, name="head")(keras.layers.GlobalAveragePooling2D(name="pool")(h))
    def xent(outputs, batch):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(batch["label"], outputs, from_logits=True))

    net = Network.from_keras(keras.Model(inputs, outputs), xent)
    engine = Engine(net, keras.optimizers.SGD(0.1), sections=2)
    engine.build(make_batch(n=4, size=8, classes=10))
    key = plan_key(net, engine.borders, engine.optimizer, 2**30, "CPU:0", True, False, None)
    assert len(key) == 40 and key == plan_key(net, engine.borders, engine.optimizer, 2**30, "CPU:0", True, False, None)


def test_the_runners_cache_keeps_a_record_per_file_and_says_what_it_cannot_read_or_write(tmp_path, caplog):
    from runner.config.checks import check_plan_cache as check
    from runner.run.plan_cache import PlanCache, default_folder, plan_cache
    from runner.errors import ConfigError

    cache = PlanCache(tmp_path / "plans")
    assert cache.get("abc") is None and cache.found is None
    cache["abc"] = {"room": "least", "sections": 3}
    assert json.loads((tmp_path / "plans" / "abc.json").read_text()) == {"room": "least", "sections": 3}
    assert not [p for p in (tmp_path / "plans").iterdir() if p.name != "abc.json"]  # nothing half-written left
    with caplog.at_level(logging.INFO, logger="runner"):
        assert cache.get("abc") == {"room": "least", "sections": 3} and cache.found == tmp_path / "plans" / "abc.json"
    assert "a plan of 3 section(s) remembered for this set-up" in caplog.text
    (tmp_path / "plans" / "bad.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert cache.get("bad") is None
    assert "bad.json could not be read" in caplog.text and "planning without it" in caplog.text
    blocked = tmp_path / "file"
    blocked.write_text("")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="runner"):
        PlanCache(blocked / "plans")["x"] = {"room": 1}  # its folder cannot be made: said once, the run goes on
        PlanCache(blocked / "plans")["y"] = {"room": 1}
    assert caplog.text.count("the plan could not be kept in") == 2  # once per run (each run makes one cache)
    assert plan_cache(None) is None and plan_cache(False) is None
    assert plan_cache("auto").folder == default_folder() == \
        Path(os.environ["XDG_CACHE_HOME"]) / "sectionflow" / "plans"  # the tests' own folder (conftest)
    for good in ("auto", None, False, str(tmp_path)):
        check(good)
    for bad in ([1, 2], "", 3):
        with pytest.raises(ConfigError, match="train.plan_cache"):
            check(bad)


def test_two_runs_of_one_set_up_run_one_plan_through_the_cache(tmp_path):
    """The runner in process: the second run dry-runs the first run's plan and runs it (metrics.json says so)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.app import CONF, run
    from runner.config.schema import register

    register()
    found = []
    for k in range(2):
        keras.backend.clear_session()
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("config", return_hydra_config=True, overrides=[
                "model=mlp", "model.hidden=[16,16]", "data=synthetic", "data.image_shape=[8,8,1]",
                "data.train_size=64", "data.test_size=32", "train=smoke", "train.steps=1", "train.eval_every=0",
                "train.verify_exact=false", "train.save_model=false", "batch=16", "sections=auto",
                f"train.plan_cache={tmp_path / 'plans'}"])
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg.hydra
        run(cfg, tmp_path / f"run{k}")
        found.append(json.loads((tmp_path / f"run{k}" / "metrics.json").read_text()))
    assert [m["plan_remembered"] for m in found] == [None, True], found
    assert found[0]["section_blocks"] == found[1]["section_blocks"] and len(found[1]["planning_dry_steps"]) == 1
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1


def test_a_sectioned_model_keeps_its_plan_in_the_callers_mapping(tmp_path):
    """``SectionedModel(plan_store=...)``: the caller's own dict receives the record (Keras's attribute tracking
    copies a dict assigned to a model; the wrapper keeps it past that), and a second wrapper runs it from a
    ``shelve`` (docs/FIT.md's way across processes)."""
    import shelve

    import numpy as np

    from sections import SectionedModel

    def wrapped(store):
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        inp = keras.Input((16, 16, 2), name="image")
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c1")(inp)
        h = keras.layers.Conv2D(16, 3, padding="same", activation="relu", name="c2")(h)
        out = keras.layers.Dense(10, name="head")(keras.layers.GlobalAveragePooling2D(name="pool")(h))
        model = SectionedModel(keras.Model(inp, out), sections="auto", memory_budget="1GiB", plan_store=store)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        rng = np.random.default_rng(0)
        model.fit(rng.normal(size=(32, 16, 16, 2)).astype("float32"), rng.integers(0, 10, 32), batch_size=32,
                  epochs=1, verbose=0)
        return model

    store = {}
    first = wrapped(store)
    assert len(store) == 1 and first.engine.plan_remembered is None
    with shelve.open(str(tmp_path / "plans")) as shelf:
        shelf.update(store)
    with shelve.open(str(tmp_path / "plans")) as shelf:
        assert wrapped(shelf).engine.plan_remembered is True


def test_the_benchmark_commands_compose():
    """BENCHMARKS.md's "One plan per set-up" commands are valid overrides (composed and checked, not run)."""
    import re
    import shlex

    from hydra import compose, initialize_config_dir

    from runner.app import CONF
    from runner.config.checks import check_config
    from runner.config.schema import register

    text = (Path(__file__).resolve().parents[1] / "BENCHMARKS.md").read_text()
    section = text[text.index("## One plan per set-up"):text.index("## Tried and not kept")]
    commands = re.findall(r"^TF_CPU_BFC_MEM_LIMIT_IN_MB=\d+ python -m runner (.*)$", section, re.M)
    assert len(commands) == 2
    register()
    for line in commands:
        with initialize_config_dir(config_dir=CONF, version_base="1.3"):
            cfg = compose("config", overrides=shlex.split(line))
        check_config(cfg)
        assert cfg.sections == "auto" and cfg.train.plan_cache == "/tmp/plans"
