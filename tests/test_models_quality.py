"""Quality bars on real (digits) and synthetic (reversal) data, trained with the sectioned engine on CPU.

Slow: run with ``pytest -m slow tests/test_models_quality.py``. Measured results are in models/README.md.
"""

from __future__ import annotations

import pathlib
import time

import keras
import numpy as np
import pytest
import tensorflow as tf
from hydra.utils import instantiate
from omegaconf import OmegaConf

from sections import Engine, WholeGraph

pytestmark = pytest.mark.slow

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"


def _conf(group: str, name: str):
    cfg = OmegaConf.load(CONF / group / f"{name}.yaml")
    return {k: v for k, v in cfg.items() if k not in ("defaults", "default_sections")}, cfg.get("default_sections")


def _build(model: str, data: str, **model_overrides):
    data_cfg, _ = _conf("data", data)
    source = instantiate(OmegaConf.create(data_cfg))
    model_cfg, sections = _conf("model", model)
    network = instantiate(OmegaConf.merge(OmegaConf.create(model_cfg), model_overrides), **source.model_args)
    return source, network, OmegaConf.to_container(sections)


def _evaluate(engine, source, weight_key: str | None = None) -> float:
    """Accuracy over the whole held-out set, batches weighted by examples (or non-padding tokens)."""
    total = count = 0.0
    for batch in source.eval_batches(512):
        n = float(tf.reduce_sum(tf.cast(batch[weight_key] != 0, tf.float32))) if weight_key else len(batch["label"])
        total += engine.evaluate(batch)["accuracy"] * n
        count += n
    return total / count


def _train(model, data, steps, batch_size, learning_rate, weight_key=None, **model_overrides):
    source, network, sections = _build(model, data, **model_overrides)
    engine = Engine(network, keras.optimizers.Adam(learning_rate), sections=sections, policy="recompute")
    batches = iter(source.train_batches(batch_size, seed=0))
    start = time.perf_counter()
    for _ in range(steps):
        stats = engine.train_step(next(batches))
    seconds = time.perf_counter() - start
    accuracy = _evaluate(engine, source, weight_key)
    print(f"\n{model} on {data}: {steps} steps x {batch_size}, {seconds:.0f} s, "
          f"final loss {stats['loss']:.4f}, test accuracy {accuracy:.4f}")
    return accuracy, engine


def _runner_defaults():
    """The runner's default job length: top-level batch, train.steps, optimizer learning rate."""
    top = OmegaConf.load(CONF / "config.yaml")
    train = OmegaConf.load(CONF / "train" / "default.yaml")
    adam = OmegaConf.load(CONF / "optimizer" / "adam.yaml")
    return int(top.batch), int(train.steps), float(adam.learning_rate)


def test_resnet_on_digits_reaches_97_percent_in_a_default_run():
    batch, steps, lr = _runner_defaults()
    accuracy, _ = _train("resnet", "digits", steps, batch, lr)
    assert accuracy >= 0.97


def test_mlp_on_digits_reaches_95_percent():
    accuracy, _ = _train("mlp", "digits", steps=300, batch_size=128, learning_rate=1e-3)
    assert accuracy >= 0.95


def test_seq2seq_on_reversal_reaches_95_percent_token_accuracy():
    accuracy, _ = _train("seq2seq", "sequences", steps=2000, batch_size=64, learning_rate=3e-3,
                              weight_key="target_out")
    assert accuracy >= 0.95


def test_attention_on_digits_reaches_95_percent():
    accuracy, _ = _train("attention", "digits", steps=300, batch_size=128, learning_rate=1e-3)
    assert accuracy >= 0.95


def test_attention_sectioned_step_equals_whole_graph_step():
    """The engine's equivalence test on the full-size attention model: 3 steps, sectioned vs one whole graph."""
    source, sectioned, sections = _build("attention", "digits")
    _, whole, _ = _build("attention", "digits")
    batches = iter(source.train_batches(64, seed=1))
    batches = [next(batches) for _ in range(3)]
    a = Engine(sectioned, keras.optimizers.Adam(1e-3), sections=sections, policy="recompute", check=True)
    b = WholeGraph(whole, keras.optimizers.Adam(1e-3))
    losses_a = [a.train_step(x)["loss"] for x in batches]
    losses_b = [b.train_step(x)["loss"] for x in batches]
    np.testing.assert_allclose(losses_a, losses_b, rtol=1e-4, atol=1e-5)
    for va, vb in zip(sectioned.variables, whole.variables):
        np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=1e-4, atol=1e-5, err_msg=va.path)
