"""The partialflow notebook's pre-activation ResNet as named blocks: ``initial_conv``, ``scale{i}/block_{j}``, ``final_pool``."""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from sections import Network

from ._util import (SeedStream, check_image_shape, check_int, check_ints, check_rate, reject_data_args,
                    serializable)
from .losses import head


def _conv(filters: int, size: int, stride: int, seed: int, name: str) -> keras.layers.Conv2D:
    return keras.layers.Conv2D(filters, size, strides=stride, padding="same", use_bias=False,
                               kernel_initializer=keras.initializers.HeNormal(seed=seed), name=name)


@serializable
class ConvBNReLU(keras.layers.Layer):
    """A 3x3 convolution, batch norm and ReLU: the notebook's ``initial_conv``."""

    def __init__(self, filters: int, bn_momentum: float = 0.9, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.bn_momentum, self.seed = filters, bn_momentum, seed
        self.conv = _conv(filters, 3, 1, seed, "conv")
        self.bn = keras.layers.BatchNormalization(momentum=bn_momentum, name="bn")

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(self.conv.compute_output_shape(input_shape))

    def call(self, x, training=False):
        return tf.nn.relu(self.bn(self.conv(x), training=training))

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "bn_momentum": self.bn_momentum, "seed": self.seed}


@serializable
class PreActBlock(keras.layers.Layer):
    """BN, ReLU, 3x3 conv, BN, ReLU, (dropout), 3x3 conv, plus the identity or a strided 1x1 projection."""

    has_conv2 = True

    def __init__(self, filters: int, stride: int = 1, dropout: float = 0.0, bn_momentum: float = 0.9,
                 seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.stride, self.dropout, self.bn_momentum, self.seed = (
            filters, stride, dropout, bn_momentum, seed)
        self.bn1 = keras.layers.BatchNormalization(momentum=bn_momentum, name="bn1")
        self.conv1 = _conv(filters, 3, stride, seed, "conv1")
        self.bn2 = keras.layers.BatchNormalization(momentum=bn_momentum, name="bn2")
        self.drop = keras.layers.Dropout(dropout, seed=seed + 1, name="dropout") if dropout > 0 else None
        self.conv2 = _conv(filters, 3, 1, seed + 2, "conv2") if self.has_conv2 else None
        self.projection = None

    def build(self, input_shape):
        self.bn1.build(input_shape)
        self.conv1.build(input_shape)
        mid = self.conv1.compute_output_shape(input_shape)
        self.bn2.build(mid)
        if self.conv2 is not None:
            self.conv2.build(mid)
        if self.stride != 1 or input_shape[-1] != self.filters:
            self.projection = _conv(self.filters, 1, self.stride, self.seed + 3, "projection")
            self.projection.build(input_shape)

    def call(self, x, training=False):
        shortcut, r = _first_half(self, x, training)
        return self.conv2(r) + shortcut

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "stride": self.stride, "dropout": self.dropout,
                "bn_momentum": self.bn_momentum, "seed": self.seed}


def _first_half(block, x, training):
    """A pre-activation block up to its second convolution: ``(shortcut, r)``, the tensors alive there."""
    a = tf.nn.relu(block.bn1(x, training=training))
    shortcut = x if block.projection is None else block.projection(a)
    r = tf.nn.relu(block.bn2(block.conv1(a), training=training))
    if block.drop is not None:
        r = block.drop(r, training=training)
    return shortcut, r


@serializable
class PreActHead(PreActBlock):
    """A ``PreActBlock`` without its second convolution, returning ``(shortcut, r)``: with ``PreActTail`` after it,
    a block the planner can cut in the middle (the border is those two tensors). Same layers, names and seeds."""

    has_conv2 = False  # the tail's

    def call(self, x, training=False):
        return _first_half(self, x, training)


@serializable
class PreActTail(keras.layers.Layer):
    """The second convolution of a split pre-activation block, plus the shortcut: ``conv2(r) + shortcut``."""

    def __init__(self, filters: int, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.seed = filters, seed
        self.conv2 = _conv(filters, 3, 1, seed + 2, "conv2")

    def build(self, input_shape):
        self.conv2.build(input_shape[1])

    def call(self, inputs, training=False):
        shortcut, r = inputs
        return self.conv2(r) + shortcut

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "seed": self.seed}


@serializable
class PoolDense(keras.layers.Layer):
    """Global average pooling and a dense layer to the class logits: the notebook's ``final_pool``."""

    def __init__(self, num_classes: int, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.seed = num_classes, seed
        self.dense = keras.layers.Dense(num_classes, kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                                        name="dense")

    def build(self, input_shape):
        self.dense.build((input_shape[0], input_shape[-1]))

    def call(self, x, training=False):
        return self.dense(tf.reduce_mean(x, axis=[1, 2]))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "seed": self.seed}


def build_resnet(
    num_classes: int = 10,
    input_shape: Sequence[int] | None = None,
    widths: Sequence[int] = (16, 32, 64),
    depths: Sequence[int] = (3, 3, 5),
    dropout: float = 0.0,
    bn_momentum: float = 0.9,
    seed: int = 0,
    vocab_size: int | None = None,
    targets: str = "class",
    split_blocks: bool = False,
) -> Network:
    """The notebook's ResNet; scale ``i > 0`` starts with a stride-2 block to ``widths[i]`` filters.

    Args:
        num_classes: classes of the softmax (from the data).
        input_shape: (height, width, channels) of the images (from the data); checked, not needed.
        widths: filters per scale; ``initial_conv`` uses ``widths[0]``.
        depths: residual blocks per scale, the strided first block included.
        dropout: rate between the two convolutions of every block (0 turns it off).
        bn_momentum: batch-norm moving-average momentum.
        seed: makes initial weights and dropout reproducible.
        vocab_size: sequence data's argument; given, it raises a ValueError naming the mix-up.
        targets: the data's labels: ``class`` numbers (softmax cross-entropy, accuracy) or ``float`` values
            (``num_classes`` outputs, mean squared error, ``mae``).
        split_blocks: each residual block as two blocks, ``scale{i}/block_{j}`` up to its second convolution and
            ``scale{i}/block_{j}/conv2`` (the border between them is the shortcut and the second convolution's
            input), so sections and the planner can cut inside residual blocks. Same layers and initial weights.
    """
    reject_data_args("resnet", "image data (num_classes, input_shape)", vocab_size=vocab_size)
    loss, metrics = head(targets)
    num_classes = check_int("num_classes", num_classes, minimum=2 if targets == "class" else 1)
    check_image_shape(input_shape)
    widths, depths = check_ints("widths", widths), check_ints("depths", depths)
    if len(widths) != len(depths):
        raise ValueError(f"widths={widths} and depths={depths} must have one entry per scale (same length).")
    dropout = check_rate("dropout", dropout)
    if not isinstance(split_blocks, bool):
        raise ValueError(f"split_blocks={split_blocks!r}: must be true or false.")
    seeds = SeedStream(seed)
    blocks = [("initial_conv", ConvBNReLU(widths[0], bn_momentum, seeds(), name="initial_conv"))]
    for i, (width, depth) in enumerate(zip(widths, depths)):
        for j in range(depth):
            name = f"scale{i}/block_{j}"
            stride = 2 if i > 0 and j == 0 else 1
            seed, layer_name = seeds(), name.replace("/", "_")
            if split_blocks:
                blocks.append((name, PreActHead(width, stride, dropout, bn_momentum, seed, name=layer_name)))
                blocks.append((f"{name}/conv2", PreActTail(width, seed, name=f"{layer_name}_conv2")))
            else:
                blocks.append((name, PreActBlock(width, stride, dropout, bn_momentum, seed, name=layer_name)))
    blocks.append(("final_pool", PoolDense(num_classes, seeds(), name="final_pool")))
    return Network(blocks, loss=loss, inputs="image", metrics=metrics, loss_fields=("label",))
