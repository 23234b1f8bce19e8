"""The reversal task: decode the source backwards, then end-of-sequence tokens, with independent lengths.

A batch draws a source bucket and a target bucket independently; every sequence in it is padded to
those lengths. Tokens: ``PAD=0``, ``BOS=1``, ``EOS=2``, symbols ``3..``. For a source ``x`` of
length ``s`` and a target of length ``t``, ``target_out[j] = x[s-1-j]`` for ``j < s`` and ``EOS``
after, cut or filled to ``t``; ``target_in`` is ``BOS`` followed by ``target_out`` shifted right.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from ..losses import PAD_ID
from ._source import AUTOTUNE, check_batch_size, check_seed
from .source import BaseSource

BOS_ID, EOS_ID, FIRST_SYMBOL = 1, 2, 3
EVAL_SEED = 2**40 + 17


def _check_buckets(name: str, buckets) -> list[int]:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Sequence) or not buckets:
        raise ValueError(f"{name}={buckets!r}: must be a non-empty list of increasing lengths >= 1.")
    values = list(buckets)
    if any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1 for b in values) \
            or values != sorted(set(values)):
        raise ValueError(f"{name}={buckets!r}: must be a non-empty list of increasing lengths >= 1.")
    return [int(b) for b in values]


class SequenceSource(BaseSource):
    """Reversal-task batches ``{"source", "target_in", "target_out"}`` (int32), one bucket pair per batch.

    Args:
        name: the data set's name.
        num_symbols: distinct content tokens.
        source_buckets, target_buckets: padded lengths; each batch picks one of each independently.
        vary_lengths: give each sequence its own length in ``(previous bucket, bucket]``
            (padding the rest); ``False`` fills every bucket exactly.
        eval_size: examples in the held-out set (at least one batch per bucket pair).
    """

    metric = "accuracy"
    metric_direction = "maximize"  # higher is better (runner.config.direction: what a sweep optimizes)

    def __init__(self, name: str, num_symbols: int, source_buckets, target_buckets,
                 vary_lengths: bool = True, eval_size: int = 2048):
        if isinstance(num_symbols, bool) or not isinstance(num_symbols, (int, np.integer)) or num_symbols < 1:
            raise ValueError(f"num_symbols={num_symbols!r}: must be an integer >= 1.")
        self.name = name
        self.num_symbols = int(num_symbols)
        self.source_buckets = _check_buckets("source_buckets", source_buckets)
        self.target_buckets = _check_buckets("target_buckets", target_buckets)
        self.vary_lengths = bool(vary_lengths)
        self.eval_size = check_batch_size(eval_size)
        self.vocab_size = FIRST_SYMBOL + self.num_symbols
        self.model_args = {"vocab_size": self.vocab_size}

    @property
    def bucket_pairs(self) -> list[tuple[int, int]]:
        return [(s, t) for s in self.source_buckets for t in self.target_buckets]

    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless batches, each from a bucket pair drawn from ``(seed, batch index)``."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        ds = tf.data.Dataset.counter().map(lambda i: self._batch(i, batch_size, seed),
                                           num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds.prefetch(AUTOTUNE)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """A fixed held-out set cycling through every bucket pair (``eval_size`` examples, rounded up)."""
        batch_size = check_batch_size(batch_size)
        pairs = len(self.bucket_pairs)
        count = max(pairs, -(-self.eval_size // batch_size))
        ds = tf.data.Dataset.range(count).map(lambda i: self._batch(i, batch_size, EVAL_SEED, i % pairs))
        return ds.prefetch(AUTOTUNE)

    def _batch(self, index, batch_size: int, seed: int, pair=None) -> dict:
        keys = tf.random.experimental.stateless_split(tf.stack([tf.constant(seed, tf.int64), index]), 5)
        if pair is None:
            si = tf.random.stateless_uniform([], keys[0], 0, len(self.source_buckets), tf.int32)
            ti = tf.random.stateless_uniform([], keys[1], 0, len(self.target_buckets), tf.int32)
        else:
            si = tf.cast(pair, tf.int32) // len(self.target_buckets)
            ti = tf.cast(pair, tf.int32) % len(self.target_buckets)
        s_max, s = self._lengths(self.source_buckets, si, batch_size, keys[2])
        t_max, t = self._lengths(self.target_buckets, ti, batch_size, keys[3])
        tokens = tf.random.stateless_uniform([batch_size, s_max], keys[4], FIRST_SYMBOL, self.vocab_size, tf.int32)
        i = tf.range(s_max)[None, :]
        source = tf.where(i < s[:, None], tokens, PAD_ID)
        j = tf.range(t_max)[None, :]
        reversed_ = tf.gather(tokens, tf.clip_by_value(s[:, None] - 1 - j, 0, s_max - 1), batch_dims=1)
        inside = j < t[:, None]
        target_out = tf.where(inside, tf.where(j < s[:, None], reversed_, EOS_ID), PAD_ID)
        shifted = tf.concat([tf.fill([batch_size, 1], BOS_ID), target_out[:, :-1]], axis=1)
        target_in = tf.where(inside, shifted, PAD_ID)
        return {"source": source, "target_in": target_in, "target_out": target_out}

    def _lengths(self, buckets: list[int], index, batch_size: int, key):
        """The bucket's padded length and per-sequence lengths in ``(previous bucket, bucket]``."""
        top = tf.gather(buckets, index)
        if not self.vary_lengths:
            return top, tf.fill([batch_size], top)
        low = tf.gather([0] + buckets[:-1], index) + 1
        u = tf.random.stateless_uniform([batch_size], key)
        return top, low + tf.cast(u * tf.cast(top - low + 1, tf.float32), tf.int32)

    def __repr__(self) -> str:
        return (f"SequenceSource({self.name!r}, vocab={self.vocab_size}, source_buckets={self.source_buckets}, "
                f"target_buckets={self.target_buckets})")


def sequences(num_symbols: int = 10, source_buckets: Sequence[int] = (4, 8, 12),
              target_buckets: Sequence[int] = (4, 8, 12), vary_lengths: bool = True,
              eval_size: int = 2048) -> SequenceSource:
    """The reversal task with independent source and target buckets (see ``SequenceSource``)."""
    return SequenceSource("sequences", num_symbols, source_buckets, target_buckets, vary_lengths, eval_size)
