"""Data sources: real digits offline, MNIST from disk only, synthetic data, the reversal task; deterministic pipelines."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import tensorflow as tf
from omegaconf import OmegaConf

from models import data
from models.data.mnist import default_path as mnist_default_path
from models.data.sequences import BOS_ID, EOS_ID, FIRST_SYMBOL
from models.losses import PAD_ID

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"


@pytest.fixture(scope="module")
def digits():
    return data.digits()


def _take(ds, n):
    return [{k: v.numpy() for k, v in b.items()} for b in ds.take(n)]


def _assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def test_digits_is_real_mnist_shaped_data(digits):
    assert (digits.train_size, digits.test_size) == (1437, 360)
    assert digits.model_args == {"num_classes": 10, "input_shape": (28, 28, 1)}
    assert digits.metric == "accuracy"
    batch = next(iter(digits.train_batches(64, seed=0)))
    assert batch["image"].dtype == tf.float32 and batch["image"].shape == (64, 28, 28, 1)
    assert batch["label"].dtype == tf.int32 and batch["label"].shape == (64,)
    assert 0.0 <= float(tf.reduce_min(batch["image"])) and float(tf.reduce_max(batch["image"])) <= 1.0
    assert np.bincount(digits._test[1], minlength=10).min() >= 35  # stratified: every digit held out


def test_eval_is_one_ordered_pass_over_the_test_split(digits):
    batches = _take(digits.eval_batches(100), 100)
    assert [len(b["label"]) for b in batches] == [100, 100, 100, 60]
    np.testing.assert_array_equal(np.concatenate([b["label"] for b in batches]), digits._test[1])
    _assert_same_batches(batches, _take(digits.eval_batches(100), 100))


def test_same_seed_same_batches_other_seed_others(digits):
    a, b = _take(digits.train_batches(32, seed=5), 3), _take(digits.train_batches(32, seed=5), 3)
    _assert_same_batches(a, b)
    c = _take(digits.train_batches(32, seed=6), 1)[0]
    assert not np.array_equal(a[0]["image"], c["image"])


def test_any_batch_size_including_7500(digits):
    batch = _take(digits.train_batches(7500, seed=0), 1)[0]
    assert batch["image"].shape == (7500, 28, 28, 1)
    assert np.bincount(batch["label"], minlength=10).min() > 600


def test_epochs_are_permutations_of_the_train_split():
    source = data.digits(max_shift=0)
    n = source.train_size
    first, second = _take(source.train_batches(n, seed=1), 2)
    for epoch in (first, second):
        np.testing.assert_array_equal(np.sort(epoch["label"]), np.sort(source._train[1]))
        np.testing.assert_allclose(np.sort(epoch["image"].sum(axis=(1, 2, 3))),
                                   np.sort(source._train[0].sum(axis=(1, 2, 3))), rtol=1e-5)
    assert not np.array_equal(first["label"], second["label"])


def test_augmentation_shifts_without_cropping_the_digit():
    shifted = data.digits(max_shift=2)
    plain = data.digits(max_shift=0)
    a = _take(shifted.train_batches(256, seed=0), 1)[0]
    b = _take(plain.train_batches(256, seed=0), 1)[0]
    np.testing.assert_array_equal(a["label"], b["label"])
    np.testing.assert_allclose(a["image"].sum(axis=(1, 2, 3)), b["image"].sum(axis=(1, 2, 3)), rtol=1e-5)
    assert np.mean([not np.array_equal(x, y) for x, y in zip(a["image"], b["image"])]) > 0.5


@pytest.mark.parametrize("make", [lambda: data.digits(), lambda: data.sequences(source_buckets=[3, 6])])
def test_iterator_resumes_from_a_checkpoint(make, tmp_path):
    source = make()
    it = iter(source.train_batches(16, seed=2))
    for _ in range(3):
        next(it)
    ckpt = tf.train.Checkpoint(iterator=it)
    path = ckpt.write(str(tmp_path / "ckpt"))
    expected = [{k: v.numpy() for k, v in next(it).items()} for _ in range(2)]
    ckpt.read(path).assert_consumed()
    _assert_same_batches([{k: v.numpy() for k, v in next(it).items()} for _ in range(2)], expected)
    fresh = iter(source.train_batches(16, seed=2))
    tf.train.Checkpoint(iterator=fresh).read(path).assert_consumed()
    _assert_same_batches([{k: v.numpy() for k, v in next(fresh).items()} for _ in range(2)], expected)


@pytest.mark.parametrize("args, match", [
    (dict(test_fraction=1.0), "test_fraction=1.0"),
    (dict(max_shift=-1), "max_shift=-1"),
])
def test_digits_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        data.digits(**args)


@pytest.mark.parametrize("batch_size, seed, match", [(0, 0, "batch_size=0"), (8, -1, "seed=-1"), (2.5, 0, "batch_size=2.5")])
def test_bad_batch_size_or_seed(digits, batch_size, seed, match):
    with pytest.raises(ValueError, match=match):
        digits.train_batches(batch_size, seed)


def test_mnist_absent_says_where_it_looked_and_how_to_get_it(tmp_path):
    missing = tmp_path / "nowhere" / "mnist.npz"
    with pytest.raises(FileNotFoundError) as err:
        data.mnist(path=str(missing), download=False)
    assert str(missing) in str(err.value) and "mnist.load_data()" in str(err.value)


def test_mnist_default_path_is_the_keras_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path))
    assert mnist_default_path() == str(tmp_path / "datasets" / "mnist.npz")
    with pytest.raises(FileNotFoundError, match="datasets/mnist.npz"):
        data.mnist(download=False)


@pytest.fixture
def served(tmp_path):
    """A folder served over HTTP on 127.0.0.1 (never the internet): (folder, base URL)."""
    import functools
    import http.server
    import threading

    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_mnist_downloads_and_caches_when_missing(served, tmp_path):
    import hashlib

    root, url = served
    _fake_mnist(root / "mnist.npz")
    digest = hashlib.sha256((root / "mnist.npz").read_bytes()).hexdigest()
    cached = tmp_path / "cache" / "mnist.npz"
    source = data.mnist(path=str(cached), origin=f"{url}/mnist.npz", sha256=digest)
    assert (source.train_size, source.test_size) == (40, 12)
    assert cached.read_bytes() == (root / "mnist.npz").read_bytes()
    (root / "mnist.npz").unlink()  # the second time reads the cache, no server file needed
    assert data.mnist(path=str(cached), origin=f"{url}/mnist.npz", sha256=digest).train_size == 40


def test_mnist_download_failure_says_where_to_put_the_file(served, tmp_path):
    root, url = served
    cached = tmp_path / "cache" / "mnist.npz"
    with pytest.raises(FileNotFoundError) as err:  # the server has no such file: like being offline
        data.mnist(path=str(cached), origin=f"{url}/mnist.npz")
    message = str(err.value)
    assert str(cached) in message and f"downloading {url}/mnist.npz failed" in message
    assert "mnist.load_data()" in message and "\n" not in message and not cached.exists()


def test_mnist_download_with_a_wrong_hash_is_refused(served, tmp_path):
    root, url = served
    _fake_mnist(root / "mnist.npz")
    cached = tmp_path / "cache" / "mnist.npz"
    with pytest.raises(FileNotFoundError, match="failed"):
        data.mnist(path=str(cached), origin=f"{url}/mnist.npz", sha256="0" * 64)


def test_mnist_random_bytes_are_not_a_valid_npz(tmp_path):
    (tmp_path / "mnist.npz").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match="is not a Keras-format mnist.npz") as err:
        data.mnist(path=str(tmp_path / "mnist.npz"))
    assert "delete" not in str(err.value) and "pickle" not in str(err.value)


def test_mnist_train_and_test_shapes_must_agree(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
             y_train=np.arange(8) % 10, x_test=rng.integers(0, 256, (4, 32, 32), dtype=np.uint8),
             y_test=np.arange(4) % 10)
    with pytest.raises(ValueError, match="train and test images differ in shape"):
        data.mnist(path=str(tmp_path / "mnist.npz"))
    np.savez(tmp_path / "labels.npz", x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
             y_train=np.arange(7) % 10, x_test=rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
             y_test=np.arange(4) % 10)
    with pytest.raises(ValueError, match="train split needs images"):
        data.mnist(path=str(tmp_path / "labels.npz"))


def _fake_mnist(path, n_train=40, n_test=12):
    rng = np.random.default_rng(0)
    np.savez(path, x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
             y_train=np.arange(n_train) % 10, x_test=rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
             y_test=np.arange(n_test) % 10)
    return path


def test_mnist_negative_labels_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "mnist.npz", x_train=rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
             y_train=np.arange(8) - 3, x_test=rng.integers(0, 256, (4, 28, 28), dtype=np.uint8),
             y_test=np.arange(4) % 10)
    with pytest.raises(ValueError, match="labels must be class numbers >= 0; y_train holds -3"):
        data.mnist(path=str(tmp_path / "mnist.npz"))


def test_mnist_reads_a_keras_format_npz(tmp_path):
    source = data.mnist(path=str(_fake_mnist(tmp_path / "mnist.npz")))
    assert (source.train_size, source.test_size) == (40, 12)
    assert source.model_args == {"num_classes": 10, "input_shape": (28, 28, 1)}
    batch = _take(source.train_batches(50, seed=0), 1)[0]
    assert batch["image"].shape == (50, 28, 28, 1) and batch["image"].dtype == np.float32
    assert batch["image"].max() <= 1.0 and batch["image"].max() > 0.9
    with np.load(tmp_path / "mnist.npz") as f:
        first_test = f["x_test"][0, :, :, None] / 255.0
    np.testing.assert_allclose(_take(source.eval_batches(4), 1)[0]["image"][0], first_test, rtol=1e-6)


def test_mnist_wrong_npz_names_the_missing_arrays(tmp_path):
    np.savez(tmp_path / "bad.npz", images=np.zeros((2, 28, 28)))
    with pytest.raises(ValueError, match=r"missing arrays \['x_train', 'y_train', 'x_test', 'y_test'\]"):
        data.mnist(path=str(tmp_path / "bad.npz"))


def test_synthetic_images_are_configurable_and_deterministic():
    a = data.synthetic(image_shape=[8, 6, 3], num_classes=4, train_size=32, test_size=8, seed=1)
    b = data.synthetic(image_shape=[8, 6, 3], num_classes=4, train_size=32, test_size=8, seed=1)
    assert a.model_args == {"num_classes": 4, "input_shape": (8, 6, 3)}
    batch = _take(a.train_batches(5, seed=0), 1)[0]
    assert batch["image"].shape == (5, 8, 6, 3) and set(batch["label"]) <= set(range(4))
    _assert_same_batches(_take(a.train_batches(5, seed=0), 2), _take(b.train_batches(5, seed=0), 2))
    assert not np.array_equal(a._train[0], data.synthetic(image_shape=[8, 6, 3], seed=2)._train[0][:32])


def test_synthetic_sequences_have_fixed_lengths():
    source = data.synthetic(kind="sequences", num_symbols=5, source_length=6, target_length=3)
    assert source.model_args == {"vocab_size": 8}
    for batch in _take(source.train_batches(4, seed=0), 3):
        assert batch["source"].shape == (4, 6) and batch["target_out"].shape == (4, 3)
        assert (batch["source"] != PAD_ID).all()


@pytest.mark.parametrize("args, match", [
    (dict(kind="audio"), "kind='audio'"),
    (dict(image_shape=[28, 28]), "image_shape"),
    (dict(num_classes=1), "num_classes=1"),
])
def test_synthetic_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        data.synthetic(**args)


def _check_reversal(batch):
    source, target_in, target_out = batch["source"], batch["target_in"], batch["target_out"]
    for x, y_in, y in zip(source, target_in, target_out):
        s, t = int((x != PAD_ID).sum()), int((y != PAD_ID).sum())
        assert s >= 1 and t >= 1 and (x[:s] >= FIRST_SYMBOL).all() and (x[s:] == PAD_ID).all()
        expected = np.concatenate([x[:s][::-1], np.full(max(t - s, 0), EOS_ID)])[:t]
        np.testing.assert_array_equal(y[:t], expected)
        assert (y[t:] == PAD_ID).all()
        np.testing.assert_array_equal(y_in[:t], np.concatenate([[BOS_ID], y[: t - 1]]))
        assert (y_in[t:] == PAD_ID).all()


def test_reversal_batches_follow_the_task_with_independent_buckets():
    source = data.sequences(num_symbols=6, source_buckets=[3, 6], target_buckets=[2, 5, 9])
    assert source.model_args == {"vocab_size": FIRST_SYMBOL + 6}
    pairs = set()
    for batch in _take(source.train_batches(16, seed=0), 40):
        _check_reversal(batch)
        pairs.add((batch["source"].shape[1], batch["target_out"].shape[1]))
    assert pairs == set(source.bucket_pairs)


def test_reversal_eval_covers_every_bucket_pair_deterministically():
    source = data.sequences(source_buckets=[3, 6], target_buckets=[2, 5], eval_size=64)
    batches = _take(source.eval_batches(8), 100)
    assert len(batches) == 8
    assert {(b["source"].shape[1], b["target_out"].shape[1]) for b in batches} == set(source.bucket_pairs)
    for b in batches:
        _check_reversal(b)
    _assert_same_batches(batches, _take(source.eval_batches(8), 100))


@pytest.mark.parametrize("args, match", [
    (dict(source_buckets=[8, 4]), "source_buckets"),
    (dict(target_buckets=[]), "target_buckets"),
    (dict(num_symbols=0), "num_symbols=0"),
])
def test_sequences_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        data.sequences(**args)


@pytest.mark.parametrize("name", ["digits", "mnist", "synthetic", "sequences"])
def test_data_yaml_instantiates(name, tmp_path):
    from hydra.utils import instantiate

    cfg = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    if name == "mnist":
        cfg.path = str(_fake_mnist(tmp_path / "mnist.npz"))
    source = instantiate(cfg)
    assert source.name == name and source.metric == "accuracy"
    assert next(iter(source.train_batches(4, seed=0)))
