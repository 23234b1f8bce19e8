"""Losses and metrics as ``fn(outputs, batch) -> scalar``, reading labels from the batch."""

from __future__ import annotations

import tensorflow as tf

PAD_ID = 0


def classification_loss(label_key: str = "label"):
    """Mean softmax cross-entropy of logits against integer labels ``batch[label_key]``."""

    def loss(logits, batch):
        labels = tf.cast(batch[label_key], tf.int32)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=tf.cast(logits, tf.float32))
        return tf.reduce_mean(ce)

    return loss


def classification_accuracy(label_key: str = "label"):
    """Fraction of examples whose arg-max logit is the label."""

    def accuracy(logits, batch):
        labels = tf.cast(batch[label_key], tf.int32)
        hits = tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), labels)
        return tf.reduce_mean(tf.cast(hits, tf.float32))

    return accuracy


def sequence_loss(target_key: str = "target_out", pad_id: int = PAD_ID):
    """Softmax cross-entropy per target token, averaged over the tokens that are not padding."""

    def loss(logits, batch):
        targets = tf.cast(batch[target_key], tf.int32)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=tf.cast(logits, tf.float32))
        mask = tf.cast(tf.not_equal(targets, pad_id), tf.float32)
        return tf.reduce_sum(ce * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)

    return loss


def token_accuracy(target_key: str = "target_out", pad_id: int = PAD_ID):
    """Fraction of non-padding target tokens predicted exactly."""

    def accuracy(logits, batch):
        targets = tf.cast(batch[target_key], tf.int32)
        hits = tf.cast(tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), targets), tf.float32)
        mask = tf.cast(tf.not_equal(targets, pad_id), tf.float32)
        return tf.reduce_sum(hits * mask) / tf.maximum(tf.reduce_sum(mask), 1.0)

    return accuracy
