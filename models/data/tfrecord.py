"""``tf.train.Example`` shards (TFRecord files, optionally GZIP/ZLIB-compressed), read interleaved and streamed.

Each epoch reads the training shards in an order drawn from ``(seed, epoch)``, ``cycle_length`` at a time,
their records interleaved, then shuffles windows of ``shuffle_buffer`` records, each window by its own key:
every choice is stateless, so the same seed gives the same batches and a resumed run continues exactly.
"""

from __future__ import annotations

import glob
import os
import re
import struct
from typing import Sequence

import numpy as np
import tensorflow as tf

from ._fingerprint import file_signatures
from ._source import AUTOTUNE
from ._stream import (ImagePipeline, Labels, Pixels, check_counts, check_image_size, fail_unless, parse_augment,
                      parse_rescale, parse_standardize, same_size)
from .image_folder import COLOR_MODES

FORMATS = ("encoded", "raw")
LABEL_FORMATS = ("class", "float")
COMPRESSION = (None, "GZIP", "ZLIB")
_PART_TYPES = (tf.string, tf.int64, tf.int64)


class ShardReader:
    """TFRecord shards as keys (serialized records): each epoch the training shards in an order drawn from
    ``(seed, epoch)``, ``cycle_length`` at a time, their records interleaved, then windows of ``shuffle_buffer``
    records shuffled, each by its own key. A shard is a path, or ``(path, skip, take)``: its records skip .. skip +
    take (take -1: to the end). ``counts``: records per shard where counted; ``sizes``: records per split (None:
    unknown)."""

    unit = "record"

    def __init__(self, train: list, test: list, compression=None, shuffle_buffer: int = 1024, cycle_length: int = 4,
                 counts=None, sizes=(None, None)):
        self.parts = {"train": _parts(train), "test": _parts(test)}
        self.compression = compression or ""
        self.shuffle_buffer = shuffle_buffer
        self.cycle_length = min(cycle_length, len(train))  # shards read at once (of the shards given)
        self.counts = dict(counts or {})
        self.sizes = dict(zip(("train", "test"), sizes))

    @property
    def train_size(self) -> int | None:
        return self.sizes["train"]

    @property
    def test_size(self) -> int | None:
        return self.sizes["test"]

    def fingerprint(self) -> dict:
        shards = {}
        for split, parts in self.parts.items():
            paths = list(dict.fromkeys(parts[0]))
            content = file_signatures(paths)
            shards[split] = {p: {"size": os.path.getsize(p), "records": self.counts.get(p), "content": content[p]}
                             for p in paths}
        return {"shards": shards}

    def scan(self, part, decoder) -> tuple[np.ndarray, str | None]:
        """Read (and decode) every record of a shard ``(path, skip, take)``: per readable record whether its image
        decodes, and the reader's error where the shard cannot be read to its end (a corrupt record)."""
        path, skip, take = part
        records = tf.data.TFRecordDataset(path, compression_type=self.compression).skip(skip).take(take)
        readable = int(records.map(lambda r: tf.constant(1, tf.int64)).ignore_errors().reduce(
            tf.constant(0, tf.int64), lambda n, one: n + one))
        error = None
        try:
            next(iter(records.skip(readable).take(1)), None)
        except tf.errors.OpError as err:
            error = first_line(err)
        ok = np.zeros(readable, bool)
        checked = records.take(readable).enumerate().map(lambda i, r: (i, decoder.decodes(r)),
                                                         num_parallel_calls=AUTOTUNE).ignore_errors()
        for i, _ in checked.as_numpy_iterator():
            ok[i] = True
        return ok, error

    def skip_corrupt(self, decoder) -> tuple[int, str | None]:
        """Leave out every record that cannot be read or decoded: the shards become the record ranges that can.
        Returns how many were left out and one of them, named."""
        skipped, example = set(), None  # a shard in both splits counts once
        for split in ("train", "test"):
            parts = []
            for part in zip(*self.parts[split]):
                ok, error = self.scan(part, decoder)
                bad = np.flatnonzero(~ok)
                if error or bad.size:
                    where = int(bad[0]) if bad.size else len(ok)
                    example = example or f"{part[0]} record {where + part[1]}"
                skipped |= {(part[0], int(i) + part[1]) for i in bad} | ({(part[0], "rest")} if error else set())
                parts += _ranges(part, ok)
            if not parts:
                raise ValueError(f"data.{split}_files: no readable record left after skipping corrupt ones.")
            self.parts[split] = tuple(list(c) for c in zip(*parts))
            self.sizes[split] = sum(t for _, _, t in parts)
        return len(skipped), example

    def find_unreadable(self, decoder) -> str | None:
        for split in ("train", "test"):
            for part in zip(*self.parts[split]):
                ok, error = self.scan(part, decoder)
                bad = np.flatnonzero(~ok)
                if bad.size or error:
                    what = (f"record {int(bad[0]) + part[1]}'s image cannot be decoded" if bad.size else
                            f"record {len(ok) + part[1]} cannot be read ({error})")
                    return (f"data: shard {part[0]}: {what}; rewrite that shard, or set data.skip_corrupt=true to "
                            f"leave unreadable records out (counted)")
        return None

    def _records(self, parts):
        def read(path, skip, take):
            return tf.data.TFRecordDataset(path, compression_type=self.compression).skip(skip).take(take)

        # Sequential: reading records is cheap (decoding, in the parallel map after, is not), and a parallel
        # interleave under symbolic checkpointing crashes TensorFlow 2.21 now and then (a segfault).
        return parts.interleave(read, cycle_length=self.cycle_length)

    def train_keys(self, seed):
        paths, skips, takes = (tf.constant(c, dtype) for c, dtype in zip(self.parts["train"], _PART_TYPES))
        window = self.shuffle_buffer

        def epoch(e):
            key = tf.stack([tf.constant(seed, tf.int64), e])
            order = tf.random.experimental.stateless_shuffle(tf.range(tf.size(paths)), key)
            parts = tf.data.Dataset.from_tensor_slices(order).map(lambda i: (paths[i], skips[i], takes[i]))
            records = self._records(parts)
            if window <= 1:
                return records
            mixed = records.batch(window).enumerate().map(
                lambda w, chunk: tf.random.experimental.stateless_shuffle(
                    chunk, tf.random.experimental.stateless_fold_in(key, w)))
            return mixed.unbatch()

        return tf.data.Dataset.counter().flat_map(epoch)

    def test_keys(self):
        return self._records(tf.data.Dataset.from_tensor_slices(
            tuple(tf.constant(c, dtype) for c, dtype in zip(self.parts["test"], _PART_TYPES))))


class ExampleDecoder:
    """A ``tf.train.Example`` record as its image (``spec``: the image feature, encoded or raw bytes; resized to
    ``shape`` or checked to have its size) and its label (``Labels``: an int64 class number or float targets)."""

    def __init__(self, spec: dict, shape, resize: bool, labels: Labels):
        self.spec, self.shape, self.resize, self.labels = spec, tuple(shape), resize, labels

    def __call__(self, record):
        spec, labels = self.spec, self.labels
        label_spec = (tf.io.FixedLenFeature(labels.target_shape, tf.float32) if labels.floats else
                      tf.io.FixedLenFeature([], tf.int64))
        features = tf.io.parse_single_example(record, {spec["image_key"]: tf.io.FixedLenFeature([], tf.string),
                                                       spec["label_key"]: label_spec})
        data = features[spec["image_key"]]
        label = labels.checked(features[spec["label_key"]], f"a record (data.label_key={spec['label_key']!r})")
        if spec["format"] == "raw":
            values = tf.io.decode_raw(data, spec["dtype"])
            need = int(np.prod(spec["shape"]))
            values = fail_unless(tf.equal(tf.size(values), need), values, f"data.image_key={spec['image_key']!r}: "
                                 f"a record holds ", tf.size(values), f" {spec['dtype'].name} values; data.image_shape="
                                 f"{list(spec['shape'])} needs {need}")
            image = tf.reshape(values, spec["shape"])
            return (tf.image.resize(image, self.shape[:2]) if self.resize else image), label
        image = tf.io.decode_image(data, channels=self.shape[2], expand_animations=False)
        return same_size(image, self.shape, self.resize, f"data.image_key={spec['image_key']!r}: a record's image"), label

    def decodes(self, key):
        """A tensor that exists only once the record's image decodes (what ``skip_corrupt`` checks)."""
        spec = self.spec
        data = tf.io.parse_single_example(key, {spec["image_key"]: tf.io.FixedLenFeature([], tf.string)})
        data = data[spec["image_key"]]
        if spec["format"] == "raw":
            return tf.size(tf.io.decode_raw(data, spec["dtype"]))
        return tf.size(tf.io.decode_image(data, expand_animations=False))


def tfrecord(train_files=None, test_files=None, compression: str | None = None, image_key: str = "image",
             image_format: str = "encoded", image_shape: Sequence[int] | None = None, image_dtype: str = "uint8",
             label_key: str = "label", num_classes: int | None = None, image_size: Sequence[int] | None = None,
             color_mode: str = "rgb", shuffle_buffer: int = 1024, cycle_length: int = 4, rescale="1/255",
             augment: Sequence[str] = (), mean=None, std=None, label_format: str = "class",
             target_shape: Sequence[int] = (), skip_corrupt: bool = False) -> ImagePipeline:
    """TFRecord shards of ``tf.train.Example`` records: an image feature and a label feature (int64 class
    numbers, or float targets).

    Args:
        train_files, test_files: a glob or a list of globs.
        compression: ``None``, ``"GZIP"`` or ``"ZLIB"``.
        image_key: the image feature (bytes).
        image_format: ``encoded`` (JPEG/PNG/BMP/GIF bytes, decoded with ``color_mode``) or ``raw`` (the bytes of
            an array of ``image_dtype`` and ``image_shape`` ``[h, w, c]``).
        label_key: the label feature (int64 class numbers ``0 .. num_classes - 1``).
        num_classes: the number of classes (required for class labels: shards are not read through to count).
        label_format: ``class`` (int64 class numbers) or ``float`` (float targets of ``target_shape`` per example,
            ``[]``: one value; the model then regresses them: mean squared error, metric ``mae``).
        image_size: ``[height, width]`` every image is resized to; ``None``: the first record's size.
        shuffle_buffer: records shuffled together (a window of the interleaved stream; 1: no shuffle).
        cycle_length: shards read at once.
        rescale, augment, mean, std: as for ``image_folder``.
        skip_corrupt: read and decode every record once up front and leave out those that fail (a shard cut
            short keeps its whole records); ``False``: a shard cut short stops the run at the start, a corrupt
            record when it is reached, each naming the shard.
    """
    train, test = _files(train_files, "train_files"), _files(test_files, "test_files")
    spec, labels = _checked_spec(compression, image_key, image_format, image_shape, image_dtype, label_key,
                                 num_classes, color_mode, label_format, target_shape, shuffle_buffer, cycle_length)
    first_image = _check_first_record(train[0], "train_files", spec, compression)
    _check_first_record(test[0], "test_files", spec, compression)
    (train, test), counts, cut = _whole_shards(train, test, compression, skip_corrupt)
    shape = _image_shape(spec, image_size, COLOR_MODES[color_mode], first_image)
    uint8 = image_format == "encoded" or spec["dtype"] == tf.uint8
    pixels = Pixels(shape, parse_rescale(rescale, 1 / 255 if uint8 else 1.0), tuple(parse_augment(augment)),
                    255.0 if uint8 else 1.0, parse_standardize(mean, std, shape[2]))
    sizes = tuple(sum(counts[_path(f)] if isinstance(f, str) else f[2] for f in files) if counts else None
                  for files in (train, test))
    reader = ShardReader(train, test, compression, shuffle_buffer, cycle_length, counts, sizes)
    decoder = ExampleDecoder(spec, shape, image_size is not None, labels)
    info = {"train_files": [_path(f) for f in train], "test_files": [_path(f) for f in test],
            "image_key": image_key, "label_key": label_key}
    if skip_corrupt:
        info.update(skipped_records(reader, decoder, len(cut),
                                    f"{cut[0][0]} record {cut[0][1]} (cut short)" if cut else None))
    return ImagePipeline("tfrecord", reader, decoder, pixels, labels, info)


def skipped_records(reader: ShardReader, decoder, cut: int = 0, cut_example: str | None = None) -> dict:
    """``data.skip_corrupt``: the reader's unreadable records left out (``ShardReader.skip_corrupt``), and the
    count (with the ``cut`` shards' records past their last whole one) and an example, for ``info``."""
    skipped, example = reader.skip_corrupt(decoder)
    example = example or cut_example
    return {"skipped_corrupt": skipped + cut, **({"corrupt_example": example} if example else {})}


def _checked_spec(compression, image_key, image_format, image_shape, image_dtype, label_key, num_classes, color_mode,
                  label_format, target_shape, shuffle_buffer, cycle_length) -> tuple[dict, Labels]:
    """The record's features as ``tfrecord`` reads them (``spec``) and its labels, each argument checked."""
    if compression not in COMPRESSION:
        raise ValueError(f"data.compression={compression!r}: allowed: null, GZIP, ZLIB.")
    if image_format not in FORMATS:
        raise ValueError(f"data.image_format={image_format!r}: allowed: {', '.join(FORMATS)}.")
    if color_mode not in COLOR_MODES:
        raise ValueError(f"data.color_mode={color_mode!r}: allowed: {', '.join(COLOR_MODES)}.")
    if label_format not in LABEL_FORMATS:
        raise ValueError(f"data.label_format={label_format!r}: allowed: {', '.join(LABEL_FORMATS)}.")
    floats = label_format == "float"
    labels = Labels.of(num_classes, list(target_shape or []) if floats else None,
                       "give the number of classes (an integer >= 1; labels are 0 .. num_classes - 1), or set "
                       "data.label_format=float for float targets")
    check_counts(shuffle_buffer=shuffle_buffer, cycle_length=cycle_length)
    try:
        dtype = tf.as_dtype(image_dtype)
    except TypeError:
        raise ValueError(f"data.image_dtype={image_dtype!r}: not a dtype (uint8, float32, ...).") from None
    spec = {"image_key": image_key, "label_key": label_key, "format": image_format, "dtype": dtype,
            "label_kinds": ("float_list", "int64_list") if floats else ("int64_list",),
            "label_size": labels.num_classes if floats else 1}
    if image_format == "raw":
        if image_shape is None or len(image_shape) != 3 or any(not isinstance(d, int) or d < 1 for d in image_shape):
            raise ValueError(f"data.image_shape={image_shape!r}: raw images need their shape [height, width, "
                             f"channels].")
        spec["shape"] = tuple(image_shape)
    return spec, labels


def _whole_shards(train: list, test: list, compression, skip_corrupt: bool):
    """The shards as read: a shard cut short (uncompressed: its record headers walked) refused naming it, or
    (``skip_corrupt``) read to its last whole record as ``(path, 0, records)``. Returns both splits, the records per
    shard (uncompressed shards) and the cut shards ``(path, whole records, offset, size)``."""
    counts, cut = ({}, []) if compression else _count_records(dict.fromkeys(train + test))
    if cut and not skip_corrupt:
        path, records, offset, size = cut[0]
        key = "train_files" if path in train else "test_files"
        raise ValueError(f"data.{key}: {path} is cut short: record {records} (at byte {offset}) runs past its end "
                         f"({size} bytes){f'; {len(cut)} such shards' if len(cut) > 1 else ''}; restore the shard, "
                         f"or set data.skip_corrupt=true to read its {records} whole records.")
    whole = {path: records for path, records, _, _ in cut}  # a shard cut short: its whole records
    return [[(f, 0, whole[f]) if f in whole else f for f in files] for files in (train, test)], counts, cut


def _image_shape(spec: dict, image_size, channels: int, first_image: bytes) -> tuple:
    """``(h, w, c)``: ``image_size``, else a raw image's shape, else the first record's image's size."""
    if spec["format"] == "raw":
        return (*(check_image_size(image_size) or spec["shape"][:2]), spec["shape"][2])
    size = check_image_size(image_size)
    if size is None:
        decoded = tf.io.decode_image(first_image, channels=channels, expand_animations=False)
        size = [int(decoded.shape[0]), int(decoded.shape[1])]
    return (*size, channels)


def _path(part) -> str:
    return part if isinstance(part, str) else part[0]


def _count_records(paths) -> tuple[dict, list]:
    """Records per uncompressed shard, by walking the record headers (lengths; no data is read), and the shards
    cut short: ``(path, whole records, offset of the cut record, file size)``."""
    counts, cut = {}, []
    for path in paths:
        records, offset = walk_records(path)
        counts[path] = records
        if offset is not None:
            cut.append((path, records, offset, os.path.getsize(path)))
    return counts, cut


def walk_records(path: str) -> tuple[int, int | None]:
    """``(whole records, offset of a record that runs past the end or None)`` of a TFRecord file: each record is
    an 8-byte length, 4 bytes of its CRC, the data and 4 bytes of the data's CRC."""
    size = os.path.getsize(path)
    records, offset = 0, 0
    with open(path, "rb") as f:
        while offset < size:
            if size - offset < 12:
                return records, offset
            f.seek(offset)
            length = struct.unpack("<Q", f.read(8))[0]
            end = offset + 16 + length
            if end > size:
                return records, offset
            records, offset = records + 1, end
    return records, None


def _ranges(part, ok: np.ndarray) -> list[tuple[str, int, int]]:
    """The runs of readable records of a shard ``(path, skip, take)`` as ``(path, skip, take)`` parts."""
    path, skip, _ = part
    out, start = [], None
    for i, good in enumerate(list(ok) + [False]):
        if good and start is None:
            start = i
        elif not good and start is not None:
            out.append((path, skip + start, i - start))
            start = None
    return out


def first_line(err) -> str:
    """TensorFlow's error as one line, without its ``{{function_node ...}}`` and ``[Op:...]`` wrapping."""
    text = (getattr(err, "message", None) or str(err)).strip().splitlines()[0] if str(err).strip() else ""
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\].*$", "", text).strip()
    return text or type(err).__name__


def _parts(files) -> tuple[list[str], list[int], list[int]]:
    """Paths, skips and takes of a list of paths or ``(path, skip, take)`` triples."""
    triples = [(f, 0, -1) if isinstance(f, str) else tuple(f) for f in files]
    return [t[0] for t in triples], [int(t[1]) for t in triples], [int(t[2]) for t in triples]


def _files(patterns, key: str) -> list[str]:
    if patterns is None:
        raise ValueError(f"data.{key}: give the TFRecord shards, a glob such as /data/train-*.tfrecord or a list.")
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    found = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(str(pattern))))
        if not matches:
            raise ValueError(f"data.{key}: {pattern!r} matches no file.")
        files = [os.path.abspath(m) for m in matches if os.path.isfile(m)]
        if not files:
            raise ValueError(f"data.{key}: {pattern!r} matches only folder(s) ({', '.join(matches[:3])}); give the "
                             f"shard files, e.g. {os.path.join(str(pattern), '*.tfrecord')!r}.")
        found += files
    return list(dict.fromkeys(found))


def _compression_hint(path: str, compression) -> str:
    """What the file's first bytes say about its compression, as advice on ``data.compression``."""
    with open(path, "rb") as f:
        head = f.read(2)
    actual = "GZIP" if head == b"\x1f\x8b" else "ZLIB" if head[:1] == b"\x78" else None
    if actual and actual != compression:
        return f"; it looks {actual}-compressed: set data.compression={actual}"
    if compression and not actual:
        return f"; it does not look {compression}-compressed: try data.compression=null"
    return "; data.compression allows null, GZIP, ZLIB"


def _check_first_record(path: str, key: str, spec: dict, compression) -> bytes:
    """The image bytes of the file's first record, after checking it holds the features the config names."""
    path = _path(path)
    try:
        record = next(iter(tf.data.TFRecordDataset(path, compression_type=compression or "").take(1)), None)
    except tf.errors.OpError as err:
        raise ValueError(f"data.{key}: {path!r} is not a readable TFRecord file with data.compression="
                         f"{compression or 'null'} ({first_line(err)}){_compression_hint(path, compression)}.") from None
    if record is None:
        raise ValueError(f"data.{key}: {path!r} holds no records.")
    example = tf.train.Example()
    try:
        example.ParseFromString(record.numpy())
    except Exception:  # noqa: BLE001 - protobuf's DecodeError
        raise ValueError(f"data.{key}: the records of {path!r} are not tf.train.Example protos.") from None
    features = example.features.feature
    held = {name: f.WhichOneof("kind") for name, f in features.items()}
    have = ", ".join(f"{n} ({k})" for n, k in sorted(held.items())) or "none"
    for role, name, kinds in (("image_key", spec["image_key"], ("bytes_list",)),
                              ("label_key", spec["label_key"], spec["label_kinds"])):
        if name not in held:
            raise ValueError(f"data.{role}={name!r}: the records of {path!r} have no feature {name!r}; they have: "
                             f"{have}.")
        if held[name] not in kinds:
            floats = "float_list" in spec["label_kinds"]
            what = ("encoded image bytes or a raw array's bytes" if role == "image_key" else
                    "float targets" if floats else
                    "int64 class numbers; for float targets set data.label_format=float")
            raise ValueError(f"data.{role}={name!r}: in {path!r} it is a {held[name]}, expected "
                             f"{' or '.join(kinds)} ({what}).")
    label = getattr(features[spec["label_key"]], held[spec["label_key"]]).value
    if len(label) != spec["label_size"]:
        raise ValueError(f"data.label_key={spec['label_key']!r}: a record of {path!r} holds {len(label)} value(s); "
                         f"expected {spec['label_size']}" + (" (data.target_shape)" if "float_list" in
                                                              spec["label_kinds"] else " (one class number)") + ".")
    data = features[spec["image_key"]].bytes_list.value[0]
    if spec["format"] == "raw":
        need = int(np.prod(spec["shape"])) * spec["dtype"].size
        if len(data) != need:
            raise ValueError(f"data.image_key={spec['image_key']!r}: a record of {path!r} holds {len(data)} bytes; "
                             f"data.image_shape={list(spec['shape'])} of {spec['dtype'].name} needs {need}.")
    else:
        try:
            tf.io.decode_image(data, expand_animations=False)
        except tf.errors.OpError:
            raise ValueError(f"data.image_key={spec['image_key']!r}: the first record of {path!r} is not an encoded "
                             f"image (JPEG, PNG, BMP, GIF); for an array's bytes set data.image_format=raw.") from None
    return data
