"""data=tfds: a TensorFlow Datasets data set prepared on this machine (never downloaded from the internet here)."""

from __future__ import annotations

import functools
import http.server
import json
import threading
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from models import data
from test_data_sources import CHEAP, runner, tags

CLASSES = ["ant", "bee", "cow"]


def tagged_images(n: int, offset: int = 0, size=(8, 6)) -> dict:
    """n images whose pixel (0, 0) is (class, index, 7), so a batch says which examples it holds."""
    rng = np.random.default_rng(offset)
    images = rng.integers(0, 256, (n, *size, 3), dtype=np.uint8)
    labels = np.arange(n) % len(CLASSES)
    images[:, 0, 0] = np.stack([labels, np.arange(n) + offset, np.full(n, 7)], axis=1)
    return {"image": images, "label": labels}


def features(size=(8, 6)):
    return tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(*size, 3)),
                                       "label": tfds.features.ClassLabel(names=CLASSES)})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """A data set named tiny_tagged in a local data_dir: 30 training and 9 test examples."""
    data_dir = tmp_path_factory.mktemp("tfds")
    tfds.dataset_builders.store_as_tfds_dataset(
        name="tiny_tagged", version="1.0.0", features=features(), data_dir=str(data_dir),
        split_datasets={"train": tf.data.Dataset.from_tensor_slices(tagged_images(30)),
                        "test": tf.data.Dataset.from_tensor_slices(tagged_images(9, offset=100))})
    return str(data_dir)


def test_tfds_streams_each_example_once_per_epoch_with_split_slices(prepared):
    source = data.tfds(name="tiny_tagged", data_dir=prepared, shuffle_buffer=4)
    assert source.model_args == {"num_classes": 3, "input_shape": (8, 6, 3)} and source.class_names == CLASSES
    assert (source.train_size, source.test_size) == (30, 9) and source.info["class_names"] == CLASSES
    epoch = next(iter(source.train_batches(30, seed=2)))
    assert sorted(i for _, i in tags(epoch["image"])) == list(range(30))
    assert [k for k, i in tags(epoch["image"])] == list(epoch["label"].numpy())  # labels travel with images
    order = [i for _, i in tags(epoch["image"])]
    assert order != sorted(order)  # shuffled
    again = next(iter(data.tfds(name="tiny_tagged", data_dir=prepared, shuffle_buffer=4).train_batches(30, 2)))
    assert np.array_equal(again["image"], epoch["image"])  # the same seed, the same batches
    head = data.tfds(name="tiny_tagged", data_dir=prepared, train_split="train[:40%]", test_split="train[40%:]")
    assert (head.train_size, head.test_size) == (12, 18)
    first = next(iter(head.train_batches(12, seed=0)))
    held = [i for b in head.eval_batches(5) for _, i in tags(b["image"])]
    reference = tfds.builder("tiny_tagged", data_dir=prepared)  # TFDS's own reader of the same slices
    for got, split in ((sorted(i for _, i in tags(first["image"])), "train[:40%]"), (held, "train[40%:]")):
        want = [int(x["image"][0, 0, 1]) for x in reference.as_dataset(split=split, shuffle_files=False)]
        assert got == (sorted(want) if split == "train[:40%]" else want)  # the test split in TFDS's order
    assert sorted(held + [i for _, i in tags(first["image"])]) == list(range(30))


def test_tfds_iterator_resumes_exactly(prepared, tmp_path):
    source = data.tfds(name="tiny_tagged", data_dir=prepared, shuffle_buffer=5, augment=["flip", "translate:1"])
    iterator = iter(source.train_batches(4, seed=1))
    for _ in range(5):  # into the second epoch
        next(iterator)
    prefix = tf.train.Checkpoint(data=iterator).save(str(tmp_path / "ckpt" / "it"))
    expected = [next(iterator) for _ in range(6)]
    resumed = iter(source.train_batches(4, seed=1))
    tf.train.Checkpoint(data=resumed).restore(prefix).assert_consumed()
    for want in expected:
        got = next(resumed)
        assert np.array_equal(got["image"], want["image"]) and np.array_equal(got["label"], want["label"])


def test_tfds_bad_inputs_are_one_line(prepared, tmp_path):
    cases = [
        (dict(name="tiny_tagge"), "no TFDS data set of that name"),
        (dict(name="tiny_tagged", test_split="validation"), "data.test_split='validation'"),
        (dict(name="tiny_tagged", image_key="img"), "has no feature 'img'; it has: image, label"),
        (dict(name="tiny_tagged", label_key="image"), "data.label_key='image'"),
        (dict(name="tiny_tagged", train_split="train[30:]"), "selects no examples"),
        (dict(name=""), "give a TensorFlow Datasets name"),
        (dict(name="tiny_tagged:2.0.0"), "data.name='tiny_tagged:2.0.0': no version 2.0.0 of 'tiny_tagged'; "
                                         "available: 1.0.0."),
    ]
    for kwargs, expected in cases:
        with pytest.raises(ValueError) as err:
            data.tfds(data_dir=prepared, **kwargs)
        assert expected in str(err.value) and "\n" not in str(err.value), (kwargs, str(err.value))
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError) as err:  # a registered data set that is not prepared: no download
        data.tfds(name="mnist", data_dir=str(empty))
    assert "not prepared in" in str(err.value) and "data.download=true" in str(err.value)
    assert "tfds build mnist" in str(err.value) and not empty.exists()


def test_a_tfds_shard_cut_short_is_refused_naming_it_or_read_to_its_last_whole_record(prepared, tmp_path):
    import shutil

    copy = tmp_path / "tfds"
    shutil.copytree(prepared, copy)
    shard = next((copy / "tiny_tagged" / "1.0.0").glob("tiny_tagged-train.tfrecord-*"))
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size * 2 // 3])
    with pytest.raises(ValueError) as err:
        data.tfds(name="tiny_tagged", data_dir=str(copy))
    assert f"shard {shard} holds 20 whole records, the data set's info says 30 (cut short)" in str(err.value)
    assert "\n" not in str(err.value)
    source = data.tfds(name="tiny_tagged", data_dir=str(copy), skip_corrupt=True)
    assert (source.train_size, source.test_size, source.info["skipped_corrupt"]) == (20, 9, 1)
    assert sum(len(b["label"]) for b in source.eval_batches(4)) == 9
    assert source.fingerprint()["tfds"] == "tiny_tagged 1.0.0" and source.fingerprint()["classes"]["cow"] == 2


class SfLocalTiny(tfds.core.GeneratorBasedBuilder):
    """A builder that downloads an .npz from `url` (a server on 127.0.0.1 in these tests)."""

    VERSION = tfds.core.Version("1.0.0")
    url = ""

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=features(size=(5, 4)),
                                     supervised_keys=("image", "label"))

    def _split_generators(self, dl_manager):
        path = dl_manager.download(type(self).url)
        return {"train": self._generate_examples(path, 0, 12), "test": self._generate_examples(path, 12, 16)}

    def _generate_examples(self, path, start, stop):
        arrays = np.load(path)
        for i in range(start, stop):
            yield i, {"image": arrays["x"][i], "label": int(arrays["y"][i])}


@pytest.fixture
def server(tmp_path):
    files = tmp_path / "served"
    files.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(files))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield files, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_download_prepares_from_a_local_server_and_a_failure_is_one_line_leaving_nothing(server, tmp_path):
    files, url = server
    rng = np.random.default_rng(0)
    np.savez(files / "tiny.npz", x=rng.integers(0, 256, (16, 5, 4, 3), dtype=np.uint8), y=np.arange(16) % 3)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "keep.txt").write_text("a user's file")
    SfLocalTiny.url = f"{url}/missing.npz"  # the server answers 404
    with pytest.raises(FileNotFoundError) as err:
        data.tfds(name="sf_local_tiny", data_dir=str(data_dir), download=True)
    line = str(err.value)
    assert "\n" not in line and "downloading and preparing it in" in line and "tfds build sf_local_tiny" in line
    assert sorted(p.name for p in data_dir.iterdir()) == ["keep.txt"]  # no partial download, no empty folders
    SfLocalTiny.url = f"{url}/tiny.npz"
    source = data.tfds(name="sf_local_tiny", data_dir=str(data_dir), download=True)
    assert (source.train_size, source.test_size) == (12, 4) and source.image_shape == (5, 4, 3)
    assert (data_dir / "sf_local_tiny" / "1.0.0" / "dataset_info.json").is_file()
    again = data.tfds(name="sf_local_tiny", data_dir=str(data_dir))  # prepared: no download needed
    assert again.train_size == 12


@pytest.mark.slow  # ~15 s: one short run
def test_tfds_trains_a_keras_file_model_through_the_runner_and_leaves_model_keras(prepared, tmp_path):
    import keras

    model = keras.Sequential([keras.Input((8, 6, 3)), keras.layers.Flatten(), keras.layers.Dense(3)])
    model.save(tmp_path / "mine.keras")
    out = tmp_path / "run"
    proc = runner("data=tfds", "data.name=tiny_tagged", f"data.data_dir={prepared}", "model=keras_file",
                  f"model.path={tmp_path / 'mine.keras'}", *CHEAP[2:], f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tfds: 30 train / 9 test, images [8, 6, 3], 3 classes, rescale 1/255" in proc.stdout + proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"]["class_names"] == CLASSES
    trained = keras.models.load_model(out / "model.keras")
    source = data.tfds(name="tiny_tagged", data_dir=prepared)
    hits = sum(int(np.sum(np.argmax(trained.predict(b["image"], verbose=0), -1) == b["label"].numpy()))
               for b in source.eval_batches(9))
    assert hits / 9 == pytest.approx(metrics["accuracy"])  # the final weights give the final evaluation
    assert (out / "model.best.keras").is_file() and json.loads((out / "model.best.json").read_text())["step"] >= 2
