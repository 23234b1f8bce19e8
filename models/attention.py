"""A conv net whose feature map is gated by a Bernoulli-sampled visual-attention map, trained through a custom gradient."""

from __future__ import annotations

from typing import Sequence

import keras
import tensorflow as tf

from sections import Network

from ._util import SeedStream, check_image_shape, check_int, check_ints, reject_data_args, serializable
from .losses import head


@tf.custom_gradient
def bernoulli_gate(features, probs, noise):
    """``features * (noise < probs)``; the sample's gradient is taken as if it were ``probs``.

    The gradient on ``probs`` is the incoming gradient times the feature map, summed over the
    channels the map is broadcast across; ``noise`` gets none.
    """
    sample = tf.cast(noise < probs, features.dtype)

    def grad(upstream):
        d_probs = tf.reduce_sum(upstream * features, axis=-1, keepdims=True)
        return upstream * sample, d_probs, tf.zeros_like(noise)

    return features * sample, grad


@serializable
class ConvPool(keras.layers.Layer):
    """A 3x3 convolution, batch norm, ReLU and 2x2 max pooling."""

    def __init__(self, filters: int, bn_momentum: float = 0.9, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.filters, self.bn_momentum, self.seed = filters, bn_momentum, seed
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                        kernel_initializer=keras.initializers.HeNormal(seed=seed), name="conv")
        self.bn = keras.layers.BatchNormalization(momentum=bn_momentum, name="bn")

    def build(self, input_shape):
        self.conv.build(input_shape)
        self.bn.build(self.conv.compute_output_shape(input_shape))

    def call(self, x, training=False):
        y = tf.nn.relu(self.bn(self.conv(x), training=training))
        return tf.nn.max_pool2d(y, 2, 2, "SAME")

    def get_config(self):
        return {**super().get_config(), "filters": self.filters, "bn_momentum": self.bn_momentum, "seed": self.seed}


@serializable
class BernoulliAttention(keras.layers.Layer):
    """A 1x1-conv attention map ``p`` in (0, 1); training gates the features with a Bernoulli(``p``) sample.

    The uniform noise comes from a ``keras.random.SeedGenerator``, so a section re-run with the
    generator's state restored draws the same sample. Inference gates with ``p`` itself (the expectation).
    The score's bias starts at 2 (``p`` near 0.88), so early training keeps most features.
    """

    def __init__(self, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.seed = seed
        self.score = keras.layers.Conv2D(1, 1, kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                                         bias_initializer=keras.initializers.Constant(2.0), name="score")
        self.seed_generator = keras.random.SeedGenerator(seed + 1, name="seed_generator")

    def build(self, input_shape):
        self.score.build(input_shape)

    def call(self, x, training=False):
        probs = tf.sigmoid(self.score(x))
        if not training:
            return x * probs
        noise = keras.random.uniform(tf.shape(probs), dtype=probs.dtype, seed=self.seed_generator)
        return bernoulli_gate(x, probs, noise)

    def get_config(self):
        return {**super().get_config(), "seed": self.seed}


@serializable
class Classifier(keras.layers.Layer):
    """Flatten (keeping where the attention let features through), a hidden ReLU layer, then class logits."""

    def __init__(self, num_classes: int, hidden: int = 128, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.num_classes, self.hidden, self.seed = num_classes, hidden, seed
        self.flatten = keras.layers.Flatten(name="flatten")
        self.dense = keras.layers.Dense(hidden, activation="relu", name="dense",
                                        kernel_initializer=keras.initializers.HeNormal(seed=seed))
        self.logits = keras.layers.Dense(num_classes, name="logits",
                                         kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 1))

    def build(self, input_shape):
        flat = self.flatten.compute_output_shape(input_shape)
        self.dense.build(flat)
        self.logits.build((flat[0], self.hidden))

    def call(self, x, training=False):
        return self.logits(self.dense(self.flatten(x)))

    def get_config(self):
        return {**super().get_config(), "num_classes": self.num_classes, "hidden": self.hidden, "seed": self.seed}


def build_attention(
    num_classes: int = 10,
    input_shape: Sequence[int] | None = None,
    filters: Sequence[int] = (32, 64),
    hidden: int = 128,
    bn_momentum: float = 0.9,
    seed: int = 0,
    vocab_size: int | None = None,
    targets: str = "class",
) -> Network:
    """Blocks ``features/conv_{i}`` (conv, BN, ReLU, pool), ``attention`` (the Bernoulli gate), ``classifier``
    (flatten, hidden layer, logits).

    Args:
        num_classes: classes of the softmax (from the data).
        input_shape: (height, width, channels) of the images (from the data); checked, not needed.
        filters: filters of each conv-pool block.
        hidden: units of the classifier's hidden layer.
        bn_momentum: batch-norm moving-average momentum.
        seed: makes initial weights and the attention samples reproducible.
        vocab_size: sequence data's argument; given, it raises a ValueError naming the mix-up.
        targets: the data's labels: ``class`` numbers (softmax cross-entropy, accuracy) or ``float`` values
            (``num_classes`` outputs, mean squared error, ``mae``).
    """
    reject_data_args("attention", "image data (num_classes, input_shape)", vocab_size=vocab_size)
    loss, metrics = head(targets)
    num_classes = check_int("num_classes", num_classes, minimum=2 if targets == "class" else 1)
    check_image_shape(input_shape)
    filters, hidden = check_ints("filters", filters), check_int("hidden", hidden)
    seeds = SeedStream(seed)
    blocks = [(f"features/conv_{i}", ConvPool(f, bn_momentum, seeds(), name=f"conv_{i}"))
              for i, f in enumerate(filters)]
    blocks.append(("attention", BernoulliAttention(seeds(), name="attention")))
    blocks.append(("classifier", Classifier(num_classes, hidden, seeds(), name="classifier")))
    return Network(blocks, loss=loss, inputs="image", metrics=metrics, loss_fields=("label",))
