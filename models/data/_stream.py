"""The streamed image pipeline: labelled images read example by example by ``tf.data``, never all in memory.

A source is composed, not subclassed: a ``Reader`` says where examples come from (the files of a folder, TFRecord
shards, a TFDS split, array rows) as *keys*; a ``Decoder`` turns a key into the stored image and its label;
``ImagePipeline`` makes the batches the runner trains on (``Pixels``: rescale, augmentation, standardization;
``Labels``: class numbers or float targets, checked once by ``Labels.of``). The factories (``image_folder``,
``tfrecord``, ``tfds``, ``arrays``) validate their arguments, then build the three.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import tensorflow as tf

from ._source import AUTOTUNE, check_batch_size, check_seed
from .source import BaseSource

AUGMENTATIONS = {  # name: (default strength, what the strength means)
    "flip": (None, "mirror left-right with probability 1/2"),
    "flip_vertical": (None, "mirror top-bottom with probability 1/2"),
    "translate": (0.1, "shift by up to this fraction of the side (>= 1: pixels), zero-filled"),
    "crop": (0.9, "crop a random window of this fraction of the side, resized back"),
    "contrast": (0.2, "scale contrast by a factor in [1 - s, 1 + s]"),
    "brightness": (0.1, "add up to +-s times the largest pixel value"),
}


def parse_rescale(value, default: float) -> float:
    """``data.rescale``: a number, a fraction such as ``"1/255"``, or ``None`` for the source's default."""
    if value is None:
        return float(default)
    if isinstance(value, str):
        try:
            value = float(Fraction(value.strip()))
        except (ValueError, ZeroDivisionError):
            value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise ValueError(f"rescale={value!r}: must be a positive number or a fraction such as '1/255' "
                         f"(1: the model sees the stored values).")
    return float(value)


def parse_standardize(mean, std, channels: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """``data.mean`` / ``data.std``: a number or one per channel, applied after ``rescale`` (``None``: off)."""
    if mean is None and std is None:
        return None

    def values(key, value, default, positive):
        value = default if value is None else value
        items = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
        ok = len(items) in (1, channels) and all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and np.isfinite(v) and (v > 0 or not positive)
            for v in items)
        if not ok:
            raise ValueError(f"data.{key}={value!r}: must be a number or a list of {channels} (one per channel)"
                             + (", each > 0" if positive else "") + ", applied after rescale: (x - mean) / std.")
        return tuple(float(v) for v in (items * channels if len(items) == 1 else items))

    return values("mean", mean, 0.0, False), values("std", std, 1.0, True)


def check_counts(**values) -> None:
    """Each ``data.<key>=value`` an integer >= 1, or a ValueError naming it."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"data.{key}={value!r}: must be an integer >= 1.")


def check_image_size(image_size) -> list[int] | None:
    """``data.image_size``: ``[height, width]`` (two integers >= 1) or ``None``."""
    if image_size is None:
        return None
    size = list(image_size) if isinstance(image_size, Sequence) and not isinstance(image_size, str) else None
    if size is None or len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in size):
        raise ValueError(f"data.image_size={image_size!r}: must be [height, width], two integers >= 1.")
    return size


def parse_augment(augment) -> list[tuple[str, float | None]]:
    """``data.augment``: a list of names, each optionally ``name:strength`` (``[flip, translate:0.125]``)."""
    if augment is None:
        return []
    if isinstance(augment, str) or not isinstance(augment, Sequence):
        raise ValueError(f"augment={augment!r}: must be a list of names such as [flip, translate:0.1]; allowed: "
                         f"{', '.join(AUGMENTATIONS)}.")
    out = []
    for item in augment:
        name, _, strength = str(item).partition(":")
        name = name.strip()
        if name not in AUGMENTATIONS:
            raise ValueError(f"augment: unknown augmentation {item!r}; allowed: {', '.join(AUGMENTATIONS)} "
                             f"(optionally name:strength, e.g. translate:0.1).")
        default = AUGMENTATIONS[name][0]
        if strength and default is None:
            raise ValueError(f"augment: {name} takes no strength; got {item!r}.")
        try:
            value = float(strength) if strength else default
        except ValueError:
            value = -1.0
        if value is not None and not (value > 0 and (name != "crop" or value <= 1)):
            raise ValueError(f"augment: {item!r}: the strength must be a positive number"
                             + (" up to 1" if name == "crop" else "") + f" ({AUGMENTATIONS[name][1]}).")
        out.append((name, value))
    return out


def augment_image(image, augmentations, key, max_value: float):
    """``image`` [h, w, c] float32 with each augmentation applied, each with its own key split from ``key``."""
    if not augmentations:
        return image
    keys = tf.random.experimental.stateless_split(key, len(augmentations))
    h, w = image.shape[0], image.shape[1]
    for (name, s), k in zip(augmentations, tf.unstack(keys)):
        if name == "flip":
            image = tf.image.stateless_random_flip_left_right(image, k)
        elif name == "flip_vertical":
            image = tf.image.stateless_random_flip_up_down(image, k)
        elif name == "translate":
            dy, dx = (int(round(s)), int(round(s))) if s >= 1 else (int(round(s * h)), int(round(s * w)))
            if dy or dx:
                padded = tf.pad(image, [[dy, dy], [dx, dx], [0, 0]])
                image = tf.image.stateless_random_crop(padded, [h, w, image.shape[2]], k)
        elif name == "crop":
            size = [max(1, int(round(s * h))), max(1, int(round(s * w))), image.shape[2]]
            image = tf.image.resize(tf.image.stateless_random_crop(image, size, k), [h, w])
        elif name == "contrast":
            image = tf.image.stateless_random_contrast(image, max(0.0, 1 - s), 1 + s, k)
        elif name == "brightness":
            image = tf.image.stateless_random_brightness(image, s * max_value, k)
    return image


def shuffled_indices(n: int, seed: int) -> tf.data.Dataset:
    """Endless ``0..n-1``, each epoch a permutation drawn from ``(seed, epoch)`` (``ImageSource``'s order)."""

    def epoch(e):
        key = tf.stack([tf.constant(seed, tf.int64), e])
        return tf.data.Dataset.from_tensor_slices(tf.random.experimental.stateless_shuffle(tf.range(n), key))

    return tf.data.Dataset.counter().flat_map(epoch)


def check_shard(shard, batch_size: int):
    if shard is None:
        return None
    index, count = (int(v) for v in shard)
    if not (count >= 1 and 0 <= index < count) or batch_size % count:
        raise ValueError(f"shard={tuple(shard)!r}: need 0 <= index < count and a batch ({batch_size}) that "
                         f"divides by count.")
    return index * batch_size // count, (index + 1) * batch_size // count


@dataclass(frozen=True)
class Labels:
    """What a label is: a class number ``0 .. num_classes - 1``, or float targets of ``target_shape`` (regression:
    mean squared error, metric ``mae``). Made by ``Labels.of``, the one check of a class count or a target shape."""

    num_classes: int
    target_shape: tuple | None = None

    @classmethod
    def of(cls, num_classes=None, target_shape=None, hint: str = "must be an integer >= 1") -> Labels:
        """Class numbers (``target_shape`` None: ``num_classes`` an integer >= 1, else ``data.num_classes=...:
        <hint>``) or float targets of ``target_shape`` (integers >= 1; ``[]``: one value)."""
        if target_shape is not None:
            shape = list(target_shape)
            if any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
                raise ValueError(f"data.target_shape={shape!r}: the shape of one example's targets, integers >= 1 "
                                 f"([] for one value).")
            return cls(int(np.prod(shape)), tuple(int(d) for d in shape))
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise ValueError(f"data.num_classes={num_classes!r}: {hint}.")
        return cls(int(num_classes))

    @property
    def floats(self) -> bool:
        return self.target_shape is not None

    def checked(self, label, where):
        """A decoded class number, checked in the class range (else the pipeline stops naming ``where``); float
        targets as they are."""
        return label if self.floats else check_label(label, self.num_classes, where)

    def cast(self, label):
        """A label as the batch holds it: int32 class numbers, or float32 targets of their shape."""
        if self.floats:
            return tf.reshape(tf.cast(label, tf.float32), self.target_shape)
        return tf.cast(label, tf.int32)

    def zero(self):
        return tf.zeros(self.target_shape, tf.float32) if self.floats else tf.constant(0, tf.int32)

    def describe(self) -> str:
        return f"float targets {list(self.target_shape)}" if self.floats else f"{self.num_classes} classes"


@dataclass(frozen=True)
class Pixels:
    """What the model receives of an image: its shape ``(h, w, c)``, ``float32(stored) * rescale``, training
    augmentations (``parse_augment``'s list; ``max_value``: the largest stored value, for brightness), then
    ``(x - mean) / std`` where ``standardize`` (``parse_standardize``'s pair) is set."""

    shape: tuple
    rescale: float = 1.0
    augment: tuple = ()
    max_value: float = 255.0
    standardize: tuple | None = None

    def scaled(self, image):
        image = tf.cast(tf.ensure_shape(image, self.shape), tf.float32)
        return image * self.rescale if self.rescale != 1.0 else image

    def augmented(self, image, key):
        return augment_image(image, self.augment, key, self.max_value * self.rescale)

    def standardized(self, image):
        if not self.standardize:
            return image
        mean, std = (tf.constant(v, tf.float32) for v in self.standardize)
        return (image - mean) / std

    def describe(self, labels: str) -> str:
        """``images [h, w, c], <labels>, rescale 1/255 (values 0..1)``, and the augmentations."""
        values = f"values 0..{self.max_value * self.rescale:g}"
        if self.standardize:
            values += f", then (x - mean {_short(self.standardize[0])}) / std {_short(self.standardize[1])}"
        aug = ", augment " + " ".join(self.augment_names()) if self.augment else ""
        return f"images {list(self.shape)}, {labels}, rescale {_fraction(self.rescale)} ({values}){aug}"

    def augment_names(self) -> list[str]:
        return [n if s is None else f"{n}:{s:g}" for n, s in self.augment]


@runtime_checkable
class Reader(Protocol):
    """Where the examples of a streamed source come from: *keys* (a file path and its label, a serialized record,
    an array row), which a ``Decoder`` turns into images. ``unit``: what a key is, in words (``file``, ``record``)."""

    unit: str
    train_size: int | None
    test_size: int | None

    def train_keys(self, seed: int) -> tf.data.Dataset:
        """Endless keys in an order drawn from ``seed`` alone (stateless per-epoch shuffles)."""

    def test_keys(self) -> tf.data.Dataset:
        """One finite pass over the held-out keys, in a fixed order."""

    def fingerprint(self) -> dict:
        """What the keys are read from (``files``, ``shards``, ``arrays`` and ``rows``: ``models.data._fingerprint``)."""

    def find_unreadable(self, decoder: Decoder) -> str | None:
        """After a failure that names no file: which file or record fails ``decoder.decodes``, as one line."""


@runtime_checkable
class Decoder(Protocol):
    """A key as the stored image ``[h, w, c]`` (any numeric dtype; the size checked or resized) and its label
    (``Labels.checked``), in graph code that runs in parallel."""

    def __call__(self, key) -> tuple[tf.Tensor, tf.Tensor]: ...

    def decodes(self, key) -> tf.Tensor:
        """A tensor that exists only once the key's image decodes (what ``skip_corrupt`` checks)."""


class ImagePipeline(BaseSource):
    """Images streamed from a reader through a decoder: the one pipeline of ``image_folder``, ``arrays``,
    ``tfrecord`` and ``tfds`` (a new format is a ``Reader`` and a ``Decoder``; docs/DATA.md).

    Every key becomes ``Pixels.scaled(image)``, augmented (training only) with keys drawn from ``(seed, position in
    the stream)``, then standardized. Nothing random is stateful, so the iterator is saved *symbolically* (counters
    and file offsets, kilobytes, not its buffers) and a resumed run continues with the very batches an
    uninterrupted one would see. Under a multi-worker run (``shard=(index, count)``) each process reads and decodes
    only the rows of each global batch that its replicas train on; the other rows are zeros that no replica reads.

    Args:
        name: the data set's name.
        reader: a ``Reader``; decoder: a ``Decoder`` of its keys.
        pixels: what the model receives of an image (``Pixels``); labels: what a label is (``Labels``).
        info: what the run records about the data (class names, files, skipped files ...), beside the pipeline's own.
        identity: what the data is beyond the reader's files (classes, a TFDS version), for ``fingerprint``.
        class_names: the classes' names by number, where the source knows them.
    """

    metric = "accuracy"
    metric_direction = "maximize"  # higher is better (runner.config.direction: what a sweep optimizes)

    def __init__(self, name: str, reader: Reader, decoder: Decoder, pixels: Pixels, labels: Labels,
                 info: dict | None = None, identity: dict | None = None, class_names=None):
        self.name, self.reader, self.decoder, self.pixels, self.labels = name, reader, decoder, pixels, labels
        self.class_names = None if class_names is None else list(class_names)
        self.identity = dict(identity or {})
        if labels.floats:  # regression: an instance's metric, not the class's accuracy
            self.metric, self.metric_direction = "mae", "minimize"
        self.info = {"source": name, "image_shape": list(pixels.shape), "num_classes": labels.num_classes,
                     "train_size": reader.train_size, "test_size": reader.test_size, "rescale": pixels.rescale,
                     "augment": pixels.augment_names(),
                     **({"mean": list(pixels.standardize[0]), "std": list(pixels.standardize[1])}
                        if pixels.standardize else {}),
                     **({"targets": "float", "target_shape": list(labels.target_shape)} if labels.floats else {}),
                     **(info or {})}
        self._fingerprint = None

    @property
    def model_args(self) -> dict:
        return {"num_classes": self.labels.num_classes, "input_shape": self.pixels.shape,
                **({"targets": "float"} if self.labels.floats else {})}

    @property
    def train_size(self) -> int | None:
        return self.reader.train_size

    @property
    def test_size(self) -> int | None:
        return self.reader.test_size

    @property
    def image_shape(self) -> tuple:
        return self.pixels.shape

    @property
    def rescale(self) -> float:
        return self.pixels.rescale

    # ------------------------------------------------------------------ the contract
    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless ``{"image", "label"}`` batches of exactly ``batch_size``, spanning epochs.

        ``shard=(index, count)``: this process loads only its rows of each batch (the rest are zeros)."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        rows = check_shard(shard, batch_size)
        pixels, labels = self.pixels, self.labels

        def example(position, key):
            def load():
                image, label = self._example(key)
                image = pixels.augmented(image, tf.stack([tf.constant(seed, tf.int64) + 1, position]))
                return pixels.standardized(image), label

            if rows is None:
                image, label = load()
            else:
                row = position % batch_size
                mine = tf.logical_and(row >= rows[0], row < rows[1])
                image, label = tf.cond(mine, load, lambda: (tf.zeros(pixels.shape), labels.zero()))
            return {"image": image, "label": label}

        ds = self.reader.train_keys(seed).enumerate()
        ds = ds.map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
        return _checkpointable(ds.batch(batch_size, drop_remainder=True).prefetch(AUTOTUNE))

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """One pass over the test split in a fixed order, ``{"image", "label"}`` batches (the last may be smaller)."""
        batch_size = check_batch_size(batch_size)

        def example(*key):
            image, label = self._example(key[0] if len(key) == 1 else key)
            return {"image": self.pixels.standardized(image), "label": label}

        ds = self.reader.test_keys().map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds.batch(batch_size).prefetch(AUTOTUNE)

    def describe(self) -> str:
        """One line for the run's header: what the model receives."""
        sizes = f"{self.train_size if self.train_size is not None else '?'} train / " \
                f"{self.test_size if self.test_size is not None else '?'} test"
        skipped = self.info.get("skipped_corrupt")
        notes = "".join(f", {note}" for note in self.info.get("notes", []))
        return (f"{self.name}: {sizes}, " + self.pixels.describe(self.labels.describe())
                + (f", {skipped} corrupt {self.reader.unit}(s) skipped" if skipped else "")
                + (f" (e.g. {self.info['corrupt_example']})" if skipped and self.info.get("corrupt_example") else "")
                + notes)

    def fingerprint(self) -> dict:
        """What the data is, for a resume to compare (``_fingerprint``): the reader's files and the identity given.
        Computed once."""
        if self._fingerprint is None:
            self._fingerprint = {"source": self.name, **self.identity, **self.reader.fingerprint()}
        return self._fingerprint

    def find_unreadable(self) -> str | None:
        """After a read or decode failure that names no file: which file or record it is, as one line."""
        return self.reader.find_unreadable(self.decoder)

    def _example(self, key):
        image, label = self.decoder(key)
        return self.pixels.scaled(image), self.labels.cast(label)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


def same_size(image, shape, resize: bool, *what, first: str = "the first"):
    """``image`` resized to ``shape``'s height and width (``resize``), else checked to have them: the pipeline stops
    with ``<what> is HxW but <first> is hxw; set data.image_size=...``."""
    h, w = shape[0], shape[1]
    if resize:
        return tf.image.resize(image, [h, w])
    size = tf.shape(image)
    ok = tf.logical_and(tf.equal(size[0], h), tf.equal(size[1], w))
    return fail_unless(ok, image, *what, " is ", size[0], "x", size[1], f" but {first} is {h}x{w}; set "
                       f"data.image_size=[height,width] to resize every image")


def fail_unless(ok, value, *parts):
    """``value``, after checking ``ok``; otherwise the pipeline stops with the message ``parts`` (strings and
    scalar tensors) as one line (``runner`` strips TensorFlow's ``assertion failed: [...]`` around it)."""
    text = tf.strings.join([p if isinstance(p, str) or p.dtype == tf.string else tf.strings.as_string(p)
                            for p in parts])
    with tf.control_dependencies([tf.debugging.Assert(ok, [text], summarize=1)]):
        return tf.nest.map_structure(tf.identity, value)


def check_label(label, num_classes: int, where):
    """``label``, or an error naming ``where`` when it is outside ``0 .. num_classes - 1``."""
    label = tf.cast(label, tf.int64)
    ok = tf.logical_and(label >= 0, label < num_classes)
    return fail_unless(ok, label, "data: label ", label, " of ", where, f" is outside the class range 0.."
                       f"{num_classes - 1}")


def _checkpointable(ds: tf.data.Dataset) -> tf.data.Dataset:
    """Checkpoint the iterator as counters and offsets, not its buffered batches (every op here is stateless)."""
    options = tf.data.Options()
    options.experimental_symbolic_checkpoint = True
    return ds.with_options(options)


def _fraction(x: float) -> str:
    f = Fraction(x).limit_denominator(1000)
    return f"{f.numerator}/{f.denominator}" if f.denominator != 1 and abs(float(f) - x) < 1e-12 else f"{x:g}"


def _short(values) -> str:
    return f"{values[0]:g}" if len(set(values)) == 1 else "[" + ", ".join(f"{v:g}" for v in values) + "]"
