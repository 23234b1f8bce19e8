"""A GPT-style decoder-only transformer language model, one block per transformer layer.

Blocks: ``embed`` (token + learned position embeddings, dropout), ``layer_0`` .. ``layer_{N-1}``
(pre-norm: LayerNorm, causal multi-head self-attention, residual; LayerNorm, 4x GELU MLP, residual),
``head`` (final LayerNorm and next-token logits, optionally through the token embedding: weight tying).
So ``sections=<int>`` cuts between transformer layers, and every border is ``[batch, time, d_model]``.
Dropout goes through seeded Keras ``Dropout`` layers, whose draws a section re-run replays.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from sections import Network, lean_attention, lean_attention_active

from .losses import classification_accuracy, classification_loss
from ._util import SeedStream, check_int, check_rate, reject_data_args, serializable

LN2 = math.log(2.0)


def _normal(seed: int, std: float = 0.02):
    return keras.initializers.RandomNormal(stddev=std, seed=seed)


@tf.custom_gradient
def dense_gradient(table):
    """Identity whose gradient is a dense tensor, not ``tf.IndexedSlices``.

    A lookup's gradient holds one slice per occurrence of a token; Keras 3's optimizers square such
    slices one by one (Adam's second moment sums ``g_i**2`` over the repeats of a row instead of taking
    ``(sum g_i)**2``), so frequent characters would get a smaller step than Adam's. Dense, the update is
    Adam's, and whole-graph, sectioned and ``tf.recompute_grad`` steps agree. The table is small.
    """
    return tf.identity(table), lambda upstream: tf.convert_to_tensor(upstream)


@serializable
class Embed(keras.layers.Layer):
    """Token ids ``[batch, time]`` to ``token_embedding + position_embedding`` ``[batch, time, d_model]``, then dropout."""

    def __init__(self, vocab_size: int, seq_len: int, d_model: int, dropout: float = 0.0, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.seq_len, self.d_model, self.dropout, self.seed = vocab_size, seq_len, d_model, dropout, seed
        self.token = keras.layers.Embedding(vocab_size, d_model, embeddings_initializer=_normal(seed), name="token")
        self.position = keras.layers.Embedding(seq_len, d_model, embeddings_initializer=_normal(seed + 1),
                                               name="position")
        self.drop = keras.layers.Dropout(dropout, seed=seed + 2, name="dropout")

    def build(self, input_shape):
        self.token.build(input_shape)
        self.position.build((self.seq_len,))

    def call(self, tokens, training=False):
        table = tf.cast(dense_gradient(tf.convert_to_tensor(self.token.embeddings)), self.compute_dtype)
        positions = self.position(tf.range(tf.shape(tokens)[1]))  # each position once: sparse is exact
        return self.drop(tf.gather(table, tokens) + positions, training=training)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size, "seq_len": self.seq_len,
                "d_model": self.d_model, "dropout": self.dropout, "seed": self.seed}


@serializable
class CausalSelfAttention(keras.layers.Layer):
    """Multi-head self-attention where position ``t`` attends to positions ``<= t`` only.

    One projection makes queries, keys and values; the attention weights get dropout; the output
    projection's initial scale is ``out_std``.
    """

    def __init__(self, d_model: int, num_heads: int, dropout: float = 0.0, out_std: float = 0.02, seed: int = 0,
                 **kwargs):
        super().__init__(**kwargs)
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of num_heads={num_heads}.")
        self.d_model, self.num_heads, self.dropout, self.out_std, self.seed = d_model, num_heads, dropout, out_std, seed
        self.qkv = keras.layers.Dense(3 * d_model, kernel_initializer=_normal(seed), name="qkv")
        self.out = keras.layers.Dense(d_model, kernel_initializer=_normal(seed + 1, out_std), name="out")
        self.drop = keras.layers.Dropout(dropout, seed=seed + 2, name="dropout")

    def build(self, input_shape):
        self.qkv.build(input_shape)
        self.out.build(input_shape)

    def call(self, x, training=False):
        batch, time = tf.shape(x)[0], tf.shape(x)[1]
        head_dim = self.d_model // self.num_heads
        qkv = tf.reshape(self.qkv(x), [batch, time, 3, self.num_heads, head_dim])
        if lean_attention_active():  # the engine's lean scope: no [time, time] tensor kept for the backward
            y = lean_attention(*tf.unstack(qkv, axis=2), scale=1.0 / math.sqrt(head_dim), causal=True,
                               dropout=self.dropout if training else 0.0, seed_generator=getattr(self.drop, "seed_generator", None))
            if y is not None:
                return self.out(tf.reshape(y, [batch, time, self.d_model]))
        q, k, v = (tf.transpose(t, [0, 2, 1, 3]) for t in tf.unstack(qkv, axis=2))  # [batch, heads, time, dim]
        scores = tf.cast(tf.matmul(q, k, transpose_b=True), tf.float32) / math.sqrt(head_dim)
        causal = tf.linalg.band_part(tf.ones([time, time], tf.bool), -1, 0)
        weights = tf.nn.softmax(tf.where(causal, scores, tf.float32.min), axis=-1)
        weights = self.drop(tf.cast(weights, v.dtype), training=training)
        y = tf.transpose(tf.matmul(weights, v), [0, 2, 1, 3])
        return self.out(tf.reshape(y, [batch, time, self.d_model]))

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
                "dropout": self.dropout, "out_std": self.out_std, "seed": self.seed}


@serializable
class TransformerLayer(keras.layers.Layer):
    """``x + drop(attention(norm(x)))``, then ``x + drop(mlp(norm(x)))`` with a ``mlp_ratio``-wide GELU MLP."""

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int = 4, dropout: float = 0.0, num_layers: int = 1,
                 seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.d_model, self.num_heads, self.mlp_ratio = d_model, num_heads, mlp_ratio
        self.dropout, self.num_layers, self.seed = dropout, num_layers, seed
        out_std = 0.02 / math.sqrt(2 * num_layers)  # GPT-2: residual projections scaled by depth
        self.norm_1 = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_1")
        self.attention = CausalSelfAttention(d_model, num_heads, dropout, out_std, seed, name="attention")
        self.drop_1 = keras.layers.Dropout(dropout, seed=seed + 3, name="dropout_1")
        self.norm_2 = keras.layers.LayerNormalization(epsilon=1e-5, name="norm_2")
        self.fc = keras.layers.Dense(mlp_ratio * d_model, kernel_initializer=_normal(seed + 4), name="fc")
        self.proj = keras.layers.Dense(d_model, kernel_initializer=_normal(seed + 5, out_std), name="proj")
        self.drop_2 = keras.layers.Dropout(dropout, seed=seed + 6, name="dropout_2")

    def build(self, input_shape):
        for layer in (self.norm_1, self.attention, self.norm_2, self.fc):
            layer.build(input_shape)
        self.proj.build((*input_shape[:-1], self.mlp_ratio * self.d_model))

    def call(self, x, training=False):
        x = x + self.drop_1(self.attention(self.norm_1(x), training=training), training=training)
        h = tf.nn.gelu(self.fc(self.norm_2(x)), approximate=True)
        return x + self.drop_2(self.proj(h), training=training)

    def get_config(self):
        return {**super().get_config(), "d_model": self.d_model, "num_heads": self.num_heads,
                "mlp_ratio": self.mlp_ratio, "dropout": self.dropout, "num_layers": self.num_layers,
                "seed": self.seed}


@serializable
class Head(keras.layers.Layer):
    """Final LayerNorm, then logits ``[batch, time, vocab]``: a Dense layer, or ``h @ E^T`` with the token
    embedding ``E`` of ``tied`` (an ``Embed`` layer, whose variable then gets gradients from both ends)."""

    def __init__(self, vocab_size: int, tied: Embed | None = None, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.seed = vocab_size, seed
        self.norm = keras.layers.LayerNormalization(epsilon=1e-5, name="norm")
        self.tied = tied
        self.logits = None if tied is not None else keras.layers.Dense(
            vocab_size, kernel_initializer=_normal(seed), name="logits")

    def build(self, input_shape):
        self.norm.build(input_shape)
        if self.logits is not None:
            self.logits.build(input_shape)

    def call(self, x, training=False):
        h = self.norm(x)
        if self.logits is not None:
            return self.logits(h)
        return tf.matmul(h, tf.cast(self.tied.token.embeddings, h.dtype), transpose_b=True)

    def get_config(self):  # the tie is a reference to another layer: rebuild tied heads with build_gpt
        return {**super().get_config(), "vocab_size": self.vocab_size, "seed": self.seed}


def bits_per_token(target_key: str = "targets"):
    """The mean cross-entropy in bits: ``loss / ln 2`` (bits per character for character data)."""
    loss = classification_loss(target_key)
    return lambda logits, batch: loss(logits, batch) / LN2


def build_gpt(
    vocab_size: int | None = None,
    seq_len: int | None = None,
    d_model: int = 96,
    num_layers: int = 3,
    num_heads: int = 3,
    mlp_ratio: int = 4,
    dropout: float = 0.0,
    tie_embeddings: bool = False,
    seed: int = 0,
    num_classes: int | None = None,
    input_shape=None,
    pad_id: int | None = None,
    unit: str | None = None,
) -> Network:
    """Blocks ``embed``, ``layer_0`` .. ``layer_{num_layers-1}``, ``head``; input ``tokens``, loss on ``targets``.

    Args:
        vocab_size: tokens (from the data: ``data=text``).
        seq_len: longest input, the number of learned positions (from the data).
        d_model: width of the residual stream (every border is ``[batch, time, d_model]``).
        num_layers: transformer layers, one block each.
        num_heads: attention heads; must divide ``d_model``.
        mlp_ratio: the MLP's hidden width as a multiple of ``d_model``.
        dropout: rate after the embeddings, on the attention weights and on both residual branches.
        tie_embeddings: compute the logits with the token embedding matrix instead of a separate one.
        seed: makes initial weights and dropout draws reproducible.
        num_classes, input_shape: image data's arguments; given, they raise a ValueError naming the mix-up.
        pad_id, unit: token data's (``data=tokens``); the gpt reads characters, so token rows are refused in one
            line naming ``model=keras_hub``.

    Metrics: ``bits_per_char`` (the loss in bits) and ``accuracy`` (next token).
    """
    reject_data_args("gpt", "text data (vocab_size, seq_len; data=text)", num_classes=num_classes,
                     input_shape=input_shape)
    if unit == "token" or pad_id is not None:
        raise ValueError(f"gpt trains on characters (data=text); token-id rows (data=tokens, pad_id={pad_id!r}) "
                         f"train with model=keras_hub (e.g. model.name=GPT2Backbone)")
    if vocab_size is None or seq_len is None:
        raise ValueError(f"gpt needs vocab_size and seq_len, supplied by text data (data=text); got "
                         f"vocab_size={vocab_size!r}, seq_len={seq_len!r}.")
    vocab_size = check_int("vocab_size", vocab_size, minimum=2)
    seq_len, d_model = check_int("seq_len", seq_len), check_int("d_model", d_model)
    num_layers, num_heads = check_int("num_layers", num_layers), check_int("num_heads", num_heads)
    mlp_ratio, dropout = check_int("mlp_ratio", mlp_ratio), check_rate("dropout", dropout)
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model}: must be a multiple of num_heads={num_heads}.")
    if not isinstance(tie_embeddings, bool):
        raise ValueError(f"tie_embeddings={tie_embeddings!r}: must be true or false.")
    seeds = SeedStream(seed)
    embed = Embed(vocab_size, seq_len, d_model, dropout, seeds(), name="embed")
    blocks = [("embed", embed)]
    blocks += [(f"layer_{i}", TransformerLayer(d_model, num_heads, mlp_ratio, dropout, num_layers, seeds(),
                                               name=f"layer_{i}")) for i in range(num_layers)]
    blocks.append(("head", Head(vocab_size, embed if tie_embeddings else None, seeds(), name="head")))
    # Sparse cross-entropy and arg-max accuracy work per position for [batch, time, vocab] logits too.
    return Network(blocks, loss=classification_loss("targets"), inputs="tokens",
                   metrics={"bits_per_char": bits_per_token(), "accuracy": classification_accuracy("targets")},
                   loss_fields=("targets",))
