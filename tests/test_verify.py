"""The exactness report (``compare_with_whole``, the runner's ``verify_exact``): yes on exact steps, NO on wrong
ones, whatever the model's rounding noise."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import Engine, Network, Recompute, WholeGraph, compare_with_whole


def biased_before_batch_norm():
    """Keras's defaults: every convolution keeps its bias, though batch norm right after it cancels the bias's
    effect (its true gradient is zero, its computed one rounding noise)."""
    L = keras.layers
    keras.utils.set_random_seed(3)
    x = keras.Input((16, 16, 3))
    h = L.Activation("relu", name="r1")(L.BatchNormalization(name="bn1")(L.Conv2D(16, 3, name="c1")(x)))
    h = L.Activation("relu", name="r2")(L.BatchNormalization(name="bn2")(L.SeparableConv2D(16, 3, name="s1")(h)))
    h = L.BatchNormalization(name="bn3")(L.Conv2D(16, 3, name="c2")(h))
    h = L.GlobalAveragePooling2D(name="pool")(L.Activation("relu", name="r3")(h))
    return keras.Model(x, L.Dense(10, name="logits")(h))


def xent(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["label"], logits, from_logits=True))


def batch(n=32):
    rng = np.random.default_rng(0)
    return {"image": tf.constant(rng.uniform(0, 1, (n, 16, 16, 3)), tf.float32),
            "label": tf.constant(rng.integers(0, 10, n), tf.int32)}


class ScaledInputGradient(Recompute):
    """A wrong step: the gradient handed to the section before is 1% too large."""

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        g_in, g_vars = super().backward(fns, kept, view, upstream, snapshot, expected)
        return [g * 1.01 for g in g_in], g_vars


@pytest.mark.parametrize("trainer,sections", [(WholeGraph, 1), (Engine, 1), (Engine, ["r1", "bn2"])],
                         ids=["whole", "one-section", "three-sections"])
def test_exact_steps_read_exact_with_biases_before_batch_norm(trainer, sections):
    net = Network.from_keras(biased_before_batch_norm(), xent, inputs="image")
    report = compare_with_whole(trainer(net, keras.optimizers.Adam(1e-3), sections=sections), batch())
    assert report["exact"], report
    assert report["gradient_rel_error"] <= report["tolerance"] and report["tolerance"] <= 1e-3, report


def test_a_wrong_step_reads_not_exact_and_the_runner_says_so(caplog):
    from runner.run.train import verify_exact

    net = Network.from_keras(biased_before_batch_norm(), xent, inputs="image")
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections=["r1", "bn2"],
                    policy=["recompute", ScaledInputGradient(), "recompute"])
    with caplog.at_level(logging.INFO):
        result = verify_exact(engine, batch(), examples=32)
    assert result["exact"] is False
    assert result["exact_gradient_rel_error"] > result["exact_tolerance"], result
    assert "DIFFERS FROM a whole-graph step" in caplog.text


def test_the_tolerance_follows_the_models_own_rounding_sensitivity():
    """The same wrong hand-over on a model whose step amplifies rounding: the sensitivity is measured, not assumed,
    and the report names it."""
    net = Network.from_keras(biased_before_batch_norm(), xent, inputs="image")
    report = compare_with_whole(Engine(net, keras.optimizers.SGD(0.1), sections=2), batch(8))
    assert 0 < report["sensitivity"] < 1e-3
    assert report["tolerance"] == pytest.approx(max(1e-4, 3.0 * report["sensitivity"]))
