"""Your own data: image folders, arrays and TFRecord shards, streamed; their guarantees and their one-line errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from models import data
from runner.run import datafeed

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
CHEAP = ["model=mlp", "model.hidden=[16]", "batch=8", "train=smoke", "train.verify_exact=false",
         "train.progress=log"]


def runner(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def write_folder(root: Path, classes=("cat", "dog", "emu"), per_class=6, size=(12, 10), seed=0) -> Path:
    """A folder of PNGs whose pixels encode (class, index), so a batch says which files it holds."""
    rng = np.random.default_rng(seed)
    for k, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
            image[0, 0] = (k, i, 7)
            tf.io.write_file(str(root / name / f"{i:03d}.png"), tf.io.encode_png(image))
    return root


def tags(images) -> list[tuple[int, int]]:
    """The (class, index) tag of each image, in order (pixel (0, 0) of the images scaled by 1/255)."""
    px = np.round(np.asarray(images)[:, 0, 0, :] * 255).astype(int)
    return [(int(p[0]), int(p[1])) for p in px if p[2] == 7]


def ids(batch) -> set[tuple[int, int]]:
    return set(tags(batch["image"]))


def equal_batches(a, b, n: int) -> bool:
    return all(np.array_equal(x["image"], y["image"]) and np.array_equal(x["label"], y["label"])
               for x, y in zip(a.take(n), b.take(n)))


# ---------------------------------------------------------------- image_folder
def test_image_folder_lists_classes_and_streams_deterministic_batches(tmp_path):
    source = data.image_folder(str(write_folder(tmp_path / "imgs")), augment=["flip", "translate:2", "contrast"])
    assert source.class_names == ["cat", "dog", "emu"] and source.model_args == {"num_classes": 3,
                                                                                 "input_shape": (12, 10, 3)}
    assert source.train_size + source.test_size == 18 and source.test_size == 4  # validation_split 0.2
    assert equal_batches(source.train_batches(8, 3), source.train_batches(8, 3), 4)
    assert not equal_batches(source.train_batches(8, 3), source.train_batches(8, 4), 1)
    plain = data.image_folder(str(tmp_path / "imgs"))
    first = next(iter(plain.train_batches(7, 0)))
    assert first["image"].dtype == tf.float32 and 0 <= float(tf.reduce_min(first["image"]))
    assert float(tf.reduce_max(first["image"])) <= 1.0  # rescale 1/255 by default
    epoch = [next(iter(plain.train_batches(plain.train_size, 0)))]
    assert len(ids(epoch[0])) == plain.train_size  # one epoch: every training file once
    evaluated = [b["label"].numpy() for b in plain.eval_batches(3)]
    assert sum(len(b) for b in evaluated) == plain.test_size
    assert [list(b) for b in evaluated] == [list(b["label"].numpy()) for b in plain.eval_batches(3)]


def test_image_folder_options_resize_grayscale_rescale_and_test_folder(tmp_path):
    write_folder(tmp_path / "train")
    write_folder(tmp_path / "test", classes=("dog", "emu"), per_class=2)
    source = data.image_folder(str(tmp_path / "train"), test_path=str(tmp_path / "test"), image_size=[6, 5],
                               color_mode="grayscale", rescale=1)
    assert source.model_args["input_shape"] == (6, 5, 1) and source.train_size == 18 and source.test_size == 4
    batch = next(iter(source.eval_batches(4)))
    assert batch["image"].shape == (4, 6, 5, 1) and list(batch["label"].numpy()) == [1, 1, 2, 2]
    assert float(tf.reduce_max(batch["image"])) > 1  # rescale=1: 0..255, for a model with its own Rescaling
    assert "rescale 1 (values 0..255)" in source.describe()


def test_two_workers_each_load_their_rows_and_together_every_example_once(tmp_path):
    source = data.image_folder(str(write_folder(tmp_path / "imgs", per_class=8)), validation_split=1 / 6)
    full = source.train_batches(8, 1)
    halves = [source.train_batches(8, 1, shard=(w, 2)) for w in range(2)]
    loaded = []
    for whole, a, b in zip(full.take(5), halves[0].take(5), halves[1].take(5)):
        assert np.array_equal(a["image"][:4], whole["image"][:4]) and np.array_equal(b["image"][4:], whole["image"][4:])
        assert not np.any(a["image"][4:]) and not np.any(b["image"][:4])  # the other worker's rows: not loaded
        loaded += tags(a["image"][:4]) + tags(b["image"][4:])
    assert source.train_size == 20 and len(loaded) == 40
    assert len(set(loaded[:20])) == 20 and len(set(loaded[20:])) == 20  # each example once per epoch


def test_the_iterator_checkpoint_is_small_and_resumes_exactly(tmp_path):
    source = data.image_folder(str(write_folder(tmp_path / "imgs")), augment=["flip", "translate:0.2", "crop",
                                                                             "brightness", "flip_vertical"])
    iterator = iter(source.train_batches(8, 5))
    for _ in range(3):
        next(iterator)
    prefix = tf.train.Checkpoint(data=iterator).save(str(tmp_path / "ckpt" / "it"))
    expected = [next(iterator) for _ in range(4)]
    resumed = iter(source.train_batches(8, 5))
    tf.train.Checkpoint(data=resumed).restore(prefix).assert_consumed()
    for want in expected:
        got = next(resumed)
        assert np.array_equal(got["image"], want["image"]) and np.array_equal(got["label"], want["label"])
    size = sum(p.stat().st_size for p in (tmp_path / "ckpt").iterdir())
    assert size < 64 * 1024  # counters, not buffered batches (a batch alone is 11 KiB here)


# ---------------------------------------------------------------- arrays
def test_arrays_npz_with_own_keys_is_memory_mapped_and_split(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (30, 6, 5), dtype=np.uint8), np.arange(30) % 4
    np.savez(tmp_path / "mine.npz", pixels=x, classes=y)
    source = data.arrays(str(tmp_path / "mine.npz"), x_key="pixels", y_key="classes", test_fraction=0.2)
    assert isinstance(source.reader.x["train"], np.memmap)
    assert source.model_args == {"num_classes": 4, "input_shape": (6, 5, 1)} and source.test_size == 6
    batch = next(iter(source.train_batches(24, 0)))
    rows = np.round(batch["image"].numpy()[..., 0] * 255).astype(np.uint8)
    matched = [int(np.flatnonzero((x == r).all(axis=(1, 2)))[0]) for r in rows]
    assert sorted(matched) == sorted(source.reader.rows["train"]) and list(y[matched]) == list(batch["label"])
    assert equal_batches(source.train_batches(5, 1), source.train_batches(5, 1), 3)
    np.savez_compressed(tmp_path / "packed.npz", pixels=x, classes=y)
    packed = data.arrays(str(tmp_path / "packed.npz"), x_key="pixels", y_key="classes", test_fraction=0.2)
    assert equal_batches(packed.train_batches(5, 1), source.train_batches(5, 1), 3)


def test_arrays_npy_pair_with_a_test_file(tmp_path):
    rng = np.random.default_rng(1)
    np.save(tmp_path / "x.npy", rng.normal(size=(12, 4, 4, 2)).astype(np.float32))
    np.save(tmp_path / "y.npy", np.arange(12) % 3)
    np.save(tmp_path / "xt.npy", rng.normal(size=(5, 4, 4, 2)).astype(np.float32))
    np.save(tmp_path / "yt.npy", np.arange(5) % 3)
    files = dict(labels_path=str(tmp_path / "y.npy"), test_path=str(tmp_path / "xt.npy"),
                 test_labels_path=str(tmp_path / "yt.npy"))
    with pytest.raises(ValueError, match=r"data.path: the images are float32 with values -2\.71129\.\.3\.10004; .*"
                                         r"give data.rescale"):
        data.arrays(str(tmp_path / "x.npy"), **files)  # standardized floats: fed as they are only when asked
    source = data.arrays(str(tmp_path / "x.npy"), rescale=1, **files)
    assert source.rescale == 1.0 and source.train_size == 12 and source.test_size == 5
    batch = next(iter(source.eval_batches(5)))
    assert np.allclose(batch["image"], np.load(tmp_path / "xt.npy"))


@pytest.mark.parametrize("images, rescale, top", [
    (np.full((6, 4, 4), 65535, np.uint16), 1 / 65535, 1.0),
    (np.full((6, 4, 4), 0.5, np.float64), 1.0, 1.0),
    (np.full((6, 4, 4), 200, np.uint8), 1 / 255, 1.0)])
def test_arrays_scale_by_their_dtype_and_the_header_says_what_the_model_receives(tmp_path, images, rescale, top):
    np.savez(tmp_path / "d.npz", x=images, y=np.arange(6) % 2)
    source = data.arrays(str(tmp_path / "d.npz"), test_fraction=0.5)
    assert source.rescale == pytest.approx(rescale) and f"values 0..{top:g})" in source.describe()
    batch = next(iter(source.train_batches(3, 0)))
    assert float(np.max(batch["image"])) <= top


def test_arrays_in_0_255_as_floats_and_non_finite_rows_are_refused_naming_them(tmp_path):
    np.savez(tmp_path / "f.npz", x=np.full((6, 4, 4), 255.0), y=np.arange(6) % 2)
    with pytest.raises(ValueError, match=r"float64 with values 255\.\.255; .*1/255 for values in 0\.\.255"):
        data.arrays(str(tmp_path / "f.npz"))
    assert data.arrays(str(tmp_path / "f.npz"), rescale="1/255").describe().count("values 0..1)") == 1
    x = np.zeros((6, 4, 4), np.float32)
    x[4, 1, 2] = np.nan
    np.savez(tmp_path / "n.npz", x=x, y=np.arange(6) % 2)
    with pytest.raises(ValueError, match="data.path: image row 4 holds nan"):
        data.arrays(str(tmp_path / "n.npz"))


# ---------------------------------------------------------------- tfrecord
def write_shards(folder: Path, shards=3, per_shard=5, raw=False, compression=None, size=(8, 6)) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    options = tf.io.TFRecordOptions(compression_type=compression or "")
    for s in range(shards):
        with tf.io.TFRecordWriter(str(folder / f"part-{s}.tfrecord"), options) as writer:
            for i in range(per_shard):
                image = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
                image[0, 0] = (s, i, 7)
                value = image.tobytes() if raw else tf.io.encode_png(image).numpy()
                feature = {"img": tf.train.Feature(bytes_list=tf.train.BytesList(value=[value])),
                           "cls": tf.train.Feature(int64_list=tf.train.Int64List(value=[(s + i) % 3]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(folder / "part-*.tfrecord")


@pytest.mark.parametrize("raw,compression", [(False, None), (True, "GZIP")])
def test_tfrecord_shards_interleave_every_record_once_per_epoch_and_resume(tmp_path, raw, compression):
    files = write_shards(tmp_path / "train", raw=raw, compression=compression)
    kwargs = dict(image_key="img", label_key="cls", num_classes=3, compression=compression, shuffle_buffer=4,
                  cycle_length=2, **({"image_format": "raw", "image_shape": [8, 6, 3]} if raw else {}))
    source = data.tfrecord(files, files, **kwargs)
    assert source.model_args == {"num_classes": 3, "input_shape": (8, 6, 3)}
    epoch = next(iter(source.train_batches(15, 2)))
    assert len(ids(epoch)) == 15  # every record of the three shards, once
    assert equal_batches(source.train_batches(4, 2), source.train_batches(4, 2), 5)
    assert not equal_batches(source.train_batches(4, 2), source.train_batches(4, 3), 2)
    iterator = iter(source.train_batches(4, 2))
    next(iterator), next(iterator)
    prefix = tf.train.Checkpoint(data=iterator).save(str(tmp_path / "ckpt" / "it"))
    expected = [next(iterator)["image"] for _ in range(5)]
    resumed = iter(source.train_batches(4, 2))
    tf.train.Checkpoint(data=resumed).restore(prefix)
    assert all(np.array_equal(next(resumed)["image"], want) for want in expected)
    assert sum(len(b["label"]) for b in source.eval_batches(4)) == 15


# ---------------------------------------------------------------- preprocessing options
def test_rescale_and_augment_are_checked():
    from models.data._stream import parse_augment, parse_rescale

    assert parse_rescale("1/255", 1) == pytest.approx(1 / 255) and parse_rescale(None, 0.5) == 0.5
    assert parse_augment(["flip", "translate:3", "crop:0.8"]) == [("flip", None), ("translate", 3.0), ("crop", 0.8)]
    for bad, match in ((0, "rescale=0"), ("x/2", "rescale=None"), ("-1", "rescale")):
        with pytest.raises(ValueError, match=match):
            parse_rescale(bad, 1)
    for bad, match in ((["spin"], "unknown augmentation 'spin'; allowed: flip"), (["flip:2"], "takes no strength"),
                       (["crop:2"], "up to 1"), ("flip", "must be a list")):
        with pytest.raises(ValueError, match=match):
            parse_augment(bad)



def test_standardize_applies_after_rescale_and_augmentation_to_both_splits(tmp_path):
    root = write_folder(tmp_path / "imgs")
    mean, std = [0.5, 0.25, 0.125], [0.5, 0.25, 2.0]
    plain, standard = data.image_folder(str(root)), data.image_folder(str(root), mean=mean, std=std)
    for a, b in ((next(iter(plain.train_batches(6, 1))), next(iter(standard.train_batches(6, 1)))),
                 (next(iter(plain.eval_batches(4))), next(iter(standard.eval_batches(4))))):
        np.testing.assert_allclose(b["image"], (a["image"].numpy() - mean) / std, rtol=1e-6, atol=1e-6)
    assert standard.info["mean"] == mean and "then (x - mean [0.5, 0.25, 0.125]) / std" in standard.describe()
    for kwargs, match in ((dict(mean=[1, 2]), r"data.mean=\[1, 2\]: must be a number or a list of 3"),
                          (dict(std=0), "data.std=0: .* each > 0"), (dict(std=[1, 1, -1]), "data.std")):
        with pytest.raises(ValueError, match=match):
            data.image_folder(str(root), **kwargs)


# ---------------------------------------------------------------- bad input: one line naming the file or key
def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text and "delete" not in text and "pickled data" not in text and "allow_pickle" not in text
    return text


def pipeline_error(dataset, batches=20) -> str:
    with pytest.raises(datafeed.DataError) as err:
        for batch in datafeed.checked(dataset.take(batches)):
            pass
    return one_line(err)


def test_image_folder_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="no such folder") as err:
        data.image_folder(str(tmp_path / "nowhere"))
    assert str(tmp_path / "nowhere") in one_line(err)
    (tmp_path / "flat").mkdir()
    tf.io.write_file(str(tmp_path / "flat" / "a.png"), tf.io.encode_png(np.zeros((2, 2, 3), np.uint8)))
    with pytest.raises(ValueError, match="no class subfolders"):
        data.image_folder(str(tmp_path / "flat"))
    root = write_folder(tmp_path / "imgs", per_class=3)
    (root / "empty").mkdir()
    (root / "empty" / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match="empty' holds no images"):
        data.image_folder(str(root))
    (root / "empty" / "notes.txt").unlink()
    (root / "empty").rmdir()
    write_folder(tmp_path / "other", classes=("cat", "yak"), per_class=1)
    with pytest.raises(ValueError, match="class folder\\(s\\) yak are not training classes"):
        data.image_folder(str(root), test_path=str(tmp_path / "other"))


def test_a_corrupt_image_stops_naming_it_or_is_skipped_and_counted(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=4)
    good = (root / "dog" / "001.png").read_bytes()
    (root / "dog" / "001.png").write_bytes(good[: len(good) // 2])  # truncated
    (root / "emu" / "002.png").write_bytes(b"not an image at all")
    source = data.image_folder(str(root), validation_split=0.1)
    line = pipeline_error(source.train_batches(4, 0))
    assert line.startswith("data: ") and ("dog/001.png" in line or "emu/002.png" in line)
    assert "is not a complete JPEG, PNG, BMP or GIF file" in line and "data.skip_corrupt=true" in line
    skipping = data.image_folder(str(root), validation_split=0.1, skip_corrupt=True)
    assert skipping.info["skipped_corrupt"] == 2 and skipping.train_size + skipping.test_size == 10
    for _ in datafeed.checked(skipping.train_batches(5, 0).take(6)):
        pass


def test_mixed_sizes_without_image_size_name_the_file(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=2)
    tf.io.write_file(str(root / "emu" / "big.png"), tf.io.encode_png(np.zeros((20, 20, 3), np.uint8)))
    source = data.image_folder(str(root), validation_split=0.1)
    line = pipeline_error(source.train_batches(3, 0))
    assert "emu/big.png is 20x20 but the first image is 12x10; set data.image_size" in line
    resized = data.image_folder(str(root), validation_split=0.1, image_size=[12, 10])
    next(iter(resized.train_batches(7, 0)))


def test_tfrecord_spec_mismatches_name_the_feature(tmp_path):
    files = write_shards(tmp_path / "s", shards=1, per_shard=4)
    with pytest.raises(ValueError) as err:
        data.tfrecord(files, files, image_key="image", label_key="cls", num_classes=3)
    assert "data.image_key='image': the records of" in one_line(err) and "they have: cls (int64_list), img " \
                                                                        "(bytes_list)" in str(err.value)
    with pytest.raises(ValueError, match="data.label_key='img': in .* it is a bytes_list, expected int64_list"):
        data.tfrecord(files, files, image_key="img", label_key="img", num_classes=3)
    with pytest.raises(ValueError, match="holds .* bytes; data.image_shape=\\[4, 4, 3\\] of uint8 needs 48"):
        data.tfrecord(files, files, image_key="img", label_key="cls", num_classes=3, image_format="raw",
                      image_shape=[4, 4, 3])
    with pytest.raises(ValueError, match="data.num_classes=None: give the number of classes"):
        data.tfrecord(files, files, image_key="img", label_key="cls")
    gz = write_shards(tmp_path / "gz", shards=1, per_shard=2, compression="GZIP")
    with pytest.raises(ValueError) as err:
        data.tfrecord(gz, gz, image_key="img", label_key="cls", num_classes=3)
    assert "not a readable TFRecord file with data.compression=null" in one_line(err)
    assert one_line(err).endswith("it looks GZIP-compressed: set data.compression=GZIP.")  # whole, not cut mid-word
    with pytest.raises(ValueError) as err:
        data.tfrecord(files, files, image_key="img", label_key="cls", num_classes=3, compression="ZLIB")
    assert one_line(err).endswith("it does not look ZLIB-compressed: try data.compression=null.")
    np.save(tmp_path / "x.npy", np.zeros(3))
    with pytest.raises(ValueError, match="not a readable TFRecord file"):
        data.tfrecord(str(tmp_path / "x.npy"), files, image_key="img", label_key="cls", num_classes=3)
    too_few = data.tfrecord(files, files, image_key="img", label_key="cls", num_classes=2)
    line = pipeline_error(too_few.train_batches(4, 0))
    assert line.startswith("data: label 2 of a record (data.label_key='cls') is outside the class range 0..1")


def test_arrays_bad_inputs(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", images=rng.integers(0, 256, (10, 4, 4), dtype=np.uint8), labels=np.arange(10) % 2)
    with pytest.raises(ValueError) as err:
        data.arrays(str(tmp_path / "d.npz"))
    assert "has no array 'x' (data.x_key), 'y' (data.y_key); it has: images, labels" in one_line(err)
    with pytest.raises(ValueError, match="outside the class range 0..0 \\(data.num_classes\\)"):
        data.arrays(str(tmp_path / "d.npz"), x_key="images", y_key="labels", num_classes=1)
    np.savez(tmp_path / "test.npz", images=rng.integers(0, 256, (3, 4, 4), dtype=np.uint8), labels=np.array([0, 1, 5]))
    with pytest.raises(ValueError, match="test labels hold 5, outside the class range 0..1 .*absent from training"):
        data.arrays(str(tmp_path / "d.npz"), x_key="images", y_key="labels", test_path=str(tmp_path / "test.npz"))
    record = tmp_path / "shard.tfrecord"
    with tf.io.TFRecordWriter(str(record)) as writer:
        writer.write(b"a record")
    with pytest.raises(ValueError) as err:
        data.arrays(str(record))
    assert "is a TFRecord file, not an .npz or .npy file" in one_line(err)
    np.save(tmp_path / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "labels.npy", np.arange(1))
    with pytest.raises(ValueError, match="holds Python objects"):
        data.arrays(str(tmp_path / "objects.npy"), labels_path=str(tmp_path / "labels.npy"))


def test_a_user_file_given_to_mnist_gets_no_pickle_message_nor_advice_to_delete(tmp_path):
    record = tmp_path / "shard.tfrecord"
    with tf.io.TFRecordWriter(str(record)) as writer:
        writer.write(b"a record")
    with pytest.raises(ValueError) as err:
        data.mnist(path=str(record), download=False)
    assert "it is a TFRecord file" in one_line(err) and "data=tfrecord" in str(err.value)
    (tmp_path / "mine.npz").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ValueError) as err:
        data.mnist(path=str(tmp_path / "mine.npz"), download=False)
    assert "it is a Python pickle" in one_line(err)


def test_pipeline_errors_become_one_line():
    err = tf.errors.InvalidArgumentError(None, None, "{{function_node __wrapped__IteratorGetNext}} assertion "
                                         "failed: [data: /x/a.png is 5x5 but the first image is 4x4]\n\t [[{{node A}}]]")
    assert datafeed.message(err) == "data: /x/a.png is 5x5 but the first image is 4x4"
    err = tf.errors.InvalidArgumentError(None, None, "Input is empty. [Op:IteratorGetNext]")
    assert datafeed.message(err) == "data: reading the input failed: Input is empty."


# ---------------------------------------------------------------- through the runner
@pytest.mark.slow  # ~15 s: one short run
def test_image_folder_trains_a_keras_file_model_and_records_the_classes(tmp_path):
    import keras

    root = write_folder(tmp_path / "imgs", classes=("ant", "bee", "cow", "dog"), per_class=3)
    model = keras.Sequential([keras.Input((12, 10, 3)), keras.layers.Rescaling(1 / 255), keras.layers.Flatten(),
                              keras.layers.Dense(4)])
    model.save(tmp_path / "mine.keras")
    out = tmp_path / "run"
    proc = runner("data=image_folder", f"data.path={root}", "data.rescale=1", "data.augment=[flip]",
                  "model=keras_file", f"model.path={tmp_path / 'mine.keras'}", *CHEAP[2:], f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: image_folder: 10 train / 2 test, images [12, 10, 3], 4 classes, rescale 1 (values 0..255)" \
        in proc.stdout + proc.stderr
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data"]["class_names"] == ["ant", "bee", "cow", "dog"] and metrics["step"] == 4
    assert json.loads((out / "data.json").read_text())["class_names"] == ["ant", "bee", "cow", "dog"]


@pytest.mark.slow  # ~8 s: a runner start-up for one error line
def test_a_wrong_data_path_is_one_line_through_the_runner(tmp_path):
    proc = runner("data=image_folder", f"data.path={tmp_path / 'missing'}", *CHEAP)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert "no such folder" in line and str(tmp_path / "missing") in line


@pytest.mark.slow  # ~15-35 s: two short runs
def test_arrays_and_tfrecord_train_through_the_runner(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", my_x=rng.integers(0, 256, (40, 6, 6, 1), dtype=np.uint8), my_y=np.arange(40) % 5)
    proc = runner("data=arrays", f"data.path={tmp_path / 'd.npz'}", "data.x_key=my_x", "data.y_key=my_y", *CHEAP,
                  f"hydra.run.dir={tmp_path / 'a'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["data"]["num_classes"] == 5
    files = write_shards(tmp_path / "s", compression="GZIP")
    proc = runner("data=tfrecord", f"data.train_files={files}", f"data.test_files={files}", "data.compression=GZIP",
                  "data.image_key=img", "data.label_key=cls", "data.num_classes=3", *CHEAP,
                  f"hydra.run.dir={tmp_path / 't'}")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow  # ~20-50 s: kill -9 mid-run, resume, and the uninterrupted run
def test_image_folder_with_augmentation_resumes_bit_identically_after_kill(tmp_path):
    from tests.test_runner import events

    root = write_folder(tmp_path / "imgs", per_class=10)
    args = ["data=image_folder", f"data.path={root}", "data.augment=[flip,translate:2,contrast]", *CHEAP,
            "train.eval_every=0", "train.checkpoint_every=3", "train.log_every=1"]
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "runner", *args, "train.steps=100000", f"hydra.run.dir={killed}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if "step 8/" in line:
                break
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()
    saved = max(int(p.stem.split("-")[1]) for p in (killed / "checkpoints").glob("ckpt-*.index"))
    steps = saved + 4
    proc = runner(f"resume={killed}", f"train.steps={steps}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    whole = tmp_path / "whole"
    proc = runner(*args, f"train.steps={steps}", f"hydra.run.dir={whole}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed, reference = events(killed)[0]["loss/train"], events(whole)[0]["loss/train"]
    assert [s for s, _ in resumed] == list(range(1, steps + 1)) and resumed == reference


# ---------------------------------------------------------------- the contract's runnable example
def test_the_documented_example_source_follows_the_contract(tmp_path):
    from docs.examples.stripes import Stripes, stripes
    from runner.config.direction import direction_of

    source = stripes(size=8, test_size=10)
    assert isinstance(source, Stripes) and direction_of("docs.examples.stripes.stripes") == "maximize"
    assert source.model_args == {"num_classes": 4, "input_shape": (8, 8, 1)}
    assert equal_batches(source.train_batches(4, 1), source.train_batches(4, 1), 3)
    iterator = iter(source.train_batches(4, 1))
    next(iterator)
    prefix = tf.train.Checkpoint(data=iterator).save(str(tmp_path / "it"))
    want = next(iterator)["image"]
    again = iter(source.train_batches(4, 1))
    tf.train.Checkpoint(data=again).restore(prefix)
    assert np.array_equal(next(again)["image"], want)
    assert [len(b["label"]) for b in source.eval_batches(4)] == [4, 4, 2]


def test_an_own_config_folder_joins_through_the_search_path():
    from runner.app import CONF
    from runner.config.overrides import check_overrides
    from runner.errors import ConfigError

    own = f"hydra.searchpath=[file://{ROOT / 'docs' / 'examples' / 'conf'}]"
    check_overrides([own, "data=stripes", "data.size=12"], CONF)
    with pytest.raises(ConfigError, match="data.sise=12: unknown key \\(did you mean 'size'\\?\\)"):
        check_overrides([own, "data=stripes", "data.sise=12"], CONF)


@pytest.mark.slow  # ~10 s: one short run
def test_the_documented_example_trains_through_the_runner(tmp_path):
    proc = runner("hydra.searchpath=[file://docs/examples/conf]", "data=stripes", *CHEAP,
                  f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "data.json").read_text())["class_names"][0] == "0deg"


def test_worker_shard_follows_the_replica_ids_of_this_process():
    class Context:
        def __init__(self, r):
            self.replica_id_in_sync_group = r

    class FakeStrategy:  # worker 1 of 3, two replicas each: global replicas 2 and 3 of 6
        cluster_resolver, num_replicas_in_sync = object(), 6

        def experimental_distribute_values_from_function(self, fn):
            return [fn(Context(r)) for r in (2, 3)]

        def experimental_local_results(self, values):
            return values

    assert datafeed.worker_shard(FakeStrategy()) == (1, 3) and datafeed.worker_shard(None) is None


@pytest.mark.slow  # ~30-60 s: two worker processes and a one-device run
def test_two_workers_on_an_image_folder_train_like_one_device(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=8)
    args = ["data=image_folder", f"data.path={root}", "data.augment=[flip]", "model=mlp", "model.hidden=[16]",
            "train=smoke", "train.steps=3", "batch=16", "train.eval_every=3", "train.verify_exact=false"]
    results = two_workers(args, tmp_path)
    assert "data: this worker trains rows 0..7 of each batch of 16" in "".join(results[0])
    assert "data: this worker trains rows 8..15 of each batch of 16" in "".join(results[1])
    one = runner(*args, f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    chief = json.loads((tmp_path / "w0" / "metrics.json").read_text())
    single = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert chief["workers"] == 2 and chief["loss"] == pytest.approx(single["loss"], rel=1e-5)


def test_mnist_rescale_is_explicit(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8), y_train=np.arange(8),
             x_test=rng.integers(0, 256, (4, 28, 28), dtype=np.uint8), y_test=np.arange(4))
    default = data.mnist(path=str(tmp_path / "mnist.npz"), download=False)
    raw = data.mnist(path=str(tmp_path / "mnist.npz"), download=False, rescale=1)
    assert float(next(iter(default.eval_batches(4)))["image"].numpy().max()) <= 1.0
    assert float(next(iter(raw.eval_batches(4)))["image"].numpy().max()) > 1.0
    assert "rescale 0.00392157" in default.describe() and "rescale 1" in raw.describe()


def test_the_completeness_check_knows_each_format_and_agrees_with_the_up_front_scan(tmp_path):
    from models.data.image_folder import file_looks_complete, looks_complete

    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    encoded = {"png": tf.io.encode_png(image).numpy(), "jpg": tf.io.encode_jpeg(image).numpy(),
               "bmp": tf.io.encode_bmp(image).numpy() if hasattr(tf.io, "encode_bmp") else None}
    cases = []
    for ext, whole in encoded.items():
        if whole is None:
            continue
        cases += [(f"whole.{ext}", whole, True), (f"half.{ext}", whole[: len(whole) // 2], False)]
    cases += [("padded.jpg", encoded["jpg"] + b"\0" * 100, True), ("text.png", b"hello", False),
              ("empty.png", b"", False)]
    for name, contents, complete in cases:
        (tmp_path / name).write_bytes(contents)
        assert bool(looks_complete(tf.constant(contents))) is complete, name
        assert file_looks_complete(str(tmp_path / name)) is complete, name


@pytest.mark.slow  # ~30-60 s: a MobileNetV2 run
def test_a_keras_application_follows_an_image_folder_and_leaves_a_loadable_model(tmp_path):
    import keras

    root = write_folder(tmp_path / "imgs", classes=("ant", "bee", "cow", "dog"), per_class=4)
    out = tmp_path / "run"
    proc = runner("data=image_folder", f"data.path={root}", "model=keras_app", "model.name=MobileNetV2",
                  "model.input_shape=[32,32,3]", "batch=4", "train=smoke", "train.verify_exact=false",
                  f"hydra.run.dir={out}", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    model = keras.models.load_model(out / "model.keras")
    assert model.input_shape == (None, 12, 10, 3) and model.output_shape == (None, 4)  # the data's, not the config's
    assert (out / "model.best.keras").is_file()


def two_workers(args, folder, resume=None, timeout=300):
    """Run `args` as a two-worker cluster on localhost, worker i in `folder`/w<i> (both workers resume the chief's
    folder `resume` when given)."""
    from test_distribute_config import free_ports

    cluster = {"worker": [f"localhost:{p}" for p in free_ports(2)]}
    env = {**ENV, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "runner", *args, "distribute=multi_worker",
         f"resume={resume}" if resume else f"hydra.run.dir={folder / f'w{i}'}"],
        cwd=ROOT, env={**env, "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        results = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], results[0][1][-2000:] + results[1][1][-2000:]
    return results


@pytest.mark.slow  # ~1-3 min: three two-worker runs
def test_a_resumed_two_worker_run_on_an_image_folder_equals_the_uninterrupted_one(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=8)
    args = ["data=image_folder", f"data.path={root}", "data.augment=[flip,translate:2]", "model=mlp",
            "model.hidden=[16]", "train=smoke", "batch=16", "train.verify_exact=false", "train.checkpoint_every=2",
            "train.eval_every=0"]
    two_workers([*args, "train.steps=5"], tmp_path / "whole")
    two_workers([*args, "train.steps=2"], tmp_path / "part")
    two_workers([*args, "train.steps=5"], None, resume=tmp_path / "part" / "w0")
    whole = json.loads((tmp_path / "whole" / "w0" / "metrics.json").read_text())
    resumed = json.loads((tmp_path / "part" / "w0" / "metrics.json").read_text())
    assert resumed["step"] == whole["step"] == 5
    assert resumed["loss"] == whole["loss"] and resumed["eval_loss"] == whole["eval_loss"]  # bit for bit
