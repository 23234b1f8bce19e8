"""A folder of images, one subfolder per class (the layout ``keras.utils.image_dataset_from_directory`` reads).

The files are listed once; ``tf.data`` reads and decodes them on the fly, in parallel (JPEG, PNG, BMP, GIF).
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np
import tensorflow as tf

from ._stream import (StreamSource, check_image_size, fail_unless, parse_augment, parse_rescale, parse_standardize,
                      shuffled_indices)

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
COLOR_MODES = {"rgb": 3, "grayscale": 1, "rgba": 4}
_TAIL = 4096  # trailing bytes searched for a JPEG or GIF end marker (data after it, e.g. padding, is allowed)


class ImageFolderSource(StreamSource):
    """Image files and their class numbers; see ``image_folder``."""

    def __init__(self, train: tuple[list[str], np.ndarray], test: tuple[list[str], np.ndarray], class_names,
                 image_shape, resize: bool, **kwargs):
        self._train_paths, self._train_labels = tf.constant(train[0]), tf.constant(train[1], tf.int32)
        self._test_paths, self._test_labels = tf.constant(test[0]), tf.constant(test[1], tf.int32)
        self._resize = resize
        self.class_names = list(class_names)
        super().__init__("image_folder", image_shape, len(class_names), len(train[0]), len(test[0]), **kwargs)

    def _train_stream(self, seed):
        n = self.train_size
        return shuffled_indices(n, seed).map(lambda i: (self._train_paths[i], self._train_labels[i]))

    def _test_stream(self):
        return tf.data.Dataset.from_tensor_slices((self._test_paths, self._test_labels))

    def _load(self, key):
        path, label = key
        contents = tf.io.read_file(path)
        contents = fail_unless(looks_complete(contents), contents, "data: ", path, " is not a complete JPEG, "
                               "PNG, BMP or GIF file (corrupt or truncated); remove it, or set "
                               "data.skip_corrupt=true to skip such files")
        h, w, c = self.image_shape
        image = tf.io.decode_image(contents, channels=c, expand_animations=False)
        if self._resize:
            return tf.image.resize(image, [h, w]), label
        size = tf.shape(image)
        ok = tf.logical_and(tf.equal(size[0], h), tf.equal(size[1], w))
        image = fail_unless(ok, image, "data: ", path, " is ", size[0], "x", size[1], f" but the first image is "
                            f"{h}x{w}; set data.image_size=[height,width] to resize every image")
        return image, label


def looks_complete(contents):
    """Whether encoded image bytes start with a known format's signature and end with its end marker."""
    n = tf.strings.length(contents)
    padded = tf.strings.join([contents, b"\0" * 8])  # a short file still has 8 header bytes to compare
    head = tf.strings.substr(padded, 0, 8)
    tail = tf.io.decode_raw(tf.strings.substr(contents, tf.maximum(n - _TAIL, 0), _TAIL), tf.uint8)
    pairs = tf.logical_and(tf.equal(tail[:-1], 0xFF), tf.equal(tail[1:], 0xD9))
    jpeg = tf.logical_and(tf.equal(tf.strings.substr(head, 0, 3), b"\xff\xd8\xff"), tf.reduce_any(pairs))
    png = tf.logical_and(tf.equal(head, b"\x89PNG\r\n\x1a\n"),
                         tf.equal(tf.strings.substr(contents, tf.maximum(n - 8, 0), 8), b"IEND\xaeB`\x82"))
    gif = tf.logical_and(tf.equal(tf.strings.substr(head, 0, 4), b"GIF8"), tf.reduce_any(tf.equal(tail, 0x3B)))
    bmp_size = tf.io.decode_raw(tf.strings.substr(padded, 2, 4), tf.uint8)
    declared = tf.reduce_sum(tf.cast(bmp_size, tf.int64) * tf.constant([1, 256, 65536, 16777216], tf.int64))
    bmp = tf.logical_and(tf.equal(tf.strings.substr(head, 0, 2), b"BM"),
                         declared <= tf.cast(n, tf.int64))
    return tf.reduce_any(tf.stack([jpeg, png, gif, bmp]))


def file_looks_complete(path: str) -> bool:
    """``looks_complete`` for a file on disk, reading only its first and last bytes."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - _TAIL, 0))
            tail = f.read()
    except OSError:
        return False
    if head.startswith(b"\xff\xd8\xff"):
        return b"\xff\xd9" in tail
    if head == b"\x89PNG\r\n\x1a\n":
        return tail.endswith(b"IEND\xaeB`\x82")
    if head.startswith(b"GIF8"):
        return b";" in tail
    if head.startswith(b"BM") and len(head) >= 6:
        return struct.unpack("<I", head[2:6])[0] <= size
    return False


def list_classes(root: str, key: str) -> tuple[list[str], list[list[str]]]:
    """Class names (sorted subfolder names) and, per class, its image files (sorted, subfolders included)."""
    if not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "no such folder"
        raise ValueError(f"data.{key}={root!r}: {what}; give a folder with one subfolder of images per class.")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise ValueError(f"data.{key}={root!r}: no class subfolders; put each class's images in its own "
                         f"subfolder ({root}/<class>/<image>.png).")
    files = []
    for name in classes:
        found = sorted(os.path.join(d, f) for d, _, names in os.walk(os.path.join(root, name), followlinks=True)
                       for f in names if f.lower().endswith(EXTENSIONS))
        if not found:
            raise ValueError(f"data.{key}: the class folder {os.path.join(root, name)!r} holds no images "
                             f"({', '.join(EXTENSIONS)}); remove it or add its images.")
        files.append(found)
    return classes, files


def image_folder(path: str | None = None, test_path: str | None = None, validation_split: float | None = None,
                 split_seed: int = 0, image_size: Sequence[int] | None = None, color_mode: str = "rgb",
                 rescale="1/255", augment: Sequence[str] = (), skip_corrupt: bool = False, mean=None,
                 std=None) -> ImageFolderSource:
    """Images in ``path/<class>/...``, decoded on the fly; classes are the sorted subfolder names.

    Args:
        path: the training folder.
        test_path: a second folder of the same layout to evaluate on (its classes must be training classes).
        validation_split: without ``test_path``, the share of ``path``'s files held out (drawn with
            ``split_seed``); ``None``: 0.2.
        split_seed: seed of that split.
        image_size: ``[height, width]`` every image is resized to (bilinear); ``None``: the first image's size,
            and an image of another size stops the run naming it.
        color_mode: ``rgb``, ``grayscale`` or ``rgba`` (channels 3, 1, 4; images are converted).
        rescale: factor turning pixel values into what the model receives (``"1/255"``: [0, 1]; 1: 0..255).
        augment: training augmentations by name (``_stream.AUGMENTATIONS``).
        mean, std: standardization after rescale (and augmentation), ``(x - mean) / std``: a number or one per
            channel (ImageNet's, for rgb in [0, 1]: mean [0.485, 0.456, 0.406], std [0.229, 0.224, 0.225]).
        skip_corrupt: check every file's first and last bytes up front and leave out incomplete ones
            (counted in the run's record); ``False``: such a file stops the run naming it.
    """
    if path is None:
        raise ValueError("data.path: give the image folder (data.path=/data/my_images, one subfolder per class).")
    if color_mode not in COLOR_MODES:
        raise ValueError(f"data.color_mode={color_mode!r}: allowed: {', '.join(COLOR_MODES)}.")
    path = os.path.abspath(os.path.expanduser(str(path)))
    classes, files = list_classes(path, "path")
    train = _flatten(files)
    info = {"path": path, "class_names": classes}
    if test_path is not None:
        if validation_split is not None:
            raise ValueError(f"data.validation_split={validation_split!r}: give either data.test_path or "
                             f"data.validation_split, not both.")
        test_path = os.path.abspath(os.path.expanduser(str(test_path)))
        test_classes, test_files = list_classes(test_path, "test_path")
        unknown = sorted(set(test_classes) - set(classes))
        if unknown:
            raise ValueError(f"data.test_path={test_path!r}: class folder(s) {', '.join(unknown)} are not training "
                             f"classes (training: {', '.join(classes)}).")
        index = {name: i for i, name in enumerate(classes)}
        test = ([f for fs in test_files for f in fs], np.array([index[c] for c, fs in zip(test_classes, test_files)
                                                                 for _ in fs], np.int32))
        info["test_path"] = test_path
    else:
        fraction = 0.2 if validation_split is None else validation_split
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
            raise ValueError(f"data.validation_split={validation_split!r}: must be a number in (0, 1).")
        train, test = _split(train, fraction, split_seed, path)
        info["validation_split"] = float(fraction)
    if skip_corrupt:
        train, bad_train = _complete(train)
        test, bad_test = _complete(test)
        info["skipped_corrupt"] = bad_train + bad_test
        if not len(train[0]) or not len(test[0]):
            raise ValueError(f"data.path={path!r}: no complete image left in the "
                             f"{'training' if not len(train[0]) else 'test'} split after skipping corrupt files.")
    channels = COLOR_MODES[color_mode]
    size = check_image_size(image_size) or _first_size(train[0][0], channels)
    return ImageFolderSource(train, test, classes, (*size, channels), resize=image_size is not None,
                             rescale=parse_rescale(rescale, 1 / 255), augment=parse_augment(augment), info=info,
                             standardize=parse_standardize(mean, std, channels))


def _flatten(files: list[list[str]]) -> tuple[list[str], np.ndarray]:
    return [f for fs in files for f in fs], np.array([k for k, fs in enumerate(files) for _ in fs], np.int32)


def _split(examples, fraction: float, seed: int, path: str):
    paths, labels = examples
    n = len(paths)
    held = int(round(n * fraction))
    if not 0 < held < n:
        raise ValueError(f"data.validation_split={fraction}: holds out {held} of the {n} images in {path!r}; "
                         f"need at least one image on each side (or give data.test_path).")
    order = np.random.default_rng(seed).permutation(n)
    pick = lambda idx: ([paths[i] for i in sorted(idx)], labels[np.sort(idx)])  # noqa: E731 - keeps file order
    return pick(order[held:]), pick(order[:held])


def _complete(examples):
    paths, labels = examples
    keep = [file_looks_complete(p) for p in paths]
    return ([p for p, k in zip(paths, keep) if k], labels[np.array(keep, bool)]), keep.count(False)


def _first_size(path: str, channels: int) -> list[int]:
    try:
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
    except tf.errors.OpError as err:
        raise ValueError(f"data: {path!r} cannot be decoded ({err.message.splitlines()[0][:200]}); remove it, or "
                         f"set data.skip_corrupt=true.") from None
    return [int(image.shape[0]), int(image.shape[1])]
