"""A folder of images, one subfolder per class (the layout ``keras.utils.image_dataset_from_directory`` reads).

The files are listed once; ``tf.data`` reads and decodes them on the fly, in parallel (JPEG, PNG, BMP, GIF).
"""

from __future__ import annotations

import os
import struct
from typing import Sequence

import numpy as np
import tensorflow as tf

from ._fingerprint import file_signatures
from ._source import AUTOTUNE
from ._stream import (ImagePipeline, Labels, Pixels, check_image_size, fail_unless, parse_augment, parse_rescale,
                      parse_standardize, same_size, shuffled_indices)

EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
COLOR_MODES = {"rgb": 3, "grayscale": 1, "rgba": 4}
_TAIL = 4096  # trailing bytes searched for a JPEG or GIF end marker (data after it, e.g. padding, is allowed)


class FileReader:
    """Image files and their class numbers, as keys ``(path, label)``: the files listed once, each epoch's order a
    permutation drawn from ``(seed, epoch)``. ``roots``: the folders the files' names in the fingerprint are
    relative to (training, test)."""

    unit = "file"

    def __init__(self, train: tuple[list[str], np.ndarray], test: tuple[list[str], np.ndarray], roots=(None, None)):
        self.files = {"train": list(train[0]), "test": list(test[0])}
        self.labels = {"train": np.asarray(train[1], np.int32), "test": np.asarray(test[1], np.int32)}
        self.roots = tuple(roots)

    @property
    def train_size(self) -> int:
        return len(self.files["train"])

    @property
    def test_size(self) -> int:
        return len(self.files["test"])

    def train_keys(self, seed):
        paths, labels = tf.constant(self.files["train"]), tf.constant(self.labels["train"], tf.int32)
        return shuffled_indices(self.train_size, seed).map(lambda i: (paths[i], labels[i]))

    def test_keys(self):
        return tf.data.Dataset.from_tensor_slices((tf.constant(self.files["test"]),
                                                   tf.constant(self.labels["test"], tf.int32)))

    def fingerprint(self) -> dict:
        files = {}
        for (split, paths), root in zip(self.files.items(), self.roots):
            names = [os.path.relpath(p, root) for p in paths] if root else None
            files[split] = file_signatures(paths, names)
        return {"files": files}

    def find_unreadable(self, decoder) -> str | None:
        paths = self.files["train"] + self.files["test"]
        bad = [p for p, ok in zip(paths, decodes(paths, decoder.channels)) if not ok]
        if not bad:
            return None
        more = f" ({len(bad)} such files)" if len(bad) > 1 else ""
        return (f"data: {bad[0]} cannot be decoded (corrupt){more}; remove it, or set data.skip_corrupt=true to "
                f"leave such files out (counted)")


class FileDecoder:
    """A key ``(path, label)`` as the file's decoded image (JPEG, PNG, BMP, GIF; ``shape``'s channels), resized to
    ``shape`` (``resize``) or checked to have its size, and the label."""

    def __init__(self, shape, resize: bool):
        self.shape, self.resize = tuple(shape), resize

    @property
    def channels(self) -> int:
        return self.shape[2]

    def __call__(self, key):
        path, label = key
        contents = tf.io.read_file(path)
        contents = fail_unless(looks_complete(contents), contents, "data: ", path, " is not a complete JPEG, "
                               "PNG, BMP or GIF file (corrupt or truncated); remove it, or set "
                               "data.skip_corrupt=true to skip such files")
        image = tf.io.decode_image(contents, channels=self.channels, expand_animations=False)
        return same_size(image, self.shape, self.resize, "data: ", path, first="the first image"), label

    def decodes(self, key):
        return file_decodes(key[0], self.channels)


def file_decodes(path, channels: int = 0):
    """Whether the file at ``path`` (a string tensor) is complete (``looks_complete``) and decodes: the tensor
    exists only once it is decoded."""
    contents = tf.io.read_file(path)
    image = tf.io.decode_image(contents, channels=channels, expand_animations=False)
    return tf.logical_and(looks_complete(contents), tf.size(image) >= 0)  # the size: decode it


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


UNREADABLE = (".webp", ".tif", ".tiff", ".heic", ".heif", ".avif", ".jp2", ".jxl", ".ico", ".psd", ".svg")  # images
# TensorFlow cannot decode: counted and named, never silently left out


class Listing:
    """What walking a data folder found: per class its image files, and what it left out and why."""

    def __init__(self):
        self.classes: list[str] = []
        self.files: list[list[str]] = []
        self.unreadable: list[str] = []  # images of a type TensorFlow cannot decode
        self.duplicates: list[str] = []  # a file reached a second time (through a link)
        self.loops: list[str] = []  # folder links back into the data (itself, a parent, another class)

    def notes(self) -> list[str]:
        """Phrases for the run's header, each naming an example."""
        out = []
        if self.unreadable:
            kinds = sorted({os.path.splitext(f)[1].lower() for f in self.unreadable})
            out.append(f"{len(self.unreadable)} {'/'.join(kinds)} file(s) left out: TensorFlow cannot decode them "
                       f"(e.g. {self.unreadable[0]}; convert them to PNG or JPEG)")
        if self.duplicates:
            out.append(f"{len(self.duplicates)} file(s) reached twice through links, counted once "
                       f"(e.g. {self.duplicates[0]})")
        if self.loops:
            out.append(f"{len(self.loops)} folder link(s) back into the data not followed (e.g. {self.loops[0]})")
        return out


def list_classes(root: str, key: str) -> Listing:
    """Class names (sorted subfolder names) and, per class, its image files (sorted, subfolders included).

    Links are followed, but never back into the data already walked (the folder itself, a parent, another
    class's folder), and a file reached twice is counted once."""
    if not os.path.isdir(root):
        what = "is a file, not a folder" if os.path.exists(root) else "no such folder"
        raise ValueError(f"data.{key}={root!r}: {what}; give a folder with one subfolder of images per class.")
    listing = Listing()
    listing.classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not listing.classes:
        raise ValueError(f"data.{key}={root!r}: no class subfolders; put each class's images in its own "
                         f"subfolder ({root}/<class>/<image>.png).")
    real_root = os.path.realpath(root)
    class_folders = {os.path.realpath(os.path.join(root, c)) for c in listing.classes}
    found = [_walk(os.path.join(root, c), real_root, class_folders - {os.path.realpath(os.path.join(root, c))},
                   listing) for c in listing.classes]
    owner = {}  # a file reached twice belongs where it is not reached through a link (else: where first reached)
    for k, entries in enumerate(found):
        for path, ident, linked in entries:
            if ident not in owner or (owner[ident][2] and not linked):
                owner[ident] = (k, path, linked)
    for k, (name, entries) in enumerate(zip(listing.classes, found)):
        mine = sorted(path for path, ident, _ in entries if owner[ident][:2] == (k, path))
        listing.duplicates += [path for path, ident, _ in entries if owner[ident][:2] != (k, path)]
        if not mine:
            folder = os.path.join(root, name)
            odd = [f for f in listing.unreadable if f.startswith(folder + os.sep)]
            why = f" (only {len(odd)} file(s) of a type TensorFlow cannot decode, e.g. {odd[0]})" if odd else ""
            raise ValueError(f"data.{key}: the class folder {folder!r} holds no images ({', '.join(EXTENSIONS)})"
                             f"{why}; remove it or add its images.")
        listing.files.append(mine)
    listing.duplicates.sort()
    return listing


def _walk(folder: str, real_root: str, other_classes: set, listing: Listing) -> list[tuple[str, tuple, bool]]:
    """``(path, file identity, reached through a link)`` of the image files under ``folder``, following links
    except back into the data (those are recorded in ``listing``, as are images TensorFlow cannot decode)."""
    found, visited, stack = [], set(), [(folder, False)]
    while stack:
        current, linked = stack.pop()
        real = os.path.realpath(current)
        if (real in visited or real_root == real or real_root.startswith(real + os.sep)
                or any(real == c or real.startswith(c + os.sep) for c in other_classes)):
            listing.loops.append(current)
            continue
        visited.add(real)
        try:
            entries = sorted(os.scandir(current), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir():  # follows links
                stack.append((entry.path, linked or entry.is_symlink()))
                continue
            lower = entry.name.lower()
            if lower.endswith(UNREADABLE):
                listing.unreadable.append(entry.path)
            elif lower.endswith(EXTENSIONS):
                try:
                    stat = os.stat(entry.path)
                except OSError:
                    continue  # a dangling link
                found.append((entry.path, (stat.st_dev, stat.st_ino), linked or entry.is_symlink()))
    return found


def image_folder(path: str | None = None, test_path: str | None = None, validation_split: float | None = None,
                 split_seed: int = 0, image_size: Sequence[int] | None = None, color_mode: str = "rgb",
                 rescale="1/255", augment: Sequence[str] = (), skip_corrupt: bool = False, mean=None,
                 std=None, class_names: Sequence[str] | None = None) -> ImagePipeline:
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
        skip_corrupt: read and decode every file once up front and leave out those that fail (counted and
            named in the header and the run's record); ``False``: such a file stops the run naming it.
        class_names: the class numbering to keep (a resumed run's): a folder keeps its number, a new folder
            takes the number of a listed class without one; ``None``: the sorted folder names.
    """
    if path is None:
        raise ValueError("data.path: give the image folder (data.path=/data/my_images, one subfolder per class).")
    if color_mode not in COLOR_MODES:
        raise ValueError(f"data.color_mode={color_mode!r}: allowed: {', '.join(COLOR_MODES)}.")
    path = os.path.abspath(os.path.expanduser(str(path)))
    listing = list_classes(path, "path")
    classes = number_classes(listing.classes, class_names, path)
    (train, test), info, notes = _splits(path, listing, classes, test_path, validation_split, split_seed)
    channels = COLOR_MODES[color_mode]
    if skip_corrupt:
        train, test = _without_corrupt(train, test, channels, info, path)
    info.update({key: len(items) for key, items in (("unreadable", listing.unreadable),
                                                    ("duplicates", listing.duplicates),
                                                    ("link_loops", listing.loops)) if items})
    if notes:
        info["notes"] = notes
    shape = (*(check_image_size(image_size) or _first_size(train[0][0], channels)), channels)
    pixels = Pixels(shape, parse_rescale(rescale, 1 / 255), tuple(parse_augment(augment)),
                    standardize=parse_standardize(mean, std, channels))
    reader = FileReader(train, test, roots=(path, info.get("test_path") or path))
    return ImagePipeline("image_folder", reader, FileDecoder(shape, image_size is not None), pixels,
                         Labels.of(len(classes)), info, identity={"classes": {n: i for i, n in enumerate(classes)}},
                         class_names=classes)


def _splits(path: str, listing: Listing, classes: list[str], test_path, validation_split, split_seed: int):
    """The training and test files with their class numbers: ``test_path``'s folder (its classes must be training
    classes), else ``validation_split`` of ``path``'s files; what the run records of them, and the header's notes."""
    index = {name: i for i, name in enumerate(classes)}
    train = _labelled(listing, index)
    info = {"path": path, "class_names": classes}
    notes = listing.notes()
    if test_path is not None:
        if validation_split is not None:
            raise ValueError(f"data.validation_split={validation_split!r}: give either data.test_path or "
                             f"data.validation_split, not both.")
        test_path = os.path.abspath(os.path.expanduser(str(test_path)))
        test_listing = list_classes(test_path, "test_path")
        unknown = sorted(set(test_listing.classes) - set(classes))
        if unknown:
            raise ValueError(f"data.test_path={test_path!r}: class folder(s) {', '.join(unknown)} are not training "
                             f"classes (training: {', '.join(classes)}).")
        notes += [f"test_path: {note}" for note in test_listing.notes()]
        info["test_path"] = test_path
        return (train, _labelled(test_listing, index)), info, notes
    fraction = 0.2 if validation_split is None else validation_split
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"data.validation_split={validation_split!r}: must be a number in (0, 1).")
    info["validation_split"] = float(fraction)
    return _split(train, fraction, split_seed, path), info, notes


def _without_corrupt(train, test, channels: int, info: dict, path: str):
    """``data.skip_corrupt``: the files that decode (every file read and decoded once), the rest counted in
    ``info``; a split left empty is refused."""
    (train, bad_train), (test, bad_test) = _decodable(train, channels), _decodable(test, channels)
    info["skipped_corrupt"] = len(bad_train) + len(bad_test)
    if bad_train or bad_test:
        info["corrupt_example"] = (bad_train or bad_test)[0]
    if not len(train[0]) or not len(test[0]):
        raise ValueError(f"data.path={path!r}: no readable image left in the "
                         f"{'training' if not len(train[0]) else 'test'} split after skipping corrupt files.")
    return train, test


def number_classes(found: list[str], given, path: str) -> list[str]:
    """Class names by number: the sorted folder names, or (``given``: a resumed run's) the given numbering, where
    a folder not in it takes the number of a given class that has no folder (a renamed class keeps its number)."""
    if given is None:
        return list(found)
    names = [str(n) for n in given]
    free = [i for i, n in enumerate(names) if n not in found]
    new = [c for c in found if c not in names]
    if len(new) > len(free):
        extra = new[len(free):]
        raise ValueError(f"data.path={path!r}: class folder(s) {', '.join(extra)} are not among the resumed run's "
                         f"{len(names)} classes ({', '.join(names)}) and no class number is free: its model has "
                         f"{len(names)} outputs; start a new run to train more classes.")
    for i, name in zip(free, new):
        names[i] = name
    return names


def _labelled(listing: Listing, index: dict) -> tuple[list[str], np.ndarray]:
    """Files and labels in class-number order (the split draws from this order: a renamed class keeps it)."""
    order = sorted(zip(listing.classes, listing.files), key=lambda item: index[item[0]])
    return [f for _, fs in order for f in fs], np.array([index[c] for c, fs in order for _ in fs], np.int32)


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


def _decodable(examples, channels: int):
    """The examples whose file decodes (every file read and decoded once, in parallel) and the paths of the rest."""
    paths, labels = examples
    ok = decodes(paths, channels)
    return ([p for p, k in zip(paths, ok) if k], labels[ok]), [p for p, k in zip(paths, ok) if not k]


def decodes(paths: list[str], channels: int = 0) -> np.ndarray:
    """Per file, whether it is complete (``looks_complete``) and TensorFlow decodes it."""
    if not paths:
        return np.zeros(0, bool)

    names = tf.constant(paths)
    ds = tf.data.Dataset.range(len(paths)).map(lambda i: (i, file_decodes(tf.gather(names, i), channels)),
                                               num_parallel_calls=AUTOTUNE).ignore_errors()
    ok = np.zeros(len(paths), bool)
    for i, good in ds.as_numpy_iterator():
        ok[i] = good
    return ok


def _first_size(path: str, channels: int) -> list[int]:
    try:
        image = tf.io.decode_image(tf.io.read_file(path), channels=channels, expand_animations=False)
    except tf.errors.OpError as err:
        raise ValueError(f"data: {path!r} cannot be decoded ({err.message.splitlines()[0][:200]}); remove it, or "
                         f"set data.skip_corrupt=true.") from None
    return [int(image.shape[0]), int(image.shape[1])]
