"""The small fully connected net of the split-model seed: dense layers with activations, one block each."""

from __future__ import annotations

from typing import Sequence

import keras

from sections import Network

from ._util import SeedStream, check_int, check_ints, check_rate, reject_data_args, serializable
from .losses import head

ACTIVATIONS = ("relu", "gelu", "tanh", "sigmoid", "elu", "swish")


@serializable
class DenseBlock(keras.layers.Layer):
    """Flatten, a dense layer, an optional activation and optional dropout."""

    def __init__(self, units: int, activation: str | None = "relu", dropout: float = 0.0, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation, self.dropout, self.seed = units, activation, dropout, seed
        self.flatten = keras.layers.Flatten(name="flatten")
        self.dense = keras.layers.Dense(units, activation=activation,
                                        kernel_initializer=keras.initializers.GlorotUniform(seed=seed), name="dense")
        self.drop = keras.layers.Dropout(dropout, seed=seed + 1, name="dropout") if dropout > 0 else None

    def build(self, input_shape):
        self.dense.build(self.flatten.compute_output_shape(input_shape))

    def call(self, x, training=False):
        y = self.dense(self.flatten(x))
        return self.drop(y, training=training) if self.drop is not None else y

    def get_config(self):
        return {**super().get_config(), "units": self.units, "activation": self.activation,
                "dropout": self.dropout, "seed": self.seed}


def build_mlp(
    num_classes: int = 10,
    input_shape: Sequence[int] | None = None,
    hidden: Sequence[int] = (256, 128),
    activation: str = "relu",
    dropout: float = 0.0,
    seed: int = 0,
    vocab_size: int | None = None,
    targets: str = "class",
) -> Network:
    """Blocks ``dense_0``.. (one per hidden layer) and ``logits``; the first block flattens the input.

    Args:
        num_classes: classes of the softmax (from the data).
        input_shape: the example shape (from the data); unused, any shape is flattened.
        hidden: units of each hidden layer.
        activation: one of ``ACTIVATIONS``.
        dropout: rate after each hidden layer (0 turns it off).
        seed: makes initial weights and dropout reproducible.
        vocab_size: sequence data's argument; given, it raises a ValueError naming the mix-up.
        targets: the data's labels: ``class`` numbers (softmax cross-entropy, accuracy) or ``float`` values
            (``num_classes`` outputs, mean squared error, ``mae``).
    """
    reject_data_args("mlp", "image data (num_classes, input_shape)", vocab_size=vocab_size)
    loss, metrics = head(targets)
    num_classes = check_int("num_classes", num_classes, minimum=2 if targets == "class" else 1)
    hidden = check_ints("hidden", hidden)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: allowed are {list(ACTIVATIONS)}.")
    dropout = check_rate("dropout", dropout)
    seeds = SeedStream(seed)
    blocks = [(f"dense_{i}", DenseBlock(units, activation, dropout, seeds(), name=f"dense_{i}"))
              for i, units in enumerate(hidden)]
    blocks.append(("logits", DenseBlock(num_classes, None, 0.0, seeds(), name="logits")))
    return Network(blocks, loss=loss, inputs="image", metrics=metrics, loss_fields=("label",))
