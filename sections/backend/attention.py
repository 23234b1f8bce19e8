"""Lean attention: dot-product attention whose backward keeps its query, key and value, never the n x n scores.

``attention(q, k, v, ...)`` computes ``softmax(q k^T * scale, masked) v`` (with dropout on the weights) a block of
query rows at a time, in the forward and again in the backward: the backward re-makes each block's scores,
softmax and dropout result from ``q``, ``k`` and ``v`` and turns them into that block's gradients before the next
block starts. No ``batch x heads x n x n`` tensor is held whole, in the forward or the backward: at most one
block's (``QUERY_BLOCK`` rows). The math is Keras's (``MultiHeadAttention._compute_attention``): the query
scaled first, masked scores filled with Keras's large negative number, masked weights zeroed after the softmax.

Dropout: the keep mask of every block is the slice of the mask that Keras's own dropout draws for the whole
weights tensor from the same seed (``tf.nn.experimental.stateless_dropout``: TensorFlow's Philox generator,
skipped to the block's first element), so a step equals Keras's, dropout included. The forward keeps each
block's keep mask for the backward packed one bit a weight (``B x N x T x S / 8`` bytes, 1/32 of one float32
``n x n`` tensor: 4 MiB for ``[2, 4, 2048, 2048]``) instead of drawing it again: the draw is the costliest part of
the re-make on a CPU (about 0.1 s for that shape). Where the generator is not Philox (a TPU), or shapes are not known
when tracing, the layer runs Keras's own computation. Under XLA (``jit_compile=True``) every block's shape is known
when compiled (its draws included), so a block reads every key unless the causal flag says how many.

Inside ``lean_scope`` (on with ``lean=True`` and ``"recompute"``) every ``keras.layers.MultiHeadAttention`` (and a
subclass that keeps its ``_compute_attention``, such as keras-hub's ``CachedMultiHeadAttention`` in GPT-2, BERT
and ViT) runs it; a call asking for the attention scores, or with attention axes other than the sequence, runs
Keras's own.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import keras
import tensorflow as tf

from . import keras_internals as internals
from . import tf_internals
from .graph_gradient import custom_gradient

__all__ = ["attention", "lean_attention", "QUERY_BLOCK", "attention_traces"]

QUERY_BLOCK = 256  # query rows per block: a block's scores are batch x heads x QUERY_BLOCK x keys
_PHILOX = 1  # tf.random.Algorithm.PHILOX
_traces = {"forward": 0, "backward": 0}


def attention_traces() -> dict:
    """How many lean attention forwards and backwards were traced so far (tests read it to prove the path ran)."""
    return dict(_traces)


def attention(q, k, v, *, scale: float, mask=None, causal: bool = False, dropout: float = 0.0, seed=None,
              style: str = "explicit", block: int | None = None):
    """``[B, T, N, H] x [B, S, N, H] x [B, S, N, Hv] -> [B, T, N, Hv]``, a query block at a time.

    Args:
        scale: the scores' factor (Keras: ``1 / sqrt(key_dim)``).
        mask: boolean (or 0/1), broadcastable to ``[B, T, S]`` (rank 3) or ``[B, N, T, S]``; False: not attended.
        causal: position ``t`` attends to ``s <= t`` only (with ``mask``, both apply).
        dropout: the rate on the attention weights; ``seed``: the int32 ``[2]`` seed Keras's dropout would use.
        style: whose rounding to follow, one of ``STYLES``: ``"explicit"`` (Keras's ``MultiHeadAttention``
            with dropout: the query scaled in its dtype, the softmax in the scores' dtype, masked scores filled
            with -1e9 (-3e4 in float16) and masked weights zeroed); ``"fused"`` (Keras's
            ``ops.dot_product_attention``: scores cast to at least float32, then scaled, softmax there, masked
            scores filled with -0.7 x the dtype's largest, fully masked rows uniform); ``"float32"`` (the
            runner's ``gpt``: as ``fused`` with the float32 minimum as the fill); ``"explicit_float32"``
            (keras-hub's Gemma: as ``explicit`` with the softmax in float32, whatever the scores' dtype).
        block: query rows per block (default ``QUERY_BLOCK``).
    """
    if style not in STYLES:
        raise ValueError(f"style={style!r}: must be one of {STYLES}")
    xla = tf_internals.in_xla_compile()
    q, k, v = (tf.convert_to_tensor(t) for t in (q, k, v))
    args = [q, k, v]
    if mask is not None:
        mask = tf.convert_to_tensor(mask)
        mask = mask if mask.dtype == tf.bool else tf.greater(mask, tf.cast(0.5, mask.dtype))
        mask = mask[:, tf.newaxis] if mask.shape.rank == 3 else mask
        args.append(mask)
    if dropout > 0.0:
        args.append(tf.cast(seed, tf.int32))
    spec = SimpleNamespace(scale=float(scale), causal=bool(causal), rate=float(dropout), has_mask=mask is not None,
                 style=style, rows=int(block or QUERY_BLOCK), static=xla)
    return _lean(spec)(*args)


STYLES = ("explicit", "explicit_float32", "fused", "float32")


def _lean(spec):
    @custom_gradient
    def lean_attention(q, k, v, *extra):
        mask = extra[0] if spec.has_mask else None
        seed = extra[-1] if spec.rate > 0 else None
        _traces["forward"] += 1
        blocks = _blocks(q.shape[1], spec.rows)
        qt, kt, vt = _heads_first(q, k, v)  # once: each block's products then need no transposes
        outs, packed, after = [], [], []
        for t0, t1 in blocks:
            with tf.control_dependencies(after):  # one block at a time: each waits for the one before
                b = _weights(spec, tf.shape(q), qt, kt, v.dtype, mask, seed, t0, t1)
                out = tf.matmul(b.pd, _upto(vt, b.reach))
                if b.kept is not None:  # for the backward: one bit per weight (pruned where no gradient is asked)
                    packed.append(_pack(b.kept))
            outs.append(out)
            after = [out]
        y = _tokens_first(outs[0] if len(outs) == 1 else tf.concat(outs, axis=2))

        def grad(dy):
            _traces["backward"] += 1
            dq_blocks, dk, dv, after = [], None, None, [dy]  # nothing runs before dy: else during the forward
            with tf.control_dependencies(after):
                qt, kt, vt = _heads_first(q, k, v)  # again from q, k, v: the forward's copies are not kept
                dyt = tf.transpose(dy, [0, 2, 1, 3])
            after = [dyt]
            keys = kt.shape[2]
            explicit = spec.style.startswith("explicit")
            for i, (t0, t1) in enumerate(blocks):
                with tf.control_dependencies(after):
                    b = _weights(spec, tf.shape(q), qt, kt, v.dtype, mask, seed, t0, t1,
                                 packed=packed[i] if packed else None)
                    do = dyt[:, :, t0:t1]
                    dv_b = tf.matmul(b.pd, do, transpose_a=True)
                    dpd = tf.matmul(do, _upto(vt, b.reach), transpose_b=True)
                    dp = dpd if spec.rate <= 0 else dpd * b.scaled_keep
                    # Explicit styles zero the masked weights after the softmax: there ``soft`` is 0, so ``ds`` is
                    # 0 whatever ``dp`` holds, and no where is needed on ``dp`` or ``ds``.
                    dp = tf.cast(dp, b.soft.dtype)
                    ds = b.soft * (dp - tf.reduce_sum(dp * b.soft, axis=-1, keepdims=True))
                    if b.where is not None and not explicit:  # a fully masked row's uniform weights pass nothing
                        ds = tf.where(b.where, ds, tf.constant(0, ds.dtype))
                    if explicit:
                        ds = tf.cast(ds, q.dtype)
                        dq_b = tf.matmul(ds, b.ks) * tf.constant(spec.scale, q.dtype)
                    else:  # the scale is applied to the scores, after the cast
                        ds = tf.cast(ds * tf.constant(spec.scale, ds.dtype), q.dtype)
                        dq_b = tf.matmul(ds, b.ks)
                    dk_b = _pad_keys(tf.matmul(ds, b.qs, transpose_a=True), b.reach, keys)
                    dv_b = _pad_keys(dv_b, b.reach, keys)
                    dk = dk_b if dk is None else dk + dk_b
                    dv = dv_b if dv is None else dv + dv_b
                dq_blocks.append(dq_b)
                after = [dq_b, dk, dv]
            dq = dq_blocks[0] if len(dq_blocks) == 1 else tf.concat(dq_blocks, axis=2)
            return [_tokens_first(dq), _tokens_first(dk), _tokens_first(dv)] + [None] * len(extra)

        return y, grad

    return lean_attention


def _heads_first(*tensors):
    """``[B, T, N, H]`` tensors as ``[B, N, T, H]``."""
    return [tf.transpose(t, [0, 2, 1, 3]) for t in tensors]


def _tokens_first(t):
    """``[B, N, T, H]`` as ``[B, T, N, H]``."""
    return tf.transpose(t, [0, 2, 1, 3])


def _blocks(rows: int, size: int) -> list[tuple[int, int]]:
    return [(t0, min(rows, t0 + size)) for t0 in range(0, rows, size)]


class _Block(SimpleNamespace):
    """One query block's weights: ``qs`` (the query rows as the scores read them), ``ks`` (the keys read),
    ``soft`` (the softmax, in its dtype), ``where`` (the positions attended, or None), ``scaled_keep`` (dropout's
    scaled keep mask, or None), ``pd`` (the dropped-out weights in the values' dtype), ``kept`` (the boolean keep
    mask of the keys read, or None) and ``reach`` (the keys the block's products read: all when None, else the
    first ``reach``)."""


def _weights(spec, q_shape, qt, kt, v_dtype, mask, seed, t0, t1, packed=None) -> _Block:
    """Rows ``t0:t1`` (``qt``, ``kt``: ``[B, N, T|S, H]``), rounded as ``spec.style`` says. ``packed``: the block's
    keep mask as the forward drew it (``_pack``ed), not drawn again."""
    keys = kt.shape[2]
    where = _attended(spec, mask, t0, t1, keys)
    reach = _reach(spec, where, t1, keys)
    if reach is not None:
        kt, where = kt[:, :, :reach], where[..., :reach]
    if spec.style.startswith("explicit"):
        qs = qt[:, :, t0:t1] * tf.constant(spec.scale, qt.dtype)
        s = tf.matmul(qs, kt, transpose_b=True)
        if spec.style == "explicit_float32":  # keras.layers.Softmax(dtype="float32"): float64 too
            s = tf.cast(s, tf.float32)
    else:
        qs = qt[:, :, t0:t1]
        s = tf.matmul(qs, kt, transpose_b=True)
        s = tf.cast(s, tf.float64 if s.dtype == tf.float64 else tf.float32)
        s = s * tf.constant(spec.scale, s.dtype)
    if where is not None:
        s = tf.where(where, s, _fill(spec.style, s.dtype))
    soft = tf.nn.softmax(s, axis=-1)
    del s
    if where is not None and spec.style.startswith("explicit"):
        soft = tf.where(where, soft, tf.constant(0, soft.dtype))
    p = tf.cast(soft, v_dtype)
    scaled_keep = kept = None
    if spec.rate > 0:
        if packed is None:
            kept = _upto(_keep(spec.rate, seed, q_shape, keys, t0, t1, p.dtype), reach, axis=3)
        else:
            kept = _unpack(packed, keys if reach is None else reach)
        # stateless_dropout: x * (1 / (1 - rate)) * cast(draw >= rate)
        scaled_keep = tf.constant(1.0 / (1.0 - spec.rate), p.dtype) * tf.cast(kept, p.dtype)
        pd = p * scaled_keep
    else:
        pd = p
    return _Block(qs=qs, ks=kt, soft=soft, where=where, scaled_keep=scaled_keep, pd=pd, kept=kept, reach=reach)


def _reach(spec, where, t1, keys):
    """How many keys the block's products need: ``t1`` under ``causal`` alone (every row attends to a key, so each
    masked weight is exactly 0 in every style); with a mask, up to the last key any row attends to where the style
    zeroes masked weights (explicit: a fully masked row passes nothing either way; the fused styles give such a
    row uniform weights over every key, so they read all). None: all keys. Only the summation's length changes."""
    if spec.causal and not spec.has_mask:
        return None if t1 >= keys else t1
    if where is None or not spec.style.startswith("explicit") or spec.static:
        return None  # (under XLA a block's shape must be known when compiled)
    attended = tf.reduce_max(tf.reshape(tf.cast(where, tf.int32), [-1, keys]), axis=0)  # 4x reduce_any's speed
    last = tf.reduce_max(attended * tf.range(1, keys + 1))
    return tf.maximum(last, 1)


def _upto(t, reach, axis=2):
    """The first ``reach`` entries of ``t`` along ``axis`` (all when ``reach`` is None)."""
    if reach is None:
        return t
    return t[:, :, :reach] if axis == 2 else t[..., :reach]


def _pad_keys(t, reach, keys: int):
    """A ``[B, N, reach, H]`` key-side gradient as ``[B, N, keys, H]`` (zeros past ``reach``)."""
    if reach is None:
        return t
    return tf.pad(t, [[0, 0], [0, 0], [0, keys - reach], [0, 0]])


def _fill(style, dtype):
    """The masked scores' value: Keras's ``Softmax`` layer's, ``ops.dot_product_attention``'s, or float32's minimum."""
    if style == "explicit":
        return tf.constant(-3e4 if dtype == tf.float16 else -1e9, dtype)
    if style == "fused":
        return tf.constant((65500.0 if dtype == tf.float16 else 3.38953e38) * -0.7, dtype)
    return tf.constant(dtype.min, dtype)


def _attended(spec, mask, t0, t1, keys):
    """The block's boolean ``[B|1, N|1, t1-t0, S]`` attended positions, or None when everything is."""
    where = None
    if mask is not None:
        where = mask if mask.shape[2] == 1 else mask[:, :, t0:t1]
    if spec.causal:
        rows = tf.range(t0, t1)[:, tf.newaxis]
        causal = (tf.range(keys)[tf.newaxis, :] <= rows)[tf.newaxis, tf.newaxis]
        where = causal if where is None else tf.logical_and(where, causal)
    return where


def _keep(rate, seed, q_shape, keys: int, t0, t1, dtype):
    """Rows ``t0:t1`` of ``stateless_dropout``'s boolean keep mask for the whole ``[B, N, T, S]`` weights (uniform
    draws in ``dtype``): each (batch, head) row range is a contiguous run of the full tensor's uniform draws, made by
    Philox skipped to it."""
    key, counter = tf.raw_ops.StatelessRandomGetKeyCounter(seed=seed)
    alg = tf.raw_ops.StatelessRandomGetAlg()
    batch, rows, heads = q_shape[0], q_shape[1], q_shape[2]
    size = (t1 - t0) * keys  # Python ints: every draw's shape is known when traced, so XLA compiles it
    per_step = 2 if dtype == tf.float64 else 4  # one Philox step: four 32-bit words, two per float64 draw
    # every (batch, head)'s counter and skip at once: the loop below only draws (few ops an iteration)
    starts = (tf.range(tf.cast(batch * heads, tf.int64)) * tf.cast(rows, tf.int64) + t0) * keys
    counters, skips = _add(counter, starts // per_step), starts % per_step

    def one(counter_skip):
        counter_bn, skip = counter_skip  # the run starts `skip` words into its counter's first Philox step
        u = tf.raw_ops.StatelessRandomUniformV2(shape=[size + per_step - 1], key=key, counter=counter_bn,
                                                alg=alg, dtype=dtype)
        return tf.slice(u, tf.reshape(skip, [1]), [size])

    draws = tf.map_fn(one, (counters, skips), fn_output_signature=tf.TensorSpec([size], dtype))
    draws = tf.reshape(draws, [batch, heads, t1 - t0, keys])
    return draws >= tf.constant(rate, dtype)


_BITS = (1, 2, 4, 8, 16, 32, 64, 128)


def _pack(kept):
    """A boolean ``[..., S]`` mask as ``[..., ceil(S / 8)]`` uint8, eight positions a byte (1/32 of float32's);
    ``S`` may be known only when run."""
    keys = kept.shape[-1]
    if keys is None or keys % 8:
        pad = -tf.shape(kept)[-1] % 8
        kept = tf.pad(kept, [[0, 0]] * (kept.shape.rank - 1) + [[0, pad]])
    shape = tf.concat([tf.shape(kept)[:-1], [-1, 8]], axis=0)
    bits = tf.reshape(tf.cast(kept, tf.uint8), shape) * tf.constant(_BITS, tf.uint8)
    return tf.reduce_sum(bits, axis=-1)  # distinct powers of two: the sum is their bitwise or


def _unpack(packed, keys):
    """``_pack``'s inverse: the ``[..., keys]`` boolean mask (``keys`` an int or a scalar tensor)."""
    bits = tf.bitwise.bitwise_and(packed[..., tf.newaxis], tf.constant(_BITS, tf.uint8)) > 0
    shape = tf.concat([tf.shape(packed)[:-1], [-1]], axis=0)
    kept = tf.reshape(bits, shape)
    return kept if isinstance(keys, int) and keys % 8 == 0 else kept[..., :keys]


def _add(counter, steps):
    """Philox's 128-bit counter (two uint64 words, low first) advanced by ``steps`` (a scalar: ``[2]``; a vector of
    ``n``: ``[n, 2]``)."""
    steps = tf.cast(steps, tf.uint64)
    low = counter[0] + steps
    carry = tf.cast(low < steps, tf.uint64)
    return tf.stack([low, counter[1] + carry], axis=-1)


@functools.cache
def philox() -> bool:
    """Whether TensorFlow's stateless random ops here use Philox (CPUs and GPUs; TPUs use ThreeFry)."""
    with tf.init_scope():  # eagerly, also while tracing
        return int(tf.raw_ops.StatelessRandomGetAlg()) == _PHILOX


# ---------------------------------------------------------------------------------------------- Keras layers
def draw_seed(generator) -> tf.Tensor:
    """The int32 seed Keras's dropout draws from ``generator`` (advancing it as Keras's does)."""
    seed = generator.next()
    if seed.dtype != tf.int32:  # keras.src.backend.tensorflow.random._cast_seed
        seed = tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)
    return seed


def mha_compute_attention(layer, original, query, key, value, attention_mask=None, training=None,
                          return_attention_scores=False, use_causal_mask=False):
    """``MultiHeadAttention._compute_attention`` by ``attention``, or ``NotImplemented`` to run Keras's own."""
    settings = internals.attention_settings(layer)
    if (settings is None or return_attention_scores or not _static(query, key, value)
            or not query.dtype.is_floating):
        return NotImplemented
    rate = settings["rate"] if training else 0.0
    if settings["rate"] > 0 and training is None:
        return NotImplemented  # Keras's dropout would resolve it from the call context
    if rate > 0 and (settings["seeds"] is None or not philox()):
        return NotImplemented
    seed = draw_seed(settings["seeds"]) if rate > 0 else None
    # Keras runs ops.dot_product_attention without dropout, its own softmax-and-dropout path with it.
    out = attention(query, key, value, scale=settings["scale"], mask=attention_mask,
                    causal=bool(use_causal_mask) and attention_mask is None, dropout=rate, seed=seed,
                    style="explicit" if settings["rate"] > 0 else "fused")
    return out, None


def gemma_compute_attention(layer, original, q, k, v, attention_mask, training=False, cache_update_index=0):
    """keras-hub's ``CachedGemmaAttention._compute_attention`` (grouped-query attention: each key/value head
    serves ``num_query_heads / num_key_value_heads`` query heads) by ``attention``, or ``NotImplemented``: a logit
    soft cap (Gemma 2), the fused op (a GPU or TPU), or shapes unknown when traced run keras-hub's own."""
    settings = internals.gemma_settings(layer)
    if settings is None or layer.logit_soft_cap is not None or settings["fused"] or not _static(q, k, v):
        return NotImplemented
    rate = float(layer.dropout) if training else 0.0
    if rate > 0 and not philox():
        return NotImplemented
    if layer.query_head_dim_normalize:
        scale = 1 / math.sqrt(layer.head_dim)
    else:
        scale = 1 / math.sqrt(layer.hidden_dim // layer.num_query_heads)
    if layer.use_sliding_window_attention and attention_mask is not None:
        attention_mask = settings["sliding_window"](attention_mask, cache_update_index=cache_update_index)
    groups = layer.num_query_heads // layer.num_key_value_heads
    if groups > 1:  # query head n reads key/value head n // groups, as keras-hub's "btkgh,bskh" grouping
        k, v = tf.repeat(k, groups, axis=2), tf.repeat(v, groups, axis=2)
    if rate > 0 and settings["seeds"] is None:
        return NotImplemented
    seed = draw_seed(settings["seeds"]) if rate > 0 else None
    return attention(q, k, v, scale=scale, mask=attention_mask, dropout=rate, seed=seed, style="explicit_float32")


def _static(*tensors) -> bool:
    return all(isinstance(t, tf.Tensor) and t.shape.rank == 4 and t.shape[1] is not None and t.shape[-1] is not None
               for t in tensors)


def lean_attention(q, k, v, *, scale: float, causal: bool = False, mask=None, dropout: float = 0.0,
                   seed_generator=None, style: str = "float32"):
    """``attention`` for a model's own attention layer: with ``dropout > 0`` it draws its seed from
    ``seed_generator`` as a Keras ``Dropout`` layer with that generator would (so the keep mask is the one that
    layer would draw on the weights). None where shapes are not known while tracing (run your own then)."""
    if not _static(q, k, v):
        return None
    if dropout > 0 and (seed_generator is None or not philox()):
        return None
    seed = draw_seed(seed_generator) if dropout > 0 else None
    return attention(q, k, v, scale=scale, causal=causal, mask=mask, dropout=dropout, seed=seed, style=style)
