"""``StreamSource``: labelled images read from disk example by example by ``tf.data``, never all in memory.

A subclass says where examples come from; this class turns them into the batches the runner trains on:

- ``_train_stream(seed)``: an endless ``tf.data.Dataset`` of *keys* (a file index, a serialized record, ...),
  in an order drawn from ``seed`` alone (stateless per-epoch shuffles);
- ``_test_stream()``: one finite pass over the held-out keys, in a fixed order;
- ``_load(key) -> (image, label)``: the raw image ``[h, w, c]`` (any numeric dtype, ``image_shape`` after
  loading) and its int32 label; the graph runs in parallel (``num_parallel_calls``) and in order.

Every example then becomes ``float32(image) * rescale``, augmented (training only) with keys drawn from
``(seed, position in the stream)``. Nothing random is stateful, so the iterator is saved *symbolically*
(counters and file offsets, kilobytes, not its buffers) and a resumed run continues with the very batches an
uninterrupted one would see.

Under a multi-worker run (``shard=(index, count)``) each process reads and decodes only the rows of each
global batch that its replicas train on (rows ``index*B/count .. (index+1)*B/count``); the other rows are
zeros that no replica reads. The examples of a step therefore do not depend on the number of workers.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Sequence

import numpy as np
import tensorflow as tf

from ._source import AUTOTUNE, check_batch_size, check_seed

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


class StreamSource:
    """Images streamed from disk: the common pipeline of ``image_folder``, ``arrays`` and ``tfrecord``.

    Args:
        name: the data set's name.
        image_shape: ``(h, w, c)`` of every loaded image.
        num_classes: labels are ``0 .. num_classes - 1``.
        train_size, test_size: examples per split (``None`` where unknown without reading everything).
        rescale: factor applied to the loaded values (``1/255``: uint8 pixels to [0, 1]).
        augment: ``parse_augment``'s list; applied to training batches only.
        max_value: the largest stored value (255 for 8-bit images), for brightness.
        info: what the run records about the data (class names, files, skipped files ...).
        standardize: ``parse_standardize``'s ``(mean, std)``, applied after rescale and augmentation.
        target_shape: float targets of this shape per example (regression: mean squared error, metric ``mae``)
            instead of class numbers; ``num_classes`` is then ignored.
    """

    metric = "accuracy"
    metric_direction = "maximize"  # higher is better (runner.config.direction: what a sweep optimizes)

    def __init__(self, name: str, image_shape, num_classes: int, train_size: int | None, test_size: int | None,
                 rescale: float = 1.0, augment=(), max_value: float = 255.0, info: dict | None = None,
                 standardize=None, target_shape=None):
        self.name = name
        self.image_shape = tuple(int(d) for d in image_shape)
        self.target_shape = None if target_shape is None else tuple(int(d) for d in target_shape)
        if self.target_shape is not None:  # regression: an instance's metric, not the class's accuracy
            self.metric, self.metric_direction = "mae", "minimize"
            num_classes = int(np.prod(self.target_shape))
        self.num_classes = int(num_classes)
        self.train_size, self.test_size = train_size, test_size
        self.rescale = float(rescale)
        self.augment = list(augment)
        self.max_value = float(max_value)
        self.standardize = standardize
        self.model_args = {"num_classes": self.num_classes, "input_shape": self.image_shape}
        if self.target_shape is not None:
            self.model_args["targets"] = "float"
        self.info = {"source": name, "image_shape": list(self.image_shape), "num_classes": self.num_classes,
                     "train_size": train_size, "test_size": test_size, "rescale": self.rescale,
                     "augment": [n if s is None else f"{n}:{s:g}" for n, s in self.augment],
                     **({"mean": list(standardize[0]), "std": list(standardize[1])} if standardize else {}),
                     **({"targets": "float", "target_shape": list(self.target_shape)} if self.target_shape is not None
                        else {}),
                     **(info or {})}

    # ------------------------------------------------------------------ what a subclass provides
    def _train_stream(self, seed: int) -> tf.data.Dataset:
        raise NotImplementedError

    def _test_stream(self) -> tf.data.Dataset:
        raise NotImplementedError

    def _load(self, key):
        raise NotImplementedError

    # ------------------------------------------------------------------ the contract
    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless ``{"image", "label"}`` batches of exactly ``batch_size``, spanning epochs.

        ``shard=(index, count)``: this process loads only its rows of each batch (the rest are zeros)."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        rows = check_shard(shard, batch_size)

        def example(position, key):
            def load():
                image, label = self._example(key)
                k = tf.stack([tf.constant(seed, tf.int64) + 1, position])
                image = augment_image(image, self.augment, k, self.max_value * self.rescale)
                return self._standardized(image), label

            if rows is None:
                image, label = load()
            else:
                row = position % batch_size
                mine = tf.logical_and(row >= rows[0], row < rows[1])
                image, label = tf.cond(mine, load, lambda: (tf.zeros(self.image_shape), self._no_label()))
            return {"image": image, "label": label}

        ds = self._train_stream(seed).enumerate()
        ds = ds.map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
        return _checkpointable(ds.batch(batch_size, drop_remainder=True).prefetch(AUTOTUNE))

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """One pass over the test split in a fixed order, ``{"image", "label"}`` batches (the last may be smaller)."""
        batch_size = check_batch_size(batch_size)

        def example(*key):
            image, label = self._example(key[0] if len(key) == 1 else key)
            return {"image": self._standardized(image), "label": label}

        ds = self._test_stream().map(example, num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds.batch(batch_size).prefetch(AUTOTUNE)

    def describe(self) -> str:
        """One line for the run's header: what the model receives."""
        aug = ", augment " + " ".join(self.info["augment"]) if self.augment else ""
        sizes = f"{self.train_size if self.train_size is not None else '?'} train / " \
                f"{self.test_size if self.test_size is not None else '?'} test"
        skipped = self.info.get("skipped_corrupt")
        notes = "".join(f", {note}" for note in self.info.get("notes", []))
        values = f"values 0..{self.max_value * self.rescale:g}"
        if self.standardize:
            values += f", then (x - mean {_short(self.standardize[0])}) / std {_short(self.standardize[1])}"
        labels = f"{self.num_classes} classes" if self.target_shape is None else \
            f"float targets {list(self.target_shape)}"
        return (f"{self.name}: {sizes}, images {list(self.image_shape)}, {labels}, "
                f"rescale {_fraction(self.rescale)} ({values}){aug}"
                + (f", {skipped} corrupt {self._unit}(s) skipped" if skipped else "")
                + (f" (e.g. {self.info['corrupt_example']})" if skipped and self.info.get("corrupt_example") else "")
                + notes)

    _unit = "file"  # what ``skipped_corrupt`` counts

    def fingerprint(self) -> dict | None:
        """What the data is, for a resume to compare (``_fingerprint``); ``None``: not known. Computed once."""
        if not hasattr(self, "_fingerprint_cache"):
            self._fingerprint_cache = self._fingerprint()
        return self._fingerprint_cache

    def _fingerprint(self) -> dict | None:
        return None

    def find_unreadable(self) -> str | None:
        """After a read or decode failure that names no file: which file or record it is, as one line."""
        return None

    def _standardized(self, image):
        if not self.standardize:
            return image
        mean, std = (tf.constant(v, tf.float32) for v in self.standardize)
        return (image - mean) / std

    def _example(self, key):
        image, label = self._load(key)
        image = tf.ensure_shape(image, self.image_shape)
        image = tf.cast(image, tf.float32)
        if self.rescale != 1.0:
            image = image * self.rescale
        if self.target_shape is not None:
            return image, tf.reshape(tf.cast(label, tf.float32), self.target_shape)
        return image, tf.cast(label, tf.int32)

    def _no_label(self):
        if self.target_shape is not None:
            return tf.zeros(self.target_shape, tf.float32)
        return tf.constant(0, tf.int32)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


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
