"""Keras models of other people, as networks: ``keras.applications`` by name, or a saved ``.keras`` file.

Both return ``sections.Network.from_keras(model, ...)``: the blocks are cut at the model's own layer
names, which are the names ``sections=[...]`` takes. The classification loss and accuracy read
``batch["label"]``; the first model input is ``batch["image"]``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from typing import Mapping, Sequence

import keras
import tensorflow as tf

from sections import Network

from ._util import check_image_shape, reject_data_args
from .losses import head


# Where a runner user reads every cut name of the chosen model (runner/help.py adds them to --help).
NAMES_HINT = "the same command with --help lists them all"


def application_names() -> list[str]:
    """Every model constructor ``keras.applications`` offers (``ResNet50V2``, ``MobileNetV2``, ...)."""
    return sorted(n for n in dir(keras.applications) if n[:1].isupper() and callable(getattr(keras.applications, n)))


def build_keras_app(name: str = "ResNet50V2", num_classes: int = 10, input_shape: Sequence[int] | None = None,
                    data_args: Mapping | None = None, max_blocks: int = 64, keep: Sequence[str] = (),
                    targets: str = "class", **other_data_args) -> Network:
    """A ``keras.applications`` model by name, with random weights (``weights=None``), cut at layer names.

    Args:
        name: the constructor, e.g. ``"ResNet50V2"``; see ``application_names()``.
        num_classes: classes of the classifier (from the data).
        input_shape: the image shape the model is built for, ``(height, width, channels)``. When it
            differs from the data's (``data_args["input_shape"]``), images are resized to it and
            one-channel images repeated to three, by layers in front of the model.
        data_args: the data's own ``model_args`` where the model config set one of them itself.
        max_blocks, keep: as for ``Network.from_keras``.
        targets: the data's labels, ``class`` or ``float`` (``num_classes`` linear outputs, mean squared error).

    Initial weights come from Keras's global seed (``keras.utils.set_random_seed``; the runner sets it).
    """
    reject_data_args(f"keras_app {name}", "image data (num_classes, input_shape)", **other_data_args)
    allowed = application_names()
    if name not in allowed:
        raise ValueError(f"name={name!r} is not a keras.applications model; allowed: {', '.join(allowed)}.")
    shape = check_image_shape(input_shape)
    data_shape = check_image_shape((data_args or {}).get("input_shape")) or shape
    if shape is None:
        raise ValueError("input_shape: give the image shape (height, width, channels) the model is built for.")
    constructor = getattr(keras.applications, name)
    params = inspect.signature(constructor).parameters
    logits = "classifier_activation" in params
    if targets == "float" and not logits:
        raise ValueError(f"keras.applications.{name} ends in a softmax (no classifier_activation argument), so it "
                         f"cannot fit the data's float targets; choose a model that takes classifier_activation.")
    inputs = keras.Input(data_shape, name="image")
    x = _adapt(inputs, data_shape, shape)
    kwargs = {"classifier_activation": None} if logits else {}
    try:
        model = constructor(weights=None, input_tensor=x, input_shape=shape, classes=num_classes, **kwargs)
    except ValueError as err:
        raise ValueError(f"keras.applications.{name} cannot be built for input_shape={list(shape)} and "
                         f"{num_classes} classes: {err} (input_shape sets the size it is built for; the data's "
                         f"images are resized to it)") from err
    return _network(model, logits, max_blocks, keep, targets)


def build_keras_file(path: str | None = None, custom_objects: Sequence[str] = (), num_classes: int | None = None,
                     input_shape: Sequence[int] | None = None, data_args: Mapping | None = None,
                     from_logits: bool | None = None, max_blocks: int = 64, keep: Sequence[str] = (),
                     targets: str = "class", **other_data_args) -> Network:
    """A model saved with ``model.save("x.keras")``, cut at its layer names; it keeps its saved weights.

    Args:
        path: the ``.keras`` file.
        custom_objects: import paths (``"mypkg.layers.MyLayer"``) of the classes and functions the file
            uses that Keras does not know.
        num_classes, input_shape: the data's; they must match the model's output and first input.
        data_args: unused (the file fixes the model's shapes); accepted like ``build_keras_app``'s.
        from_logits: whether the model outputs logits; ``None``: logits unless its last layer ends in a
            softmax.
        targets: the data's labels, ``class`` or ``float`` (the outputs are the values: mean squared error).
        max_blocks, keep: as for ``Network.from_keras``.
    """
    reject_data_args("keras_file", "image data (num_classes, input_shape)", **other_data_args)
    if path is None:
        raise ValueError("path: give the .keras file to load (model.path=my_model.keras).")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path={path!r}: no such file (a model saved with model.save('x.keras')).")
    objects = dict(_import(p) for p in ([custom_objects] if isinstance(custom_objects, str) else custom_objects))
    try:
        model = keras.saving.load_model(path, custom_objects=objects, compile=False)
    except (TypeError, ValueError) as err:
        unknown = re.search(r"Could not locate (?:class|function) '([^']+)'", str(err))
        why = (f"it uses {unknown.group(1)!r}, which Keras does not know" if unknown else
               " ".join(str(err).split())[:500])
        raise ValueError(f"path={path!r}: Keras cannot load it: {why}; give the import paths of such classes in "
                         f"custom_objects, e.g. ['mypkg.layers.MyLayer'].") from err
    expected = tuple(model.inputs[0].shape[1:]) if getattr(model, "inputs", None) else None
    data_shape = tuple(input_shape) if input_shape is not None else None
    if expected is not None and data_shape is not None and not _fits(data_shape, expected):
        raise ValueError(f"path={path!r}: the model's input shape is {list(expected)} but the data's examples are "
                         f"{list(data_shape)}; choose data of that shape.")
    out = model.outputs[0].shape[-1] if getattr(model, "outputs", None) else None
    if num_classes is not None and out is not None and out != num_classes:
        what = "classes" if targets != "float" else "values per example"
        raise ValueError(f"path={path!r}: the model outputs {out} {what} but the data has {num_classes}.")
    if from_logits is None:
        from_logits = not _ends_in_softmax(model)
    return _network(model, from_logits, max_blocks, keep, targets)


def _adapt(x, data_shape, shape):
    """Layers that turn the data's images into the model's: resize, then one channel to three."""
    if tuple(data_shape[:2]) != tuple(shape[:2]):
        x = keras.layers.Resizing(shape[0], shape[1], name="resize")(x)
    if data_shape[2] != shape[2]:
        if data_shape[2] != 1:
            raise ValueError(f"input_shape={list(shape)}: the data's images have {data_shape[2]} channels; only "
                             f"one-channel images are converted (repeated), so give {shape[2]}-channel data or "
                             f"input_shape=[{shape[0]}, {shape[1]}, {data_shape[2]}].")
        x = keras.layers.Concatenate(name="repeat_channels")([x] * shape[2])
    return x


def _network(model, logits: bool, max_blocks: int, keep, targets: str = "class") -> Network:
    loss, metrics = head(targets, "label")
    if targets != "float" and not logits:
        loss = _probability_loss("label")
    return Network.from_keras(model, loss, inputs="image", metrics=metrics, loss_fields=("label",),
                              max_blocks=max_blocks, keep=keep, names_hint=NAMES_HINT)


def _probability_loss(label_key: str):
    def loss(probs, batch):
        labels = tf.cast(batch[label_key], tf.int32)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, tf.cast(probs, tf.float32)))

    return loss


def _ends_in_softmax(model) -> bool:
    last = _output_layer(model)
    return isinstance(last, keras.layers.Softmax) or getattr(last, "activation", None) is keras.activations.softmax


def _output_layer(model):
    """The layer whose output is the model's one output (Keras's public ``Layer.output``), else None."""
    outputs, layers = getattr(model, "outputs", None) or [], getattr(model, "layers", None) or []
    for layer in reversed(layers):  # a Functional model lists its layers in the order they run
        try:
            if len(outputs) == 1 and layer.output is outputs[0]:
                return layer
        except (AttributeError, ValueError):  # a layer called more than once has no single output
            continue
    return None


def _fits(data_shape, expected) -> bool:
    return len(data_shape) == len(expected) and all(e is None or e == d for d, e in zip(data_shape, expected))


def _import(path: str):
    module, _, attr = str(path).rpartition(".")
    try:
        return attr, getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"custom_objects: cannot import {path!r} ({err}); give import paths such as "
                         f"'mypkg.layers.MyLayer'.") from err
