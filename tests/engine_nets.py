"""Small networks that exercise every hard case of the engine, and a plain whole-graph reference loop."""

from __future__ import annotations

import weakref

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import Network


class ConvBN(keras.layers.Layer):
    def __init__(self, filters, seed=0, **kw):
        super().__init__(**kw)
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                        kernel_initializer=keras.initializers.GlorotUniform(seed))
        self.bn = keras.layers.BatchNormalization(momentum=0.8)

    def call(self, x, training=None):
        return tf.nn.relu(self.bn(self.conv(x), training=training))


class SplitSkip(keras.layers.Layer):
    """Returns a tuple border: (features, skip, integer ids)."""

    def __init__(self, filters, seed=0, **kw):
        super().__init__(**kw)
        self.conv = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False,
                                        kernel_initializer=keras.initializers.GlorotUniform(seed))

    def call(self, x, training=None):
        ids = tf.argmax(tf.reduce_mean(x, axis=[1, 2]), axis=-1)
        return self.conv(x), x, ids


class MergeDropout(keras.layers.Layer):
    """Consumes the tuple border: dropout on the features, plus the skip; the ids pass through."""

    def __init__(self, rate=0.3, seed=7, **kw):
        super().__init__(**kw)
        self.bn = keras.layers.BatchNormalization()
        self.dropout = keras.layers.Dropout(rate, seed=seed)

    def call(self, inputs, training=None):
        x, skip, ids = inputs
        return self.dropout(self.bn(x, training=training), training=training) + skip, ids


@tf.custom_gradient
def bernoulli_straight_through(probs, noise):
    sample = tf.cast(noise < probs, probs.dtype)

    def grad(upstream):
        return upstream, tf.zeros_like(noise)

    return sample, grad


class StochasticGate(keras.layers.Layer):
    """A Bernoulli gate drawn through a Keras seed generator, trained through a tf.custom_gradient."""

    def __init__(self, seed=11, **kw):
        super().__init__(**kw)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def build(self, input_shape):
        x_shape = input_shape[0]
        self.logit = self.add_weight(shape=(x_shape[-1],), initializer="zeros", name="logit")

    def call(self, inputs, training=None):
        x, ids = inputs
        probs = tf.sigmoid(self.logit + tf.reduce_mean(x, axis=[1, 2], keepdims=True))
        if training:
            noise = keras.random.uniform(tf.shape(probs), seed=self.seed_generator)
            gate = bernoulli_straight_through(probs, noise)
        else:
            gate = probs
        return x * gate, ids


class Head(keras.layers.Layer):
    """Reads a batch field beside the running tensor."""

    def __init__(self, classes, seed=3, **kw):
        super().__init__(**kw)
        self.dense = keras.layers.Dense(classes, kernel_initializer=keras.initializers.GlorotUniform(seed))
        self.scale = keras.layers.Dense(classes, use_bias=False,
                                        kernel_initializer=keras.initializers.GlorotUniform(seed + 1))

    def call(self, inputs, training=None):
        (x, ids), aux = inputs
        pooled = tf.reduce_mean(x, axis=[1, 2])
        return self.dense(pooled) + self.scale(aux[:, None]) + 0.0 * tf.cast(ids[:, None], pooled.dtype)


def loss_fn(outputs, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["label"], outputs, from_logits=True))


def accuracy_fn(outputs, batch):
    return tf.reduce_mean(tf.cast(tf.equal(tf.argmax(outputs, -1), batch["label"]), tf.float32))


def hard_network(filters=4, classes=3) -> Network:
    """stem | split/a | split/b | gate | head: batch norm, dropout, a custom-gradient stochastic op,
    a tuple border carrying an integer tensor, and a block reading a batch field."""
    return Network(
        blocks=[
            ("stem", ConvBN(filters, seed=1)),
            ("split/a", SplitSkip(filters, seed=2)),
            ("split/b", MergeDropout()),
            ("gate", StochasticGate()),
            ("head", Head(classes), ("aux",)),
        ],
        loss=loss_fn,
        inputs="image",
        metrics={"accuracy": accuracy_fn},
    )


def conv_stack(depth=12, filters=16, classes=10) -> Network:
    """A plain stack of conv + batch-norm blocks (for memory measurements)."""
    head = keras.Sequential([keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(classes)])
    blocks = [("stem", ConvBN(filters, seed=0))]
    blocks += [(f"body/block_{i}", ConvBN(filters, seed=i + 1)) for i in range(depth - 1)]
    blocks += [("head", head)]
    return Network(blocks, loss=loss_fn, inputs="image")


def make_batch(n=16, size=8, channels=2, classes=3, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": tf.constant(rng.normal(size=(n, size, size, channels)).astype("float32")),
        "label": tf.constant(rng.integers(0, classes, size=n).astype("int64")),
        "aux": tf.constant(rng.normal(size=(n,)).astype("float32")),
    }


def twin_networks(factory, batch):
    """Two builds of the same network with identical variables (seed-generator state included)."""
    a, b = factory(), factory()
    a.build(batch)
    b.build(batch)
    assert len(a.variables) == len(b.variables)
    for va, vb in zip(a.variables, b.variables):
        vb.assign(va)
    _STARTS[a] = _STARTS[b] = float_vector(a)
    return a, b


# network -> its float variables as one vector when ``twin_networks`` made it: the start of the update to compare
_STARTS: "weakref.WeakKeyDictionary[Network, np.ndarray]" = weakref.WeakKeyDictionary()


def float_vector(model) -> np.ndarray:
    """Every float variable of a network or Keras model (weights, batch-norm statistics) as one vector."""
    return np.concatenate([np.asarray(v.numpy(), "float64").ravel() for v in model.variables
                           if "float" in str(v.dtype)])


def update_error(ours: np.ndarray, theirs: np.ndarray, start: np.ndarray) -> float:
    """The distance between two updates from ``start`` over the size of the reference's (``theirs``)."""
    update = np.linalg.norm(theirs - start)
    assert update > 0, "the reference did not move"
    return float(np.linalg.norm(ours - theirs) / update)


def reference_train(network, batches, optimizer) -> list[float]:
    """An ordinary whole-graph GradientTape loop, one step per batch: the ground truth the engine must equal."""
    optimizer.build(network.trainable_variables)
    losses = []
    for batch in batches:
        with tf.GradientTape() as tape:
            loss = network.loss(network.forward(batch, training=True), batch)
        grads = tape.gradient(loss, network.trainable_variables)
        optimizer.apply_gradients(zip(grads, network.trainable_variables))
        losses.append(float(loss))
    return losses


def assert_same_variables(a: Network, b: Network, rtol=1e-5, atol=1e-6) -> None:
    """``b``'s variables equal the reference ``a``'s: integer state (seed generators) exactly; float variables, for
    twins (``twin_networks``), over the whole update from their common start (one vector, distance over the
    update's size: Adam turns rounding noise in a near-zero gradient into a full step of one element), the worst
    variables above a noise floor named on failure; for networks of other origin, element by element."""
    for va, vb in zip(a.variables, b.variables):
        if "float" not in str(va.dtype):
            np.testing.assert_array_equal(va.numpy(), vb.numpy(), err_msg=va.path)
    start = _STARTS.get(a)
    if start is None:
        for va, vb in zip(a.variables, b.variables):
            np.testing.assert_allclose(np.asarray(va.numpy(), dtype="float64"),
                                       np.asarray(vb.numpy(), dtype="float64"), rtol=rtol, atol=atol, err_msg=va.path)
        return
    ours, theirs = float_vector(b), float_vector(a)
    error = update_error(ours, theirs, start)
    if error > rtol:
        update = np.linalg.norm(theirs - start)
        detail, at = [], 0
        for va, vb in zip(a.variables, b.variables):
            if "float" not in str(va.dtype):
                continue
            n = int(np.prod(va.shape))
            moved = np.linalg.norm(theirs[at:at + n] - start[at:at + n])
            if moved > 1e-3 * update:  # above the noise floor: a variable that truly moved
                detail.append((np.linalg.norm(ours[at:at + n] - theirs[at:at + n]) / moved, va.path))
            at += n
        worst = ", ".join(f"{path} {e:.2g}" for e, path in sorted(detail, reverse=True)[:3])
        raise AssertionError(f"relative distance over the whole update {error:.3g} > {rtol}; worst: {worst}")


def onednn_bfloat16_apart(precision: str = "mixed_bfloat16"):
    """A pytest mark: where this process runs oneDNN's kernels, a bfloat16 comparison of sections against one graph
    is known to fail. On an Intel Xeon with AVX-512 (TensorFlow 2.21) oneDNN fuses bfloat16 ops differently in a
    section's graph than in one whole graph, and the results part beyond bfloat16's rounding: the exactness report
    read a gradient 0.126 apart (tolerance 0.125) on an 8-channel net, `fit` 1.4e-2 of the update apart, where two
    plain loops agree exactly and the same tests pass with ``TF_ENABLE_ONEDNN_OPTS=0`` (and passed on an AMD EPYC
    with AVX2, oneDNN on). Only there: oneDNN on and a CPU with AVX-512 (the instructions its bfloat16 kernels run
    on); elsewhere the tests check as before. Not strict: at the tolerance's edge a run can pass."""
    from sections.backend.tf_internals import onednn_enabled

    apart = precision == "mixed_bfloat16" and bool(onednn_enabled()) and _cpu_has("avx512bw")
    return pytest.mark.xfail(apart, strict=False,
                             reason="oneDNN's bfloat16 kernels fuse differently per graph (tests/engine_nets.py)")


def _cpu_has(flag: str) -> bool:
    """Whether the CPU lists ``flag`` in /proc/cpuinfo (False where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(flag in line.split() for line in f if line.startswith("flags"))
    except OSError:
        return False
