"""Random data of configurable shape for benchmarks and tests: images with learnable labels, or sequences."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ._source import ImageSource, check_seed
from .sequences import SequenceSource

KINDS = ("images", "sequences")


def synthetic(kind: str = "images", image_shape: Sequence[int] = (28, 28, 1), num_classes: int = 10,
              train_size: int = 1024, test_size: int = 256, noise: float = 0.5, num_symbols: int = 10,
              source_length: int = 8, target_length: int = 8, seed: int = 0) -> ImageSource | SequenceSource:
    """Random data, the same for the same arguments.

    ``kind="images"``: each class has a random prototype image; an example is its class's prototype
    plus Gaussian noise of std ``noise``, stored as uint8, so the labels are learnable.
    ``kind="sequences"``: the reversal task (``sequences``) at one fixed source and target length.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: allowed are {list(KINDS)}.")
    if kind == "sequences":
        return SequenceSource("synthetic", num_symbols, [source_length], [target_length], vary_lengths=False)
    shape = list(image_shape)
    if len(shape) != 3 or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
        raise ValueError(f"image_shape={image_shape!r}: must be (height, width, channels) of integers >= 1.")
    for name, value, low in (("num_classes", num_classes, 2), ("train_size", train_size, 1), ("test_size", test_size, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name}={value!r}: must be an integer >= {low}.")
    rng = np.random.default_rng(check_seed(seed))
    prototypes = rng.uniform(0.0, 1.0, size=(num_classes, *shape)).astype(np.float32)

    def split(n):
        labels = rng.integers(0, num_classes, size=n)
        x = prototypes[labels] + noise * rng.standard_normal((n, *shape), dtype=np.float32)
        return np.round(np.clip(x, 0.0, 1.0) * 255).astype(np.uint8), labels

    return ImageSource("synthetic", split(train_size), split(test_size), scale=1 / 255, num_classes=num_classes)
