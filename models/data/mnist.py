"""The real MNIST from a Keras-format ``mnist.npz``, downloaded and cached like ``keras.datasets.mnist``."""

from __future__ import annotations

import os
import zipfile

import numpy as np

from ._source import ImageSource
from ._stream import parse_rescale
from .arrays import file_kind

KEYS = ("x_train", "y_train", "x_test", "y_test")
ORIGIN = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/mnist.npz"
SHA256 = "731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1"  # keras.datasets.mnist's


def default_path() -> str:
    """Where ``keras.datasets.mnist.load_data()`` caches the file: ``$KERAS_HOME/datasets`` or ``~/.keras/datasets``."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "mnist.npz")


def mnist(path: str | None = None, max_shift: int = 0, download: bool = True, origin: str = ORIGIN,
          sha256: str | None = SHA256, rescale=None) -> ImageSource:
    """MNIST (60000 train, 10000 test, 28x28x1 in [0, 1]) read from ``path``, downloaded there if missing.

    Args:
        path: a Keras-format ``mnist.npz`` (arrays ``x_train, y_train, x_test, y_test``);
            ``None`` uses the Keras cache (``default_path()``), shared with ``keras.datasets.mnist``.
        max_shift: training-time random translation in pixels (0 turns augmentation off).
        download: fetch the file from ``origin`` when it is missing (``keras.utils.get_file``).
        origin: the URL to fetch from.
        sha256: the expected SHA-256 of the download (``None``: not checked).
        rescale: factor on the stored values; ``None``: 1/255 for uint8 images ([0, 1]), else 1.
    """
    given = path is not None
    path = os.path.abspath(os.path.expanduser(path) if path else default_path())
    if not os.path.isfile(path):
        if not download:
            raise FileNotFoundError(_missing(path, "downloads are off (data.download=false)"))
        path = _download(path, origin, sha256)
    kind = file_kind(path)
    if kind != "npz":
        raise ValueError(_not_mnist(path, f"it is {kind}" if kind != "npy" else "it is an .npy, not an .npz", given))
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in KEYS if k not in f.files]
            if missing:
                raise ValueError(_not_mnist(path, f"missing arrays {missing} (it has {sorted(f.files)})", given))
            arrays = {k: f[k] for k in KEYS}
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise ValueError(_not_mnist(path, f"it cannot be read ({type(err).__name__})", given)) from None
    except ValueError as err:
        if "mnist.npz" in str(err):
            raise
        why = "an array holds Python objects" if "pickle" in str(err) or "bject" in str(err) else "an array is unreadable"
        raise ValueError(_not_mnist(path, why, given)) from None
    _check_shapes(path, arrays)
    images = {k: a if a.ndim == 4 else a[..., None] for k, a in arrays.items() if k.startswith("x")}
    return ImageSource("mnist", (images["x_train"], arrays["y_train"]), (images["x_test"], arrays["y_test"]),
                       scale=parse_rescale(rescale, 1 / 255 if arrays["x_train"].dtype == np.uint8 else 1.0),
                       max_shift=max_shift)


def _download(path: str, origin: str, sha256: str | None) -> str:
    """Fetch ``origin`` to ``path``; returns where it landed (Keras falls back to /tmp/.keras when the folder
    is not writable)."""
    import socket

    import keras

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)  # urllib waits forever on a network that drops packets
    created = _missing_folders(os.path.dirname(path) or ".")
    try:
        # get_file falls back to /tmp/.keras when the cache folder is not writable, and a missing one is not.
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        path = keras.utils.get_file(fname=os.path.basename(path), origin=origin, file_hash=sha256,
                                    cache_dir=os.path.dirname(path), cache_subdir="")
    except Exception as err:  # noqa: BLE001 - offline, refused, wrong hash: all end in the same advice
        _remove_empty(created)  # leave no empty folder behind at data.path
        why = " ".join(str(err).split()) or type(err).__name__
        raise FileNotFoundError(_missing(path, f"downloading {origin} failed: {why}")) from None
    finally:
        socket.setdefaulttimeout(previous)
    if not os.path.isfile(path):
        raise FileNotFoundError(_missing(path, f"downloading {origin} gave no file"))
    return path


def _missing_folders(folder: str) -> list[str]:
    """`folder` and those of its parents that do not exist yet, deepest first."""
    missing = []
    folder = os.path.abspath(folder)
    while not os.path.exists(folder):
        missing.append(folder)
        parent = os.path.dirname(folder)
        if parent == folder:
            break
        folder = parent
    return missing


def _remove_empty(folders: list[str]) -> None:
    for folder in folders:  # deepest first; stops at one that is not empty (someone else wrote there)
        try:
            os.rmdir(folder)
        except OSError:
            return


def _missing(path: str, why: str) -> str:
    return (f"MNIST not found at {path!r} and {why}. To get it, run `python -c \"import keras; "
            f"keras.datasets.mnist.load_data()\"` on a machine with internet (it saves ~/.keras/datasets/mnist.npz "
            f"there), then copy that file to {path!r} here or set data.path to your copy. data=digits needs no "
            f"download.")


def _not_mnist(path: str, why: str, given: bool) -> str:
    """Never advice to delete: the file may be the user's own (data.path), or one they put in the cache."""
    fix = ("set data.path to a Keras-format mnist.npz, or train on your own file with data=arrays (an .npz or "
           ".npy) or data=tfrecord" if given else
           "replace it with a Keras-format mnist.npz (keras.datasets.mnist.load_data() writes one there), or set "
           "data.path to one")
    return f"{path!r} is not a Keras-format mnist.npz (arrays {', '.join(KEYS)}): {why}; {fix}."


def _check_shapes(path: str, arrays: dict) -> None:
    """Images [n, h, w] or [n, h, w, c] with the same h, w, c in both splits; one integer label per image."""
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if x.ndim not in (3, 4) or y.ndim != 1 or len(x) != len(y) or not np.issubdtype(y.dtype, np.integer):
            raise ValueError(f"{path!r}: the {split} split needs images [n, h, w(, c)] and n integer labels; got "
                             f"x_{split} {x.shape} and y_{split} {y.shape} {y.dtype}.")
        if len(y) and y.min() < 0:
            raise ValueError(f"{path!r}: labels must be class numbers >= 0; y_{split} holds {y.min()}.")
    train, test = arrays["x_train"].shape[1:], arrays["x_test"].shape[1:]
    if train != test:
        raise ValueError(f"{path!r}: train and test images differ in shape: x_train {arrays['x_train'].shape}, "
                         f"x_test {arrays['x_test'].shape}.")
