"""``ImageSource``: labelled images in memory as the ``tf.data`` pipelines the runner trains and evaluates on."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .source import BaseSource

AUTOTUNE = tf.data.AUTOTUNE


def check_batch_size(batch_size) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: must be an integer >= 1.")
    return int(batch_size)


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**62:
        raise ValueError(f"seed={seed!r}: must be an integer in [0, 2**62).")
    return int(seed)


class ImageSource(BaseSource):
    """Images ``[n, h, w, c]`` and integer labels, split into train and test.

    Training batches are an endless sequence of epochs, each a permutation drawn from ``(seed, epoch)``,
    batched across epoch ends, optionally shifted by up to ``max_shift`` pixels (drawn from
    ``(seed, batch index)``). Every random choice is stateless, so the same seed gives the same
    batches and the iterator's checkpoint holds only counters.

    Args:
        name: the data set's name.
        train, test: ``(images, labels)``; images of any numeric dtype, scaled by ``scale`` to float32.
        scale: factor turning stored pixel values into [0, 1] floats.
        max_shift: largest random translation in pixels (0 turns augmentation off).
        num_classes: classes of the labels; ``None`` takes the largest label + 1.
    """

    metric = "accuracy"
    metric_direction = "maximize"  # higher is better (runner.config.direction: what a sweep optimizes)

    def __init__(self, name: str, train, test, scale: float = 1.0, max_shift: int = 0,
                 num_classes: int | None = None):
        (x_train, y_train), (x_test, y_test) = train, test
        for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
            if x.ndim != 4 or len(x) != len(y) or len(x) == 0:
                raise ValueError(f"{name} {split} split: need images [n, h, w, c] and n labels; got images "
                                 f"{x.shape} and labels {y.shape}.")
        if isinstance(max_shift, bool) or not isinstance(max_shift, (int, np.integer)) or max_shift < 0:
            raise ValueError(f"max_shift={max_shift!r}: must be an integer >= 0.")
        self.name = name
        self.scale = float(scale)
        self.max_shift = int(max_shift)
        self._train = (x_train, y_train.astype(np.int32))
        self._test = (x_test, y_test.astype(np.int32))
        self.num_classes = int(num_classes or max(y_train.max(), y_test.max()) + 1)
        self.model_args = {"num_classes": self.num_classes, "input_shape": tuple(int(d) for d in x_train.shape[1:])}

    @property
    def train_size(self) -> int:
        return len(self._train[1])

    @property
    def test_size(self) -> int:
        return len(self._test[1])

    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless ``{"image", "label"}`` batches of exactly ``batch_size`` (any size: they span epochs); every row
        loaded under a ``shard`` too (the images are in memory)."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        images = tf.constant(self._train[0])
        labels = tf.constant(self._train[1])
        n = self.train_size

        def epoch(e):
            key = tf.stack([tf.constant(seed, tf.int64), e])
            return tf.data.Dataset.from_tensor_slices(tf.random.experimental.stateless_shuffle(tf.range(n), key))

        def gather(step, idx):
            batch = {"image": self._to_float(tf.gather(images, idx)), "label": tf.gather(labels, idx)}
            if self.max_shift:
                key = tf.stack([tf.constant(seed, tf.int64) + 1, step])
                batch["image"] = random_shift(batch["image"], self.max_shift, key)
            return batch

        ds = tf.data.Dataset.counter().flat_map(epoch).batch(batch_size, drop_remainder=True).enumerate()
        return ds.map(gather, num_parallel_calls=AUTOTUNE, deterministic=True).prefetch(AUTOTUNE)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """One pass over the test split in order, ``{"image", "label"}`` batches (the last may be smaller)."""
        batch_size = check_batch_size(batch_size)
        ds = tf.data.Dataset.from_tensor_slices(self._test).batch(batch_size)
        return ds.map(lambda x, y: {"image": self._to_float(x), "label": y}).prefetch(AUTOTUNE)

    def _to_float(self, images):
        images = tf.cast(images, tf.float32)
        return images * self.scale if self.scale != 1.0 else images

    def describe(self) -> str:
        """One line for the run's header: what the model receives."""
        return (f"{self.name}: {self.train_size} train / {self.test_size} test, images "
                f"{list(self.model_args['input_shape'])}, {self.num_classes} classes, rescale {self.scale:.6g}")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.name!r}, train={self.train_size}, test={self.test_size}, "
                f"shape={self.model_args['input_shape']}, classes={self.num_classes})")


def random_shift(images, max_shift: int, key):
    """Translate each image by its own random offset in ``[-max_shift, max_shift]`` pixels, zero-filled."""
    size = tf.shape(images)
    b, h, w = size[0], size[1], size[2]
    pad = [[0, 0], [max_shift, max_shift], [max_shift, max_shift], [0, 0]]
    padded = tf.pad(images, pad)
    offsets = tf.random.stateless_uniform([2, b], key, 0, 2 * max_shift + 1, dtype=tf.int32)
    rows = offsets[0][:, None] + tf.range(h)[None, :]
    cols = offsets[1][:, None] + tf.range(w)[None, :]
    return tf.gather(tf.gather(padded, rows, axis=1, batch_dims=1), cols, axis=2, batch_dims=1)
