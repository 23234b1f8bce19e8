"""An encoder-decoder RNN translation model; the encoder hands the decoder only its final state.

Because the border between them has a fixed size, a section holding the encoder is traced once
per source length and one holding the decoder once per target length: source + target buckets
graphs, not their product.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from sections import Network

from ._util import SeedStream, check_int, reject_data_args, serializable
from .losses import PAD_ID, sequence_loss, token_accuracy

CELLS = ("gru", "lstm")


def _rnn(cell: str, units: int, seed: int, **kwargs):
    layer = keras.layers.GRU if cell == "gru" else keras.layers.LSTM
    return layer(units, kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
                 recurrent_initializer=keras.initializers.Orthogonal(seed=seed + 1), seed=seed + 2, **kwargs)


def _embedding(vocab_size: int, embed_dim: int, seed: int) -> keras.layers.Embedding:
    return keras.layers.Embedding(vocab_size, embed_dim, name="embed",
                                  embeddings_initializer=keras.initializers.RandomUniform(seed=seed))


@serializable
class Encoder(keras.layers.Layer):
    """Token ids ``[batch, source_len]`` to the RNN's final state (padding skipped): ``h``, or ``(h, c)`` for LSTM."""

    def __init__(self, vocab_size: int, embed_dim: int, units: int, cell: str = "gru", seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.embed_dim, self.units, self.cell, self.seed = vocab_size, embed_dim, units, cell, seed
        self.embed = _embedding(vocab_size, embed_dim, seed)
        self.rnn = _rnn(cell, units, seed + 1, return_state=True, name="rnn")

    def build(self, input_shape):
        self.embed.build(input_shape)
        self.rnn.build((*input_shape, self.embed_dim))

    def call(self, source, training=False):
        _, *state = self.rnn(self.embed(source), mask=tf.not_equal(source, PAD_ID), training=training)
        return state[0] if self.cell == "gru" else tuple(state)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "embed_dim": self.embed_dim,
                "units": self.units, "cell": self.cell, "seed": self.seed}


@serializable
class Decoder(keras.layers.Layer):
    """``(encoder state, target_in)`` to next-token logits ``[batch, target_len, vocab]`` (teacher forcing)."""

    def __init__(self, vocab_size: int, embed_dim: int, units: int, cell: str = "gru", seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.embed_dim, self.units, self.cell, self.seed = vocab_size, embed_dim, units, cell, seed
        self.embed = _embedding(vocab_size, embed_dim, seed)
        self.rnn = _rnn(cell, units, seed + 1, return_sequences=True, name="rnn")
        self.logits = keras.layers.Dense(vocab_size, kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 3),
                                         name="logits")

    def build(self, input_shape):
        _, target_shape = input_shape
        self.embed.build(target_shape)
        self.rnn.build((*target_shape, self.embed_dim))
        self.logits.build((*target_shape, self.units))

    def call(self, inputs, training=False):
        state, target_in = inputs
        state = [state] if self.cell == "gru" else list(state)
        h = self.rnn(self.embed(target_in), initial_state=state, training=training)
        return self.logits(h)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "embed_dim": self.embed_dim,
                "units": self.units, "cell": self.cell, "seed": self.seed}


def build_seq2seq(
    vocab_size: int | None = None,
    embed_dim: int = 64,
    units: int = 256,
    cell: str = "gru",
    seed: int = 0,
    num_classes: int | None = None,
    input_shape=None,
) -> Network:
    """Blocks ``encoder`` (reads ``source``) and ``decoder`` (also reads ``target_in``); loss on ``target_out``.

    Args:
        vocab_size: tokens, padding (id 0) included; supplied by sequence data (``data=sequences``).
        embed_dim: embedding size of source and target tokens.
        units: RNN state size (the border between the two sections).
        cell: ``"gru"`` or ``"lstm"``.
        seed: makes initial weights reproducible.
        num_classes, input_shape: image data's arguments; given, they raise a ValueError naming the mix-up.
    """
    reject_data_args("seq2seq", "sequence data (vocab_size; data=sequences)", num_classes=num_classes,
                     input_shape=input_shape)
    if vocab_size is None:
        raise ValueError("seq2seq needs vocab_size, supplied by sequence data (data=sequences or "
                         "data=synthetic with kind=sequences); got None.")
    vocab_size = check_int("vocab_size", vocab_size, minimum=2)
    embed_dim, units = check_int("embed_dim", embed_dim), check_int("units", units)
    if cell not in CELLS:
        raise ValueError(f"cell={cell!r}: allowed are {list(CELLS)}.")
    seeds = SeedStream(seed)
    blocks = [
        ("encoder", Encoder(vocab_size, embed_dim, units, cell, seeds(), name="encoder")),
        ("decoder", Decoder(vocab_size, embed_dim, units, cell, seeds(), name="decoder"), ("target_in",)),
    ]
    return Network(blocks, loss=sequence_loss(), inputs="source", metrics={"accuracy": token_accuracy()},
                   loss_fields=("target_out",))
