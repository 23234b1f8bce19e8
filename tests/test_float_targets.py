"""Float (regression) targets: arrays, TFRecord shards and TFDS data sets whose labels are values, not classes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf

from models import data
from models.keras_app import build_keras_file
from models.mlp import build_mlp
from test_data_sources import CHEAP, runner


def write_float_shards(folder, n=12, target_size=2):
    """PNG images whose targets are known functions of their pixels: (mean red / 255, index / n)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    targets = []
    with tf.io.TFRecordWriter(str(folder / "part-0.tfrecord")) as writer:
        for i in range(n):
            image = rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)
            target = [float(image[..., 0].mean() / 255), i / n][:target_size]
            targets.append(target)
            feature = {"img": tf.train.Feature(bytes_list=tf.train.BytesList(value=[tf.io.encode_png(image).numpy()])),
                       "y": tf.train.Feature(float_list=tf.train.FloatList(value=target))}
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(folder / "part-*.tfrecord"), np.array(targets, np.float32)


def test_tfrecord_float_targets_reach_the_batch_and_the_model_regresses_them(tmp_path):
    files, targets = write_float_shards(tmp_path / "s")
    source = data.tfrecord(files, files, image_key="img", label_key="y", label_format="float", target_shape=[2],
                           shuffle_buffer=1)
    assert source.model_args == {"num_classes": 2, "input_shape": (6, 5, 3), "targets": "float"}
    assert (source.metric, source.metric_direction) == ("mae", "minimize")
    assert "float targets [2]" in source.describe()
    batch = next(iter(source.eval_batches(12)))
    assert batch["label"].dtype == tf.float32
    np.testing.assert_allclose(batch["label"], targets, rtol=1e-6)  # read in file order
    network = build_mlp(**source.model_args, hidden=[4])
    network.build(batch)
    outputs = network.forward(batch, training=False).numpy()
    want = float(np.mean((outputs - targets) ** 2))  # the reference: plain NumPy on the same outputs
    assert float(network.loss(outputs, batch)) == pytest.approx(want, rel=1e-5)
    assert float(network.metrics["mae"](outputs, batch)) == pytest.approx(float(np.mean(np.abs(outputs - targets))),
                                                                          rel=1e-5)


def test_float_target_mistakes_are_one_line(tmp_path):
    files, _ = write_float_shards(tmp_path / "s")
    cases = [(dict(label_format="floats"), "data.label_format='floats': allowed: class, float"),
             (dict(label_format="float", target_shape=[3]), "holds 2 value(s); expected 3 (data.target_shape)"),
             (dict(label_format="float", target_shape=[0]), "data.target_shape=[0]"),
             (dict(num_classes=3), "it is a float_list, expected int64_list (int64 class numbers; for float targets "
                                   "set data.label_format=float)")]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as err:
            data.tfrecord(files, files, image_key="img", label_key="y", **kwargs)
        assert message in str(err.value), str(err.value)


def test_arrays_with_float_labels_are_targets(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "r.npz", x=rng.integers(0, 256, (20, 4, 4), dtype=np.uint8),
             y=rng.normal(size=(20, 3)).astype(np.float32))
    source = data.arrays(str(tmp_path / "r.npz"), test_fraction=0.25)
    assert source.model_args["targets"] == "float" and source.model_args["num_classes"] == 3
    assert next(iter(source.train_batches(4, 0)))["label"].shape == (4, 3)
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 4, 4)), y=np.array([0.5, np.nan, 1, 2]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        data.arrays(str(tmp_path / "bad.npz"))


def test_classification_only_models_and_apps_say_so(tmp_path):
    import keras

    keras.Sequential([keras.Input((6, 5, 3)), keras.layers.Flatten(), keras.layers.Dense(4)]).save(tmp_path / "m.keras")
    with pytest.raises(ValueError, match="outputs 4 values per example but the data has 2"):
        build_keras_file(str(tmp_path / "m.keras"), num_classes=2, input_shape=(6, 5, 3), targets="float")
    with pytest.raises(ValueError, match="targets='floats': allowed: class, float"):
        build_mlp(num_classes=2, targets="floats")


@pytest.mark.slow  # ~15 s: one short run
def test_float_targets_train_a_keras_file_model_through_the_runner(tmp_path):
    import keras

    files, _ = write_float_shards(tmp_path / "s")
    keras.Sequential([keras.Input((6, 5, 3)), keras.layers.Flatten(), keras.layers.Dense(2)]).save(tmp_path / "m.keras")
    out = tmp_path / "run"
    proc = runner("data=tfrecord", f"data.train_files={files}", f"data.test_files={files}", "data.image_key=img",
                  "data.label_key=y", "data.label_format=float", "data.target_shape=[2]", "model=keras_file",
                  f"model.path={tmp_path / 'm.keras'}", *CHEAP[2:], f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["metric"] == "mae" and metrics["mae"] >= 0
    assert json.loads((out / "model.best.json").read_text())["metric"] == "mae"
