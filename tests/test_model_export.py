"""model.keras in the run folder: the trained network as a Keras model that `keras.models.load_model` reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import keras
import numpy as np
import pytest
import tensorflow as tf

import models  # noqa: F401 - registers the project's layers, as a user's script would
from models.mlp import build_mlp
from models.resnet import build_resnet
from runner.errors import ConfigError
from runner.run.export import ModelFiles
from sections import Network, to_keras


def batch_of(shape, n=4, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.normal(size=(n, *shape)), tf.float32), "label": tf.constant(np.arange(n) % 3)}


@pytest.mark.parametrize("build", [lambda: build_mlp(num_classes=3, input_shape=(6, 5, 1), hidden=[8]),
                                   lambda: build_resnet(num_classes=3, input_shape=(8, 8, 3), widths=(4, 8),
                                                        depths=(1, 1))], ids=["mlp", "resnet"])
def test_an_own_network_saves_and_loads_with_the_same_predictions(build, tmp_path):
    network = build()
    shape = (6, 5, 1) if len(network.blocks) < 4 else (8, 8, 3)
    batch = batch_of(shape)
    network.build(batch)
    for v in network.trainable_variables:  # weights that are not their initial values
        v.assign(v + tf.cast(0.01 * tf.random.stateless_normal(v.shape, [1, 2]), v.dtype))
    to_keras(network, batch).save(tmp_path / "m.keras")
    keras.backend.clear_session()  # the loaded model is built from the file and the registered classes alone
    loaded = keras.models.load_model(tmp_path / "m.keras")
    want = network.forward(batch, training=False).numpy()
    np.testing.assert_allclose(loaded.predict(batch["image"], verbose=0), want, rtol=1e-5, atol=1e-6)


def test_a_network_cut_from_keras_gives_its_own_model_back():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"), keras.layers.Dense(2, name="b")])
    network = Network.from_keras(model, loss=lambda out, batch: tf.reduce_mean(out), inputs="image")
    assert to_keras(network, {"image": tf.zeros([1, 4])}) is model


def test_a_network_reading_batch_fields_is_refused_in_one_line():
    network = Network([("a", keras.layers.Dense(2)), ("b", keras.layers.Dense(2), ("mask",))],
                      loss=lambda out, batch: tf.reduce_mean(out), inputs="image")
    with pytest.raises(ValueError, match=r"blocks \['b'\] read batch fields"):
        to_keras(network, {"image": tf.zeros([1, 3]), "mask": tf.zeros([1, 2])})


def fake(tmp_path, mode=True):
    network = build_mlp(num_classes=3, input_shape=(6, 5, 1), hidden=[8])
    batch = batch_of((6, 5, 1))
    network.build(batch)
    data = SimpleNamespace(metric="accuracy", metric_direction="maximize")
    return ModelFiles(tmp_path, SimpleNamespace(network=network), data, batch, mode)


def test_the_best_model_follows_the_eval_metric_and_survives_a_resume(tmp_path):
    files = fake(tmp_path)
    files.evaluated(2, {"loss": 1.0, "accuracy": 0.5})
    first = (tmp_path / "model.best.keras").stat().st_mtime_ns
    files.evaluated(4, {"loss": 0.9, "accuracy": 0.4})  # worse accuracy: kept
    assert (tmp_path / "model.best.keras").stat().st_mtime_ns == first
    assert json.loads((tmp_path / "model.best.json").read_text()) == {"metric": "accuracy", "value": 0.5, "step": 2}
    resumed = fake(tmp_path)  # a resumed run reads the best so far
    resumed.evaluated(6, {"loss": 0.8, "accuracy": 0.45})
    assert json.loads((tmp_path / "model.best.json").read_text())["step"] == 2
    resumed.evaluated(8, {"loss": 0.7, "accuracy": 0.75})
    assert json.loads((tmp_path / "model.best.json").read_text())["step"] == 8
    resumed.final(8)
    assert keras.models.load_model(tmp_path / "model.keras").output_shape == (None, 3)
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name]


def test_save_model_modes(tmp_path):
    files = fake(tmp_path / "final", mode="final")
    (tmp_path / "final").mkdir()
    files.evaluated(2, {"loss": 1.0, "accuracy": 0.5})
    files.final(2)
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == ["model.keras"]
    off = fake(tmp_path, mode=False)
    off.evaluated(2, {"loss": 1.0, "accuracy": 0.5})
    off.final(2)
    assert not list(tmp_path.glob("model*"))
    with pytest.raises(ConfigError, match=r"train.save_model=always: allowed: true"):
        fake(tmp_path, mode="always")
