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


def _values(outputs, batch, label_key: str):
    """Float targets and the outputs in their shape, both float32."""
    targets = tf.cast(batch[label_key], tf.float32)
    return tf.reshape(tf.cast(outputs, tf.float32), tf.shape(targets)), targets


def regression_loss(label_key: str = "label"):
    """Mean squared error of the outputs against float targets ``batch[label_key]`` (any shape, flattened)."""

    def loss(outputs, batch):
        outputs, targets = _values(outputs, batch, label_key)
        return tf.reduce_mean(tf.square(outputs - targets))

    return loss


def regression_mae(label_key: str = "label"):
    """Mean absolute error of the outputs against float targets."""

    def mae(outputs, batch):
        outputs, targets = _values(outputs, batch, label_key)
        return tf.reduce_mean(tf.abs(outputs - targets))

    return mae


TARGETS = ("class", "float")


def head(targets: str | None, label_key: str = "label") -> tuple:
    """``(loss, metrics)`` for the data's targets: class numbers (softmax cross-entropy, accuracy) or float
    values (mean squared error, mean absolute error ``mae``)."""
    if targets in (None, "class"):
        return classification_loss(label_key), {"accuracy": classification_accuracy(label_key)}
    if targets == "float":
        return regression_loss(label_key), {"mae": regression_mae(label_key)}
    raise ValueError(f"targets={targets!r}: allowed: {', '.join(TARGETS)}.")
