"""A TensorFlow Datasets image-classification data set, by name, from its prepared TFRecord shards.

The split (TFDS syntax: ``train``, ``train[:90%]``, ``train[10%:]+test``) becomes shards and record ranges that
``tfrecord``'s ``ShardReader`` streams (stateless shuffles, exact resume); each record is decoded by the data set's
own features (``FeatureDecoder``). ``download=true`` prepares a missing data set where the network allows.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Sequence

import tensorflow as tf

from ._stream import (ImagePipeline, Labels, Pixels, check_counts, check_image_size, parse_augment, parse_rescale,
                      parse_standardize, same_size)
from .tfrecord import ShardReader, skipped_records

_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


class FeatureDecoder:
    """A record of a prepared TFDS data set as its image and label, decoded by the data set's own features; the
    image resized to ``shape`` or checked to have its size."""

    def __init__(self, features, spec: dict, shape, resize: bool, labels: Labels, name: str):
        self.features, self.spec, self.shape, self.resize, self.labels, self.name = (features, spec, tuple(shape),
                                                                                     resize, labels, name)

    def __call__(self, record):
        spec = self.spec
        example = self.features.deserialize_example(record)
        label = self.labels.checked(example[spec["label_key"]], f"an example (data.label_key={spec['label_key']!r})")
        return same_size(example[spec["image_key"]], self.shape, self.resize, f"data.name={self.name!r}: an image"), \
            label

    def decodes(self, key):
        return tf.size(self.features.deserialize_example(key)[self.spec["image_key"]])


def tfds(name: str | None = None, data_dir: str | None = None, train_split: str = "train",
         test_split: str = "test", download: bool = False, image_key: str | None = None,
         label_key: str | None = None, num_classes: int | None = None, image_size: Sequence[int] | None = None,
         shuffle_buffer: int = 1024, cycle_length: int = 4, rescale=None, augment: Sequence[str] = (),
         mean=None, std=None, skip_corrupt: bool = False) -> ImagePipeline:
    """A TFDS image-classification data set (``mnist``, ``cifar10``, ``imagenette/320px``, your own builder's).

    Args:
        name: the data set's TFDS name, optionally with config and version (``cifar10``, ``mnist:3.0.1``).
        data_dir: where prepared data sets live (``None``: TFDS's default, ``~/tensorflow_datasets`` or
            ``$TFDS_DATA_DIR``).
        train_split, test_split: TFDS split expressions (``train[:90%]``, ``train[90%:]``).
        download: prepare the data set in ``data_dir`` when it is not there (needs the network).
        image_key, label_key: the features; ``None``: the data set's supervised keys, else ``image``/``label``.
        num_classes: only for a label feature that is a plain integer (a ``ClassLabel`` knows its classes).
        image_size: ``[height, width]`` every image is resized to; ``None``: the data set's fixed size, or the
            first image's (others must match).
        shuffle_buffer, cycle_length, rescale, augment, mean, std, skip_corrupt: as for ``tfrecord`` (a shard
            holding fewer whole records than the data set's info says is cut short).
    """
    tfds_lib = _import_tfds()
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"data.name={name!r}: give a TensorFlow Datasets name such as mnist, cifar10 or "
                         f"imagenette/320px (https://www.tensorflow.org/datasets/catalog).")
    builder = _builder(tfds_lib, name, data_dir)
    info = _prepared_info(builder, name, download)
    image_key, label_key, image_feature = _keys(info, image_key, label_key, name, tfds_lib)
    labels, class_names = _labels(tfds_lib, info.features[label_key], label_key, num_classes, name)
    check_counts(shuffle_buffer=shuffle_buffer, cycle_length=cycle_length)
    train, test, cut = _whole_records(_split(info, train_split, "train_split", name),
                                      _split(info, test_split, "test_split", name), name, skip_corrupt)
    shape = (*_image_size(image_size, image_feature, info.features, image_key, train[0]), image_feature.shape[2])
    uint8 = tf.as_dtype(image_feature.tf_dtype) == tf.uint8
    pixels = Pixels(shape, parse_rescale(rescale, 1 / 255 if uint8 else 1.0), tuple(parse_augment(augment)),
                    255.0 if uint8 else 1.0, parse_standardize(mean, std, shape[2]))
    reader = ShardReader(train, test, None, shuffle_buffer, cycle_length,
                         sizes=[sum(t for _, _, t in parts) for parts in (train, test)])
    decoder = FeatureDecoder(info.features, {"image_key": image_key, "label_key": label_key}, shape,
                             image_size is not None, labels, name)
    record = {"tfds_name": name, "data_dir": _where(builder), "version": str(builder.version),
              "train_split": train_split, "test_split": test_split, "image_key": image_key, "label_key": label_key,
              **({"class_names": class_names} if class_names is not None else {}),
              **(skipped_records(reader, decoder, cut) if skip_corrupt else {})}
    identity = {"tfds": f"{name} {builder.version}", "splits": {train_split: reader.train_size,
                                                                 test_split: reader.test_size},
                **({"classes": {c: i for i, c in enumerate(class_names)}} if class_names else {})}
    return ImagePipeline("tfds", reader, decoder, pixels, labels, record, identity, class_names)


def _prepared_info(builder, name: str, download: bool):
    """The data set's info, prepared first where ``download`` (else a one-line refusal); TFRecord files only."""
    if not _prepared(builder):
        if not download:
            raise FileNotFoundError(f"data.name={name!r} is not prepared in {_where(builder)}: set "
                                    f"data.download=true where the network allows, or run `tfds build {name} "
                                    f"--data_dir DIR` on a machine with network access and copy DIR here "
                                    f"(data.data_dir=DIR).")
        _download(builder, name)
    info = builder.info
    if str(info.file_format).split(".")[-1].lower() != "tfrecord":
        raise ValueError(f"data.name={name!r}: prepared as {info.file_format}; only TFRecord data sets are read "
                         f"(prepare it with file_format=tfrecord).")
    return info


def _keys(info, image_key, label_key, name: str, tfds_lib):
    """The image and label features' keys (given, else the supervised keys, else image/label) and the image
    feature, checked to be an image ``[height, width, channels]``."""
    keys = tuple(info.supervised_keys or ()) if not isinstance(info.supervised_keys, dict) else ()
    image_key = image_key or (keys[0] if len(keys) == 2 and isinstance(keys[0], str) else "image")
    label_key = label_key or (keys[1] if len(keys) == 2 and isinstance(keys[1], str) else "label")
    image_feature = _feature(info.features, image_key, "image_key", name)
    _feature(info.features, label_key, "label_key", name)
    if not isinstance(image_feature, tfds_lib.features.Image) or len(tuple(image_feature.shape)) != 3:
        raise ValueError(f"data.image_key={image_key!r}: in {name!r} it is {image_feature!r}, not an image "
                         f"[height, width, channels].")
    return image_key, label_key, image_feature


def _labels(tfds_lib, feature, label_key: str, num_classes, name: str) -> tuple[Labels, list | None]:
    """A ``ClassLabel``'s classes and names, float targets of a fixed shape, or a plain integer's ``num_classes``."""
    dtype = tf.as_dtype(feature.tf_dtype)
    if isinstance(feature, tfds_lib.features.ClassLabel):
        return Labels.of(feature.num_classes), list(feature.names)
    if dtype.is_floating and all(isinstance(d, int) for d in feature.shape):
        return Labels.of(target_shape=tuple(feature.shape)), None  # float targets: the model regresses them
    if not (feature.shape == () and dtype.is_integer):
        raise ValueError(f"data.label_key={label_key!r}: in {name!r} it is {feature!r}; expected class "
                         f"numbers (a ClassLabel or an integer scalar) or float targets of a fixed shape.")
    return Labels.of(num_classes, hint=f"{name!r}'s label {label_key!r} is a plain integer; give the number of "
                                       f"classes (an integer >= 1)"), None


def _image_size(image_size, image_feature, features, image_key: str, first_part) -> list[int]:
    """``image_size``, else the data set's fixed size, else the first image's (the others must match it)."""
    size = check_image_size(image_size)
    shape = tuple(image_feature.shape)
    if size is None and shape[0] is not None and shape[1] is not None:
        size = list(shape[:2])
    elif size is None:  # images of any size: the first one's, others must match
        first = next(iter(tf.data.TFRecordDataset(first_part[0]).skip(first_part[1]).take(1)))
        image = features.deserialize_example(first)[image_key]
        size = [int(image.shape[0]), int(image.shape[1])]
    return size


def _whole_records(train, test, name: str, skip_corrupt: bool):
    """The parts ``(path, skip, take)`` of both splits, checked against the shards on disk: a shard holding fewer
    whole records than the data set's info says (cut short) is refused naming it, or (``skip_corrupt``) read to
    its last whole record. Returns the parts and the number of shards cut."""
    from .tfrecord import walk_records

    counts = {}
    for path in {p for p, _, _ in train + test}:
        counts[path] = walk_records(path)[0] if os.path.isfile(path) else 0
    cut = sorted({p for p, skip, take in train + test if skip + take > counts[p]})
    if cut and not skip_corrupt:
        need = max(skip + take for p, skip, take in train + test if p == cut[0])
        raise ValueError(f"data.name={name!r}: shard {cut[0]} holds {counts[cut[0]]} whole records, the data set's "
                         f"info says {need} (cut short){f'; {len(cut)} such shards' if len(cut) > 1 else ''}; "
                         f"prepare it again, or set data.skip_corrupt=true to read the whole records.")

    def clipped(parts):
        kept = [(p, skip, min(take, counts[p] - skip)) for p, skip, take in parts]
        return [part for part in kept if part[2] > 0]

    return clipped(train), clipped(test), len(cut)


def _import_tfds():
    try:
        import tensorflow_datasets
    except ImportError as err:
        raise ValueError(f"data=tfds needs the tensorflow-datasets package ({err}); install it with "
                         f"`pip install tensorflow-datasets`.") from None
    return tensorflow_datasets


def _builder(tfds_lib, name: str, data_dir):
    try:
        return tfds_lib.builder(name, data_dir=data_dir)
    except tfds_lib.core.registered.DatasetNotFoundError:
        versions = _versions(tfds_lib, name, data_dir)
        if ":" in name and versions:
            raise ValueError(f"data.name={name!r}: no version {name.split(':', 1)[1]} of "
                             f"{name.split(':', 1)[0]!r}; available: {', '.join(versions)}.") from None
        raise ValueError(f"data.name={name!r}: no TFDS data set of that name, registered or prepared in "
                         f"{data_dir or 'the default data_dir'} (catalog: https://www.tensorflow.org/datasets/"
                         f"catalog; a data set of your own: its folder data_dir/{name}/<version>).") from None
    except (ValueError, AssertionError) as err:  # a bad config or version in the name
        versions = _versions(tfds_lib, name, data_dir)
        if ":" in name and versions and name.split(":", 1)[1] not in versions:
            raise ValueError(f"data.name={name!r}: no version {name.split(':', 1)[1]} of "
                             f"{name.split(':', 1)[0]!r}; available: {', '.join(versions)}.") from None
        raise ValueError(f"data.name={name!r}: {str(err).splitlines()[0][:200]}") from None


def _versions(tfds_lib, name: str, data_dir) -> list[str]:
    """The versions of ``name`` (without its ``:version``) prepared in ``data_dir`` or registered."""
    base = name.split(":", 1)[0]
    found = set()
    root = Path(os.path.expanduser(str(data_dir or os.environ.get("TFDS_DATA_DIR") or "~/tensorflow_datasets")))
    folder = root / base
    if folder.is_dir():
        found |= {p.name for p in folder.iterdir() if p.is_dir() and _VERSION.match(p.name)}
    try:
        builder_cls = tfds_lib.builder_cls(base.split("/")[0])
        found |= {str(v) for v in [builder_cls.VERSION, *getattr(builder_cls, "SUPPORTED_VERSIONS", [])] if v}
    except Exception:  # noqa: BLE001 - not registered
        pass
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def _prepared(builder) -> bool:
    check = getattr(builder, "is_prepared", None)
    return bool(check()) if check else tf.io.gfile.exists(str(builder.data_path / "dataset_info.json"))


def _where(builder) -> str:
    return str(getattr(builder, "data_dir_root", None) or builder.data_dir)


def _download(builder, name: str) -> None:
    """``builder.download_and_prepare()``; on failure one line, and no folder or partial file of ours left."""
    import logging

    root = Path(_where(builder))
    watched = [root, root / "downloads", root / builder.name]  # not the other data sets beside it
    before = _listing(watched)
    root_existed = root.exists()
    urllib3_log = logging.getLogger("urllib3")
    level = urllib3_log.level
    urllib3_log.setLevel(logging.ERROR)  # TFDS retries a dead link 10 times; one warning each is noise here
    try:
        builder.download_and_prepare()
    except Exception as err:  # noqa: BLE001 - offline, refused, a server error: TFDS raises many kinds
        _remove_new(root, _listing(watched) - before, root_existed)
        why = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise FileNotFoundError(f"data.name={name!r}: downloading and preparing it in {_where(builder)} failed "
                                f"({type(err).__name__}: {why}); where there is no network, run `tfds build {name} "
                                f"--data_dir DIR` on a machine with network access and copy DIR here "
                                f"(data.data_dir=DIR).") from None
    finally:
        urllib3_log.setLevel(level)


def _listing(folders) -> set:
    return {folders[0]} | {p for f in folders[1:] if f.exists() for p in [f, *f.rglob("*")]}


def _remove_new(root: Path, created: set, root_existed: bool) -> None:
    """Remove what a failed download created: partial files and the folders it made."""
    for path in sorted(created, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        else:
            path.unlink(missing_ok=True)
    if not root_existed and root.exists() and not any(root.iterdir()):
        root.rmdir()


def _feature(features, key: str, role: str, name: str):
    if key not in features:
        raise ValueError(f"data.{role}={key!r}: {name!r} has no feature {key!r}; it has: "
                         f"{', '.join(sorted(features.keys()))}.")
    return features[key]


def _split(info, split: str, role: str, name: str):
    """``[(path, skip, take), ...]`` of a TFDS split expression."""
    try:
        split_info = info.splits[split]
    except (ValueError, KeyError, TypeError, AssertionError) as err:
        raise ValueError(f"data.{role}={split!r}: {str(err).splitlines()[0][:200]} (splits of {name!r}: "
                         f"{', '.join(info.splits.keys())}; slices such as train[:90%]).") from None
    parts = [(str(f.filename), int(f.skip), int(f.take)) for f in split_info.file_instructions]
    if not parts or split_info.num_examples == 0:
        raise ValueError(f"data.{role}={split!r}: selects no examples of {name!r}.")
    return parts
