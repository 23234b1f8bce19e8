"""The real MNIST from a Keras-format ``mnist.npz`` on disk; never downloads."""

from __future__ import annotations

import os

import numpy as np

from ._source import ImageSource

KEYS = ("x_train", "y_train", "x_test", "y_test")


def default_path() -> str:
    """Where ``keras.datasets.mnist.load_data()`` caches the file: ``$KERAS_HOME/datasets`` or ``~/.keras/datasets``."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "mnist.npz")


def mnist(path: str | None = None, max_shift: int = 0) -> ImageSource:
    """MNIST (60000 train, 10000 test, 28x28x1 in [0, 1]) read from ``path``.

    Args:
        path: a Keras-format ``mnist.npz`` (arrays ``x_train, y_train, x_test, y_test``);
            ``None`` reads the Keras cache (``default_path()``).
        max_shift: training-time random translation in pixels (0 turns augmentation off).
    """
    path = os.path.expanduser(path) if path else default_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"MNIST not found at {path!r}; this data source never downloads. To get it, run "
            f"`python -c \"import keras; keras.datasets.mnist.load_data()\"` on a machine with internet (it saves "
            f"~/.keras/datasets/mnist.npz there), then copy that file to {path!r} here or set data.path to "
            f"your copy. data=digits needs no download.")
    with np.load(path) as f:
        missing = [k for k in KEYS if k not in f.files]
        if missing:
            raise ValueError(f"{path!r} is not a Keras-format mnist.npz: missing arrays {missing}; "
                             f"it has {sorted(f.files)}, needs {list(KEYS)}.")
        arrays = {k: f[k] for k in KEYS}
    images = {k: a if a.ndim == 4 else a[..., None] for k, a in arrays.items() if k.startswith("x")}
    return ImageSource("mnist", (images["x_train"], arrays["y_train"]), (images["x_test"], arrays["y_test"]),
                       scale=1 / 255 if arrays["x_train"].dtype == np.uint8 else 1.0, max_shift=max_shift)
