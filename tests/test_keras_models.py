"""The runner's Keras models: keras.applications by name (model=keras_app) and saved files (model=keras_file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from models.keras_app import application_names, build_keras_app, build_keras_file
from sections import Engine

ROOT = Path(__file__).resolve().parents[1]


class Scale(keras.layers.Layer):
    """A layer Keras does not know: a saved file using it needs custom_objects."""

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="gain")

    def call(self, x):
        return x * self.gain


def small_model(classes=10, softmax=False):
    L = keras.layers
    x = keras.Input((8, 8, 3), name="image")
    h = L.Conv2D(4, 3, padding="same", name="conv")(x)
    h = Scale(name="scale")(L.BatchNormalization(name="bn")(h))
    h = L.Concatenate(name="concat")([L.ReLU(name="relu")(h), x])
    h = L.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, L.Dense(classes, activation="softmax" if softmax else None, name="logits")(h))


def batch(shape=(8, 8, 3), n=4):
    rng = np.random.default_rng(0)
    return {"image": tf.constant(rng.uniform(size=(n, *shape)), tf.float32),
            "label": tf.constant(rng.integers(0, 10, n), tf.int32)}


def test_application_names_are_keras_constructors():
    names = application_names()
    assert {"ResNet50V2", "MobileNetV2", "DenseNet121", "EfficientNetB0"} <= set(names)
    assert all(callable(getattr(keras.applications, n)) for n in names)


def test_unknown_application_lists_the_allowed_names():
    with pytest.raises(ValueError, match=r"name='ResNet51' is not a keras.applications model; allowed: .*ResNet50V2"):
        build_keras_app("ResNet51", input_shape=[32, 32, 3])


def test_application_resizes_the_datas_images_to_its_input_shape():
    net = build_keras_app("MobileNetV2", num_classes=5, input_shape=[32, 32, 3],
                          data_args={"input_shape": (28, 28, 1)})
    assert net.block_names[0] == "resize" and "block_2_add" in net.boundaries
    out = net.forward(batch((28, 28, 1), n=2), training=False)
    assert out.shape == (2, 5)


def test_application_cannot_turn_three_channels_into_one():
    with pytest.raises(ValueError, match=r"only one-channel images are converted"):
        build_keras_app("MobileNetV2", input_shape=[32, 32, 1], data_args={"input_shape": (32, 32, 3)})


def test_application_too_small_for_keras_says_what_to_set():
    with pytest.raises(ValueError, match=r"cannot be built for input_shape=\[16, 16, 3\].*input_shape sets the size"):
        build_keras_app("ResNet50V2", input_shape=[16, 16, 3])


def test_saved_file_trains_from_its_saved_weights_and_saves_again(tmp_path):
    model = small_model()
    model.save(tmp_path / "m.keras")
    net = build_keras_file(str(tmp_path / "m.keras"), custom_objects=["test_keras_models.Scale"], num_classes=10,
                           input_shape=(8, 8, 3))
    assert list(net.boundaries) == ["conv", "bn", "scale", "relu", "concat", "pool"]
    saved = {v.path: v.numpy() for v in model.weights}
    layer_weights = {v.path: v.numpy() for v in net.variables if v.path in saved}
    assert layer_weights.keys() == saved.keys()
    for path, value in layer_weights.items():
        np.testing.assert_array_equal(value, saved[path])
    engine = Engine(net, keras.optimizers.SGD(0.1), sections=["bn", "concat"])
    engine.train_step(batch())
    assert engine.sections[1].block_names == ["scale", "relu", "concat"]


def test_saved_file_logits_or_probabilities(tmp_path):
    small_model(softmax=True).save(tmp_path / "p.keras")
    small_model(softmax=False).save(tmp_path / "l.keras")
    objects = ["test_keras_models.Scale"]
    b = batch()
    probs = build_keras_file(str(tmp_path / "p.keras"), objects)
    logits = build_keras_file(str(tmp_path / "l.keras"), objects)
    # Both losses are the cross-entropy of the model's class probabilities.
    for net in (probs, logits):
        out = net.forward(b, training=False)
        p = out if net is probs else tf.nn.softmax(out)
        expected = -np.mean(np.log(np.take_along_axis(p.numpy(), b["label"].numpy()[:, None], 1)))
        np.testing.assert_allclose(float(net.loss(out, b)), expected, rtol=1e-5)


@pytest.mark.parametrize("kwargs,message", [
    ({"path": "nope.keras"}, r"path='nope.keras': no such file"),
    ({"custom_objects": ["mypkg.Nope"]}, r"custom_objects: cannot import 'mypkg.Nope'"),
    ({"custom_objects": []}, r"Keras cannot load it: it uses 'Scale', which Keras does not know; give the import paths"),
    ({"num_classes": 3}, r"outputs 10 classes but the data has 3"),
    ({"input_shape": (28, 28, 1)}, r"input shape is \[8, 8, 3\] but the data's examples are \[28, 28, 1\]"),
])
def test_saved_file_bad_input(tmp_path, kwargs, message):
    small_model().save(tmp_path / "m.keras")
    args = {"path": str(tmp_path / "m.keras"), "custom_objects": ["test_keras_models.Scale"], **kwargs}
    with pytest.raises(ValueError, match=message):
        build_keras_file(**args)


def run(*args, timeout=300, env=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


SMOKE = ["data=synthetic", "data.image_shape=[8,8,3]", "data.train_size=64", "data.test_size=16", "batch=8",
         "train=smoke"]

@pytest.mark.slow  # ~8 s; from_keras cuts by name are tested in process

def test_runner_trains_a_saved_file_at_its_layer_names(tmp_path):
    small_model().save(tmp_path / "m.keras")
    proc = run("model=keras_file", f"model.path={tmp_path / 'm.keras'}", "model.custom_objects=[test_keras_models.Scale]",
               "sections=[bn,concat]", *SMOKE, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact          yes" in proc.stdout + proc.stderr

@pytest.mark.slow  # ~7 s; the nearest-cut message is tested in process (test_from_keras)

def test_runner_names_the_nearest_cuts_for_an_impossible_one(tmp_path):
    small_model().save(tmp_path / "m.keras")
    proc = run("model=keras_file", f"model.path={tmp_path / 'm.keras'}", "model.custom_objects=[test_keras_models.Scale]",
               "sections=[relu,nope]", *SMOKE, f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "'nope'" in lines[0] and "Allowed cut layers: ['conv', 'bn'" in lines[0], proc.stderr

@pytest.mark.slow  # ~8 s; --help is tested fast in test_runner_config

def test_help_lists_the_cut_names_of_the_chosen_model_and_caches_them(tmp_path):
    small_model().save(tmp_path / "m.keras")
    args = ("model=keras_file", f"model.path={tmp_path / 'm.keras'}", "model.custom_objects=[test_keras_models.Scale]",
            "data=synthetic", "data.image_shape=[8,8,3]", "--help")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    proc = run(*args, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== Config groups" in proc.stdout  # Hydra's own help is still there
    section = proc.stdout[proc.stdout.index("== Cut names of"):].splitlines()
    assert section[1:3] == ["6 allowed (sections=<int> and sections=auto choose among them too):",
                            "  conv, bn, scale, relu, concat, pool"], section
    assert len(list((tmp_path / "cache").glob("sectionflow/cut_names/*.json"))) == 1
    again = run(*args, env=env)
    assert again.stdout[again.stdout.index("== Cut names of"):].splitlines() == section

@pytest.mark.slow  # ~6 s

def test_help_never_downloads_and_does_not_cache_a_data_failure(tmp_path):
    proc = run("model=keras_app", "model.name=MobileNetV2", "data=mnist", f"data.path={tmp_path / 'none.npz'}", "--help",
               env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot build the model as configured: data._target_=models.data.mnist" in proc.stdout
    assert "downloads are off" in proc.stdout and not (tmp_path / "none.npz").exists()
    assert not list(tmp_path.glob("cache/sectionflow/cut_names/*.json"))


def test_help_for_other_models_has_no_cut_names_section(tmp_path):
    proc = run("model=mlp", "--help", env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert proc.returncode == 0 and "== Config groups" in proc.stdout and "Cut names" not in proc.stdout
    assert not (tmp_path / "cache").exists()


def test_help_names_the_shape_it_listed_for_when_the_configured_one_cannot_be_built():
    from omegaconf import OmegaConf

    from runner.help import format_names

    text = format_names({"model": "m (M)", "boundaries": ["a", "b"], "cut_points": ["a", "x", "b"], "max_blocks": 3})
    assert text.splitlines() == [
        "== Cut names of m (M) (sections=[name, ...] ends a section with that layer) ==",
        "2 allowed (sections=<int> and sections=auto choose among them too):", "  a, b",
        "1 more cut points, merged into those blocks to keep at most 3 (model.keep=[name] makes one allowed; a "
        "larger model.max_blocks keeps more):", "  x"]


@pytest.mark.slow
def test_help_for_an_application_on_data_it_cannot_take_lists_names_at_a_size_it_can(tmp_path):
    proc = run("model=keras_app", "model.name=MobileNetV2", "--help", env={"XDG_CACHE_HOME": str(tmp_path / "c")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    section = proc.stdout[proc.stdout.index("== Cut names of"):]
    assert "block_3_expand" in section and "resize" in section and "repeat_channels" in section
    assert "listed for model.input_shape=[224, 224, 3], set a size it accepts" in section


@pytest.mark.slow
def test_runner_trains_a_keras_application_resized_from_the_data(tmp_path):
    proc = run("model=keras_app", "model.name=MobileNetV2", "model.input_shape=[32,32,3]", "data=synthetic",
               "data.train_size=64", "data.test_size=16", "batch=8", "train=smoke", "sections=[block_3_expand]",
               "model.keep=[block_3_expand]",  # keep names a cut point whether or not max_blocks keeps it
               f"hydra.run.dir={tmp_path / 'run'}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact          yes" in proc.stdout + proc.stderr
