"""A data source written against the contract in docs/DATA.md: images of stripes, the class is their direction.

    python -m runner 'hydra.searchpath=[file://docs/examples/conf]' data=stripes model=mlp train=smoke

(docs/examples/conf/data/stripes.yaml points here.) Nothing is stored: example i of an epoch is drawn from (seed, epoch, i) with stateless ops, so the same seed gives
the same batches and the iterator's checkpoint holds only counters.
"""

from __future__ import annotations

import tensorflow as tf

from models.data import BaseSource  # defaults for what this source has nothing to say about (fingerprint, size ...)

ANGLES = (0.0, 0.785, 1.571, 2.356)  # four stripe directions: the four classes


class Stripes(BaseSource):
    metric = "accuracy"              # what the network reports and the runner optimizes
    metric_direction = "maximize"

    def __init__(self, size: int = 16, test_size: int = 64):
        self.name = "stripes"
        self.size, self.test_size = size, test_size
        self.model_args = {"num_classes": len(ANGLES), "input_shape": (size, size, 1)}
        self.info = {"class_names": ["0deg", "45deg", "90deg", "135deg"]}   # optional: recorded in data.json

    def describe(self) -> str:       # optional: the run header's data line
        return f"stripes: {self.size}x{self.size}x1 in [-1, 1], {len(ANGLES)} classes"

    def _example(self, key):
        label = tf.random.stateless_uniform([], key, 0, len(ANGLES), tf.int32)
        phase = tf.random.stateless_uniform([], key + 1, 0, 6.283)
        angle = tf.gather(tf.constant(ANGLES), label)
        r = tf.range(self.size, dtype=tf.float32)
        u = tf.cos(angle) * r[None, :] + tf.sin(angle) * r[:, None]
        return {"image": tf.sin(u + phase)[..., None], "label": label}

    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless batches of exactly batch_size; example i drawn from (seed, i) (every row made: shard ignored)."""
        ds = tf.data.Dataset.counter().map(lambda i: self._example(tf.stack([tf.constant(seed, tf.int64), i])))
        options = tf.data.Options()
        options.experimental_symbolic_checkpoint = True  # the checkpoint holds the counter, not prefetched batches
        return ds.batch(batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE).with_options(options)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """The same test_size held-out examples every time (their own seed), in order."""
        keys = tf.data.Dataset.range(self.test_size).map(lambda i: tf.stack([tf.constant(2**40, tf.int64), i]))
        return keys.map(self._example).batch(batch_size)


def stripes(size: int = 16, test_size: int = 64) -> Stripes:
    """The builder `_target_` names; its return annotation tells sweeps the metric's direction."""
    return Stripes(size, test_size)
