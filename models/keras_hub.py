"""keras-hub backbones by class name, with the head a task needs, as networks cut between transformer layers.

``build_keras_hub(name="GPT2Backbone", args={...})`` builds the backbone from its constructor (random weights),
or from a local preset folder, then lays its graph out again as one flat Functional model: the token ids are
the first input (the padding mask and segment ids are made from them inside the model), the backbone's own
layers follow in its order, and the head comes last. ``Network.from_keras`` cuts that model at layer names,
so ``transformer_layer_0`` .. are the names ``sections=[...]`` takes (``runner/help.py`` lists them).

keras-hub is an optional extra (``pip install -e '.[hub]'``); it is imported inside the builder only.
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from typing import Mapping, Sequence

import keras
import tensorflow as tf

from sections import Network, run_through_graph

from ._util import check_image_shape, serializable
from .keras_app import NAMES_HINT
from .losses import classification_accuracy, classification_loss, sequence_loss, token_accuracy

INSTALL = "pip install -e '.[hub]' (python3 tasks.py installs it with the test extra)"
TASKS = ("causal_lm", "sequence_classification", "token_classification", "image_classification")
TEXT_INPUTS = ("token_ids", "padding_mask", "segment_ids")
LN2 = math.log(2.0)
BASE_ARGS = ("dtype", "name", "trainable")  # what every backbone's **kwargs passes on to keras.Model


def keras_hub_module():
    """``keras_hub``, or one line saying how to install it."""
    try:
        import keras_hub
    except ImportError as err:
        raise ValueError(f"model=keras_hub needs the keras-hub package, which is not installed: {INSTALL}.") from err
    return keras_hub


def backbone_names() -> list[str]:
    """Every backbone class keras-hub offers (``GPT2Backbone``, ``BertBackbone``, ``ViTBackbone``, ...)."""
    hub = keras_hub_module()
    base = hub.models.Backbone
    return sorted(n for n in dir(hub.models) if n != "Backbone" and isinstance(getattr(hub.models, n), type)
                  and issubclass(getattr(hub.models, n), base))


def default_task(cls) -> str:
    """``image_classification`` for a vision backbone (it takes ``image_shape``), ``causal_lm`` for one that a
    keras-hub ``CausalLM`` uses (a decoder), else ``sequence_classification`` (an encoder)."""
    if "image_shape" in inspect.signature(cls).parameters:
        return "image_classification"
    hub = keras_hub_module()
    decoders = {getattr(getattr(hub.models, n), "backbone_cls", None) for n in dir(hub.models)
                if isinstance(getattr(hub.models, n), type) and issubclass(getattr(hub.models, n), hub.models.CausalLM)}
    return "causal_lm" if cls in decoders else "sequence_classification"


def build_keras_hub(name: str | None = "GPT2Backbone", args: Mapping | None = None, task: str | None = None,
                    preset: str | None = None, vocab_size: int | None = None, seq_len: int | None = None,
                    num_classes: int | None = None, input_shape: Sequence[int] | None = None,
                    pad_id: int | None = None, labels: str | None = None, unit: str = "char",
                    data_args: Mapping | None = None, max_blocks: int = 64, keep: Sequence[str] = (),
                    targets: str = "class") -> Network:
    """A keras-hub backbone by class name with the head of ``task``, cut at its layer names.

    Args:
        name: the backbone class, e.g. ``"GPT2Backbone"``; see ``backbone_names()``.
        args: its constructor arguments (``num_layers``, ``hidden_dim``, ...). ``vocabulary_size``,
            ``max_sequence_length`` and ``image_shape`` default to the data's.
        task: ``causal_lm`` (next token), ``sequence_classification``, ``token_classification`` or
            ``image_classification``; ``None``: the backbone's kind decides (``default_task``).
        preset: a local keras-hub preset folder (``backbone.save_to_preset(dir)``): its config and weights;
            ``args`` then override its config. Never downloaded.
        vocab_size, seq_len, pad_id, labels, unit: token data's (``data=text``, ``data=tokens``): the vocabulary,
            the window length, the padding id (``None``: no padding), ``sequence``/``token`` labels, and what one
            token is (``char`` or ``token``: the metric is ``bits_per_<unit>``).
        num_classes, input_shape: the classes, and the images' shape for vision backbones.
        data_args: the data's own values of keys the model config set itself (unused: ``args`` holds the
            backbone's).
        max_blocks, keep: as for ``Network.from_keras``.
        targets: the data's labels; only ``class`` is supported.

    Initial weights come from Keras's global seed (``keras.utils.set_random_seed``; the runner sets it).
    """
    hub = keras_hub_module()
    cls = _backbone_class(hub, name, preset)
    args = _plain_args(args)
    backbone = _from_preset(cls, preset, args) if preset is not None else None
    cls = type(backbone) if backbone is not None else cls  # name=null: the preset's class
    task = _check_task(task, cls)
    if targets != "class":
        raise ValueError(f"keras_hub: the data's targets are {targets!r}; only class labels and tokens are supported.")
    _check_data(task, cls.__name__, vocab_size, seq_len, num_classes, input_shape, labels)
    if backbone is None:
        backbone = _construct(cls, args, vocab_size, seq_len, input_shape)
    _check_size(backbone, vocab_size, seq_len, input_shape)
    model, loss, metrics, fields = _with_head(backbone, task, num_classes, pad_id, unit)
    first = "image" if task == "image_classification" else "tokens"
    net = Network.from_keras(model, loss, inputs=first, metrics=metrics, loss_fields=fields,
                             max_blocks=max_blocks, keep=keep, names_hint=NAMES_HINT)
    net.backbone = backbone  # the keras-hub model whose layers (and variables) the blocks run
    return net


# ---------------------------------------------------------------- checks


def _backbone_class(hub, name, preset):
    if name is None and preset is not None:
        return hub.models.Backbone  # the preset's config names the class
    allowed = backbone_names()
    if name not in allowed:
        close = difflib.get_close_matches(str(name), allowed, n=3, cutoff=0.5)
        near = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"model.name={name!r} is not a keras-hub backbone class; {near}allowed: {', '.join(allowed)}.")
    return getattr(hub.models, name)


def _check_task(task, cls) -> str:
    if task is None:
        return default_task(cls)
    if task not in TASKS:
        raise ValueError(f"model.task={task!r}: allowed: {', '.join(TASKS)} (null: by the backbone's kind).")
    return task


def _check_data(task, name, vocab_size, seq_len, num_classes, input_shape, labels) -> None:
    """The data fits the task: token data for text tasks (labelled as the task needs), images for vision."""
    text = vocab_size is not None
    wanted = {"causal_lm": (True, None), "sequence_classification": (True, "sequence"),
              "token_classification": (True, "token"), "image_classification": (False, None)}[task]
    if wanted[0] and not text:
        raise ValueError(f"keras_hub {name} task={task} needs token data (data=text, data=tokens); got "
                         f"{'image data' if input_shape is not None else 'data without a vocabulary'}.")
    if not wanted[0] and text:
        raise ValueError(f"keras_hub {name} task=image_classification needs image data; got token data "
                         f"(vocab_size={vocab_size}): choose model.task=causal_lm or a text backbone.")
    if text and labels != wanted[1]:
        has = f"{labels} labels" if labels else "next-token targets, no labels"
        fits = {None: "causal_lm", "sequence": "sequence_classification", "token": "token_classification"}[labels]
        raise ValueError(f"keras_hub {name} task={task} needs {wanted[1] + ' labels' if wanted[1] else 'next-token targets'}"
                         f"; the data has {has}: set model.task={fits} or give the data it needs.")
    if wanted[1] and num_classes is None:
        raise ValueError(f"keras_hub {name} task={task}: the data gives no num_classes.")


def _plain_args(args) -> dict:
    """``model.args`` as plain Python values (a Hydra config's dicts and lists are not)."""
    if args is None:
        return {}
    if not isinstance(args, Mapping):
        raise ValueError(f"model.args={args!r}: must be a mapping of constructor arguments, e.g. "
                         f"{{num_layers: 2, hidden_dim: 64}}.")
    plain = lambda v: ({k: plain(x) for k, x in v.items()} if isinstance(v, Mapping) else
                       [plain(x) for x in v] if isinstance(v, Sequence) and not isinstance(v, str) else v)
    return plain(args)


def _from_preset(cls, preset, args: dict):
    """The backbone of a local preset folder; ``args`` override its config. Never a download."""
    path = os.path.expanduser(str(preset))
    if not os.path.isdir(path):
        raise ValueError(f"model.preset={preset!r}: not an existing local folder; give a folder written by "
                         f"backbone.save_to_preset(dir) (presets are never downloaded).")
    try:
        return cls.from_preset(path, **args)
    except (ValueError, TypeError, OSError) as err:
        raise ValueError(f"model.preset={preset!r}: keras-hub cannot load it as {cls.__name__}: "
                         f"{' '.join(str(err).split())[:300]}") from err


def _construct(cls, args: dict, vocab_size, seq_len, input_shape):
    """The backbone from its constructor (random weights), sized for the data where ``args`` leave it open."""
    params = inspect.signature(cls.__init__).parameters
    _fill(args, params, "vocabulary_size", vocab_size)
    _fill(args, params, "max_sequence_length", seq_len)
    _fill(args, params, "image_shape", list(input_shape) if input_shape is not None else None)
    unknown = [k for k in args if k not in params and k not in BASE_ARGS]  # **kwargs would take any name silently
    if unknown:
        raise ValueError(f"model.args: {cls.__name__} takes no {', '.join(unknown)}; its arguments: "
                         f"{', '.join(_arguments(params))}.")
    missing = [k for k, p in params.items() if k != "self" and p.default is p.empty
               and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and k not in args]
    if missing:
        example = ", ".join(f"{k}: ..." for k in missing)
        raise ValueError(f"model.args: {cls.__name__} needs {', '.join(missing)}: give model.args={{{example}}} "
                         f"(its arguments: {', '.join(_arguments(params))}).")
    try:
        return cls(**args)
    except (ValueError, TypeError) as err:
        raise ValueError(f"model.args={args}: {cls.__name__} cannot be built: "
                         f"{' '.join(str(err).split())[:300]}") from err


def _fill(args: dict, params, key: str, value) -> None:
    if key in params and key not in args and value is not None:
        args[key] = value


def _arguments(params) -> list[str]:
    return [k for k, p in params.items() if k != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def _check_size(backbone, vocab_size, seq_len, input_shape) -> None:
    """The data's vocabulary, windows and images fit the backbone as built."""
    name = type(backbone).__name__
    vocab = getattr(backbone, "vocabulary_size", None)
    if vocab_size is not None and vocab is not None and vocab < vocab_size:
        raise ValueError(f"model.args.vocabulary_size={vocab}: the data has {vocab_size} token ids (0..{vocab_size - 1}); "
                         f"{name} needs vocabulary_size >= {vocab_size}.")
    longest = getattr(backbone, "max_sequence_length", None)
    if seq_len is not None and longest is not None and longest < seq_len:
        raise ValueError(f"model.args.max_sequence_length={longest}: the data's windows are {seq_len} tokens long; "
                         f"give max_sequence_length >= {seq_len} or a shorter data.seq_len.")
    shape = getattr(backbone, "image_shape", None)
    data_shape = check_image_shape(input_shape)
    if data_shape is not None and shape is not None and tuple(shape) != data_shape:
        raise ValueError(f"model.args.image_shape={list(shape)}: the data's images are {list(data_shape)}; give "
                         f"image_shape={list(data_shape)} (or leave it out: the data's).")


# ---------------------------------------------------------------- the flat model and its head


def _with_head(backbone, task: str, num_classes, pad_id, unit: str):
    """(model, loss, metrics, loss_fields): the backbone's layers and the head as one Functional model."""
    if task == "image_classification":
        images = keras.Input(tuple(backbone.inputs[0].shape[1:]), name="images")
        features = _flat_call(backbone, images)
        pooled = TokenPool("first", name="pool")(features) if len(features.shape) == 3 else \
            keras.layers.GlobalAveragePooling2D(name="pool")(features)
        logits = keras.layers.Dense(num_classes, name="classifier")(pooled)
        return (keras.Model(images, logits, name=backbone.name), classification_loss("label"),
                {"accuracy": classification_accuracy("label")}, ("label",))
    names = [x.name for x in backbone.inputs]
    if "token_ids" not in names or any(n not in TEXT_INPUTS for n in names):
        raise ValueError(f"keras_hub {type(backbone).__name__}: its inputs are {names}; the runner feeds "
                         f"{', '.join(TEXT_INPUTS)} (made from the token ids) or images only.")
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    feeds = {"token_ids": tokens}
    if "padding_mask" in names:
        feeds["padding_mask"] = PaddingMask(pad_id, name="padding_mask_of_tokens")(tokens)
    if "segment_ids" in names:
        feeds["segment_ids"] = PaddingMask(-1, zeros=True, name="segment_ids_of_tokens")(tokens)
    out = _flat_call(backbone, feeds)
    sequence = out["sequence_output"] if isinstance(out, dict) else out
    if task == "causal_lm":
        vocab = backbone.vocabulary_size
        logits = keras.layers.Dense(vocab, name="lm_head")(sequence)
        loss = sequence_loss("targets", pad_id) if pad_id is not None else classification_loss("targets")
        accuracy = token_accuracy("targets", pad_id) if pad_id is not None else classification_accuracy("targets")
        metrics = {f"bits_per_{unit}": lambda out_, batch: loss(out_, batch) / LN2, "accuracy": accuracy}
        return keras.Model(tokens, logits, name=backbone.name), loss, metrics, ("targets",)
    if task == "token_classification":
        logits = keras.layers.Dense(num_classes, name="classifier")(sequence)
        loss, accuracy = _token_label_loss(pad_id)
        return keras.Model(tokens, logits, name=backbone.name), loss, {"accuracy": accuracy}, ("label", "tokens")
    if isinstance(out, dict) and "pooled_output" in out:
        pooled = out["pooled_output"]
    else:  # a decoder's last (non-padding) token sees the whole sequence; an encoder's first token by convention
        mode = "last" if default_task(type(backbone)) == "causal_lm" else "first"
        pooled = TokenPool(mode, pad_id, name="pool")(sequence, tokens)
    logits = keras.layers.Dense(num_classes, name="classifier")(pooled)
    return (keras.Model(tokens, logits, name=backbone.name), classification_loss("label"),
            {"accuracy": classification_accuracy("label")}, ("label",))


def _token_label_loss(pad_id):
    """Cross-entropy and accuracy per token label, over the tokens that are not padding."""

    def mask(batch):
        if pad_id is None:
            return tf.ones_like(batch["label"], tf.float32)
        return tf.cast(tf.not_equal(tf.cast(batch["tokens"], tf.int32), pad_id), tf.float32)

    def loss(logits, batch):
        labels = tf.cast(batch["label"], tf.int32)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32))
        m = mask(batch)
        return tf.reduce_sum(ce * m) / tf.maximum(tf.reduce_sum(m), 1.0)

    def accuracy(logits, batch):
        hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), tf.cast(batch["label"], tf.int32))
        m = mask(batch)
        return tf.reduce_sum(tf.cast(hits, tf.float32) * m) / tf.maximum(tf.reduce_sum(m), 1.0)

    return loss, accuracy


def _flat_call(backbone, inputs):
    """The backbone's graph called layer by layer on ``inputs`` (new nodes of its own layers, no nested model);
    a transformer stack kept in one layer (keras-hub's ``ViTEncoder``) is called layer by layer too, so it can be
    cut between its layers."""

    def operation_fn(op):
        unroll = UNROLL.get(type(op).__name__)
        return (lambda *a, **k: unroll(op, *a, **k)) if unroll else op

    # Not ``backbone.call``: its input standardizing would add a ``convert_to_tensor`` node per input.
    return run_through_graph(backbone, inputs, operation_fn)


def _vit_encoder(encoder, x):
    """``ViTEncoder.call``, one layer at a time."""
    x = encoder.dropout(x)
    for layer in encoder.encoder_layers:
        x = layer(x)
    return encoder.layer_norm(x)


UNROLL = {"ViTEncoder": _vit_encoder}


@serializable
class PaddingMask(keras.layers.Layer):
    """The padding mask of token ids: ``tokens != pad_id`` (all ones when ``pad_id`` is ``None``), as int32;
    ``zeros=True``: all zeros (segment ids of one-segment text)."""

    def __init__(self, pad_id: int | None = None, zeros: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.pad_id, self.zeros = pad_id, zeros

    def call(self, tokens):
        if self.zeros:
            return keras.ops.zeros_like(tokens, dtype="int32")
        if self.pad_id is None:
            return keras.ops.ones_like(tokens, dtype="int32")
        return keras.ops.cast(keras.ops.not_equal(tokens, self.pad_id), "int32")

    def compute_output_spec(self, tokens):
        return keras.KerasTensor(tokens.shape, dtype="int32")

    def get_config(self):
        return {**super().get_config(), "pad_id": self.pad_id, "zeros": self.zeros}


@serializable
class TokenPool(keras.layers.Layer):
    """One vector per sequence from ``[batch, time, width]``: the ``first`` token (a class token), or the
    ``last`` one that is not padding (``tokens != pad_id``)."""

    def __init__(self, mode: str = "first", pad_id: int | None = None, **kwargs):
        super().__init__(**kwargs)
        self.mode, self.pad_id = mode, pad_id

    def call(self, x, tokens=None):
        if self.mode == "first":
            return x[:, 0]
        if self.pad_id is None or tokens is None:
            return x[:, -1]
        length = keras.ops.sum(keras.ops.cast(keras.ops.not_equal(tokens, self.pad_id), "int32"), axis=1)
        last = keras.ops.maximum(length - 1, 0)
        return keras.ops.take_along_axis(x, last[:, None, None], axis=1)[:, 0]

    def compute_output_spec(self, x, tokens=None):
        return keras.KerasTensor((x.shape[0], x.shape[2]), dtype=x.dtype)

    def get_config(self):
        return {**super().get_config(), "mode": self.mode, "pad_id": self.pad_id}
