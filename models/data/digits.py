"""scikit-learn's bundled handwritten digits (1797 images, no download) laid out like MNIST at 28x28x1."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from ._source import ImageSource


def to_mnist_layout(images: np.ndarray, box: int = 20, size: int = 28) -> np.ndarray:
    """8x8 images with values 0..16 to ``size``x``size``x1 floats in [0, 1], the digit scaled into a centred ``box``."""
    if not 0 < box <= size:
        raise ValueError(f"box={box}: must be in [1, size={size}].")
    x = tf.image.resize(images[..., None].astype(np.float32) / 16.0, (box, box), method="bilinear")
    lo = (size - box) // 2
    x = tf.pad(x, [[0, 0], [lo, size - box - lo], [lo, size - box - lo], [0, 0]])
    return np.clip(x.numpy(), 0.0, 1.0)


def digits(test_fraction: float = 0.2, split_seed: int = 0, max_shift: int = 2) -> ImageSource:
    """The digits as an ``ImageSource``: a fixed stratified train/test split, optional random shifts.

    Args:
        test_fraction: share of the 1797 images held out for evaluation.
        split_seed: seed of the (stratified) split; fixed so runs compare on the same test set.
        max_shift: training-time random translation in pixels (0 turns augmentation off).
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction={test_fraction!r}: must be a number in (0, 1).")
    raw = load_digits()
    images = to_mnist_layout(raw.images)
    x_train, x_test, y_train, y_test = train_test_split(
        images, raw.target, test_size=test_fraction, random_state=split_seed, stratify=raw.target)
    return ImageSource("digits", (x_train, y_train), (x_test, y_test), max_shift=max_shift)
