"""Your own arrays: an ``.npz`` with your key names, or a pair of ``.npy`` files, memory-mapped, read row by row.

``.npy`` files and the arrays of an uncompressed ``.npz`` (``np.savez``) are memory-mapped: only the rows a
batch needs are read. A compressed ``.npz`` (``np.savez_compressed``) cannot be mapped and is loaded whole.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import tensorflow as tf

from ._fingerprint import array_signature, rows_signature
from ._stream import ImagePipeline, Labels, Pixels, parse_augment, parse_rescale, parse_standardize, shuffled_indices


class ArrayReader:
    """Rows of (possibly memory-mapped) arrays as keys ``(split, row, label)`` (split 0: the training array, 1: the
    test array; they may be one array split by rows), each epoch's order a permutation drawn from ``(seed, epoch)``.
    ``paths``: the files the arrays came from (training, test), for the fingerprint."""

    unit = "row"

    def __init__(self, x_train, train_rows, y_train, x_test, test_rows, y_test, paths=(None, None)):
        self.x = {"train": x_train, "test": x_test}
        self.rows = {"train": np.asarray(train_rows), "test": np.asarray(test_rows)}
        self.y = {"train": y_train, "test": y_test}
        self.paths = dict(zip(("train", "test"), paths))

    @property
    def train_size(self) -> int:
        return len(self.rows["train"])

    @property
    def test_size(self) -> int:
        return len(self.rows["test"])

    def _labels(self, split: str):
        floats = np.issubdtype(self.y["train"].dtype, np.floating)
        return tf.constant(self.y[split], tf.float32 if floats else tf.int32)

    def train_keys(self, seed):
        rows, y = tf.constant(self.rows["train"], tf.int64), self._labels("train")
        return shuffled_indices(self.train_size, seed).map(lambda i: (tf.constant(0), rows[i], y[i]))

    def test_keys(self):
        rows = tf.constant(self.rows["test"], tf.int64)
        return tf.data.Dataset.from_tensor_slices((tf.ones_like(rows, tf.int32), rows, self._labels("test")))

    def fingerprint(self) -> dict:
        arrays = {}
        for split in ("train", "test"):
            x, y = self.x[split], self.y[split]
            arrays[f"{split} images"] = {"shape": list(x.shape), "dtype": str(x.dtype),
                                         "content": array_signature(x, self.paths[split])}
            arrays[f"{split} labels"] = {"shape": list(y.shape), "dtype": str(y.dtype), "content": array_signature(y)}
        return {"arrays": arrays, "rows": {split: rows_signature(rows) for split, rows in self.rows.items()}}

    def find_unreadable(self, decoder) -> str | None:
        return None  # rows in memory or memory-mapped: nothing to decode


class RowDecoder:
    """A key ``(split, row, label)`` as that row of the training (split 0) or test array, shaped ``shape``."""

    def __init__(self, x_train, x_test, shape):
        self.x_train, self.x_test, self.shape = x_train, x_test, tuple(shape)

    def __call__(self, key):
        split, row, label = key
        x_train, x_test = self.x_train, self.x_test
        image = tf.numpy_function(lambda s, r: np.asarray((x_train if s == 0 else x_test)[r]), [split, row],
                                  tf.as_dtype(x_train.dtype), stateful=False)
        return tf.reshape(image, self.shape), label

    def decodes(self, key):
        return tf.constant(True)


def arrays(path: str | None = None, x_key: str = "x", y_key: str = "y", labels_path: str | None = None,
           test_path: str | None = None, test_labels_path: str | None = None, test_fraction: float | None = None,
           split_seed: int = 0, num_classes: int | None = None, rescale=None, augment=(), mean=None,
           std=None) -> ImagePipeline:
    """Images and their labels from NumPy files: integer class numbers, or float targets (regression).

    Args:
        path: an ``.npz`` holding arrays ``x_key`` (images ``[n, h, w]`` or ``[n, h, w, c]``) and ``y_key``
            (``n`` integer labels), or an ``.npy`` of images with ``labels_path`` an ``.npy`` of labels.
        test_path, test_labels_path: the test split in the same form; without them ``test_fraction`` of
            ``path``'s rows (drawn with ``split_seed``; ``None``: 0.2) is held out.
        num_classes: ``None``: the largest training label + 1.
        rescale: ``None``: 1/255 for uint8 images, 1/65535 for uint16, 1 for floats already in 0..1; other
            images need it given (``value_scale``).
        augment: training augmentations by name.
        mean, std: standardization after rescale, ``(x - mean) / std``: a number or one per channel.
    """
    if path is None:
        raise ValueError("data.path: give an .npz (with data.x_key, data.y_key) or an .npy of images with "
                         "data.labels_path.")
    x, y = _open(path, labels_path, x_key, y_key, "path", "labels_path")
    info = {"path": os.path.abspath(str(path)), "x_key": x_key, "y_key": y_key}
    (x_test, y_test), (train_rows, test_rows) = _test_split(x, y, test_path, test_labels_path, test_fraction,
                                                            split_seed, x_key, y_key, info)
    y_train, y_test = y[train_rows], y_test[test_rows]
    scale, top = value_scale(x if test_path is None else (x, x_test), rescale)
    shape = tuple(x.shape[1:]) if x.ndim == 4 else (*x.shape[1:], 1)
    pixels = Pixels(shape, scale, tuple(parse_augment(augment)), top, parse_standardize(mean, std, shape[2]))
    labels = _labels(y_train, y_test, num_classes, test_path, y_key if labels_path is None else "labels_path")
    reader = ArrayReader(x, train_rows, y_train, x_test, test_rows, y_test,
                         (info["path"], info.get("test_path") or info["path"]))
    return ImagePipeline("arrays", reader, RowDecoder(x, x_test, shape), pixels, labels, info)


def _test_split(x, y, test_path, test_labels_path, test_fraction, split_seed: int, x_key: str, y_key: str,
                info: dict):
    """The test arrays and the rows of each split: ``test_path``'s arrays (images of the training images' shape
    and dtype), else ``test_fraction`` of the training rows (drawn with ``split_seed``); recorded in ``info``."""
    if test_path is not None:
        if test_fraction is not None:
            raise ValueError(f"data.test_fraction={test_fraction!r}: give either data.test_path or "
                             f"data.test_fraction, not both.")
        x_test, y_test = _open(test_path, test_labels_path, x_key, y_key, "test_path", "test_labels_path")
        if x_test.shape[1:] != x.shape[1:] or x_test.dtype != x.dtype:
            raise ValueError(f"data.test_path={test_path!r}: its images are {x_test.shape[1:]} {x_test.dtype}, the "
                             f"training images {x.shape[1:]} {x.dtype}; they must match.")
        info["test_path"] = os.path.abspath(str(test_path))
        return (x_test, y_test), (np.arange(len(x)), np.arange(len(x_test)))
    fraction = 0.2 if test_fraction is None else test_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ValueError(f"data.test_fraction={test_fraction!r}: must be a number in (0, 1).")
    held = int(round(len(x) * fraction))
    if not 0 < held < len(x):
        raise ValueError(f"data.test_fraction={fraction}: holds out {held} of {len(x)} rows; need at least "
                         f"one on each side (or give data.test_path).")
    order = np.random.default_rng(split_seed).permutation(len(x))
    info["test_fraction"] = float(fraction)
    return (x, y), (np.sort(order[held:]), np.sort(order[:held]))


def _labels(y_train, y_test, num_classes, test_path, key: str) -> Labels:
    """Float targets (regression) where the labels are floats, else class numbers: ``num_classes`` or the largest
    training label + 1, every label of both splits in their range."""
    if np.issubdtype(y_train.dtype, np.floating):  # float targets: the model regresses them
        if y_test.shape[1:] != y_train.shape[1:] or not np.issubdtype(y_test.dtype, np.floating):
            raise ValueError(f"data.test_path={test_path!r}: its labels are {y_test.shape[1:]} {y_test.dtype}, the "
                             f"training targets {y_train.shape[1:]} {y_train.dtype}; they must match.")
        return Labels.of(target_shape=y_train.shape[1:])
    labels = Labels.of(num_classes if num_classes is not None else int(y_train.max()) + 1,
                       hint="must be an integer >= 1 or null")
    for split, values in (("training", y_train), ("test", y_test)):
        if values.min() < 0 or values.max() >= labels.num_classes:
            bad = values.min() if values.min() < 0 else values.max()
            where = ("data.num_classes" if num_classes is not None else
                     "the training labels' largest + 1; this test class is absent from training")
            raise ValueError(f"data.{key}: the {split} labels hold {bad}, outside the class range "
                             f"0..{labels.num_classes - 1} ({where}).")
    return labels


_CHUNK = 4096  # rows read at once for a range or a finiteness check (the arrays may be memory-mapped)


def value_scale(images, rescale) -> tuple[float, float]:
    """``data.rescale`` and the largest stored value, from the images' dtype and range: uint8 1/255, uint16
    1/65535, floats already in 0..1 as they are; other values need an explicit ``data.rescale`` (refused in one
    line naming the range seen). Non-finite values are refused naming the split and row. ``images``: an array, or
    (training, test) arrays."""
    arrays = images if isinstance(images, tuple) else (images,)
    names = ("data.path", "data.test_path")
    kind = arrays[0].dtype
    if np.issubdtype(kind, np.floating):
        for name, array in zip(names, arrays):
            _check_finite(array, name)
    if kind in (np.uint8, np.uint16):
        top = float(np.iinfo(kind).max)
        return parse_rescale(rescale, 1 / top), top
    lo, hi = _value_range(arrays)
    if rescale is not None:
        return parse_rescale(rescale, 1.0), max(hi, 0.0)
    if np.issubdtype(kind, np.floating) and lo >= 0 and hi <= 1:
        return 1.0, 1.0
    raise ValueError(f"data.path: the images are {kind} with values {lo:g}..{hi:g}; with data.rescale=null only "
                     f"uint8 (scaled by 1/255), uint16 (1/65535) and floats already in 0..1 are scaled by themselves: "
                     f"give data.rescale (1/255 for values in 0..255; 1 to feed them as they are).")


def _value_range(arrays) -> tuple[float, float]:
    lo, hi = np.inf, -np.inf
    for array in arrays:
        for start in range(0, len(array), _CHUNK):
            chunk = np.asarray(array[start:start + _CHUNK])
            if chunk.size:
                lo, hi = min(lo, float(chunk.min())), max(hi, float(chunk.max()))
    return lo, hi


def _check_finite(array, name: str) -> None:
    for start in range(0, len(array), _CHUNK):
        chunk = np.asarray(array[start:start + _CHUNK]).reshape(min(_CHUNK, len(array) - start), -1)
        bad = np.flatnonzero(~np.isfinite(chunk).all(axis=1))
        if bad.size:
            row = start + int(bad[0])
            value = chunk[bad[0]][~np.isfinite(chunk[bad[0]])][0]
            more = f" (and {bad.size - 1} more rows in rows {start}..{start + len(chunk) - 1})" if bad.size > 1 else ""
            raise ValueError(f"{name}: image row {row} holds {value} (not a finite number){more}; non-finite "
                             f"values would reach the weights as NaN: fix or drop those rows.")


def _open(path, labels_path, x_key: str, y_key: str, key: str, labels_key: str):
    """(images, labels): images memory-mapped where the file allows, labels in memory; checked."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    kind = file_kind(path)
    if kind == "npz":
        if labels_path is not None:
            raise ValueError(f"data.{labels_key}={labels_path!r}: only for an .npy of images; {path!r} is an .npz "
                             f"(name its arrays with data.x_key and data.y_key).")
        found = npz_arrays(path, (x_key, y_key), key, ("x_key", "y_key"))
        x, y = found[x_key], found[y_key]
        xname, yname = f"{path}[{x_key!r}]", f"{path}[{y_key!r}]"
    elif kind == "npy":
        if labels_path is None:
            raise ValueError(f"data.{key}={path!r} is an .npy of images: give its labels with data.{labels_key} "
                             f"(an .npy of integers), or use an .npz with data.x_key and data.y_key.")
        labels_path = os.path.abspath(os.path.expanduser(str(labels_path)))
        if file_kind(labels_path) != "npy":
            raise ValueError(_not_numpy(labels_path, labels_key))
        x, y = load_npy(path, key), load_npy(labels_path, labels_key)
        xname, yname = path, labels_path
    else:
        raise ValueError(_not_numpy(path, key))
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    floats = np.issubdtype(y.dtype, np.floating)
    if x.ndim not in (3, 4) or y.ndim < 1 or (y.ndim != 1 and not floats) or len(x) != len(y) or not len(x):
        raise ValueError(f"{xname} and {yname}: need images [n, h, w] or [n, h, w, c] and n labels (class numbers, "
                         f"or float targets [n, ...]); got {x.shape} and {y.shape}.")
    if not (np.issubdtype(y.dtype, np.integer) or floats):
        raise ValueError(f"{yname}: labels must be integer class numbers or float targets; got dtype {y.dtype}.")
    if floats and not np.all(np.isfinite(y)):
        raise ValueError(f"{yname}: the float targets hold NaN or Inf.")
    if not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
        raise ValueError(f"{xname}: images must be numbers; got dtype {x.dtype}.")
    return x, (y.astype(np.float32) if floats else y.astype(np.int64))


def file_kind(path: str) -> str:
    """``npz``, ``npy``, or a short description of what else the file is (for one-line errors)."""
    if not os.path.isfile(path):
        return "missing" if not os.path.exists(path) else "a folder"
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return "npz" if zipfile.is_zipfile(path) else "a damaged zip archive"
    for magic, what in ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
                        (b"\x1f\x8b", "a gzip file"), (b"\x80", "a Python pickle")):
        if head.startswith(magic):
            return what
    if _is_tfrecord(path):
        return "a TFRecord file"
    if not head:
        return "an empty file"
    return "not a NumPy file"


def _not_numpy(path: str, key: str) -> str:
    kind = file_kind(path)
    if kind == "missing":
        return f"data.{key}={path!r}: no such file."
    return f"data.{key}={path!r} is {kind}, not an .npz or .npy file (data=arrays reads NumPy files)."


def load_npy(path: str, key: str):
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err) or "objects" in str(err):
            raise ValueError(f"data.{key}={path!r} holds Python objects, not a numeric array; save plain arrays "
                             f"(np.save with a numeric dtype).") from None
        raise ValueError(f"data.{key}={path!r}: NumPy cannot read it ({err}).") from None


def npz_arrays(path: str, names, key: str, name_keys) -> dict:
    """The named arrays of an ``.npz``, memory-mapped where stored uncompressed; one line for a missing name."""
    try:
        with zipfile.ZipFile(path) as archive:
            members = {m.filename[:-4]: m for m in archive.infolist() if m.filename.endswith(".npy")}
            missing = [(k, n) for k, n in zip(name_keys, names) if n not in members]
            if missing:
                raise ValueError(f"data.{key}={path!r} has no array " + ", ".join(f"{n!r} (data.{k})"
                                                                                  for k, n in missing)
                                 + f"; it has: {', '.join(sorted(members)) or 'none'}.")
            return {n: _member(path, archive, members[n], key) for n in names}
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise ValueError(f"data.{key}={path!r} is not a readable .npz ({type(err).__name__}: {err}).") from None


def _member(path: str, archive: zipfile.ZipFile, member: zipfile.ZipInfo, key: str):
    try:
        if member.compress_type == zipfile.ZIP_STORED:
            with open(path, "rb") as f:
                f.seek(member.header_offset + 26)
                name_len, extra_len = np.frombuffer(f.read(4), "<u2")
                start = member.header_offset + 30 + int(name_len) + int(extra_len)
                f.seek(start)
                version = np.lib.format.read_magic(f)
                header = {(1, 0): np.lib.format.read_array_header_1_0,
                          (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                shape, fortran, dtype = header(f) if header else ((), False, np.dtype(object))
                if not dtype.hasobject:
                    return np.memmap(path, dtype=dtype, mode="r", offset=f.tell(), shape=shape,
                                     order="F" if fortran else "C")
        with archive.open(member) as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except ValueError as err:
        if "pickle" in str(err) or "object" in str(err).lower():
            raise ValueError(f"data.{key}={path!r}: array {member.filename[:-4]!r} holds Python objects, not "
                             f"numbers; save plain numeric arrays.") from None
        raise ValueError(f"data.{key}={path!r}: array {member.filename[:-4]!r} cannot be read ({err}).") from None


def _is_tfrecord(path: str) -> bool:
    try:
        next(iter(tf.data.TFRecordDataset(path).take(1)))
        return True
    except Exception:  # noqa: BLE001 - anything unreadable as a record is not one
        return False
