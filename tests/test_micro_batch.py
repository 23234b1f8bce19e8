"""Gradient accumulation (``sections.MicroBatched``, the runner's ``train.micro_batch``): micro-batches' gradients
summed by their shares and applied once equal one step over the whole batch (within rounding) for models without
batch statistics; the optimizer and its step count move once per batch."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import sections
from sections import Engine, MicroBatched, Network, RecomputeGrad, WholeGraph
from sections.step.accumulate import micro_sizes, split

BATCH = 24


def make_layers(seed: int = 0, batch_norm: bool = False):
    """Fresh layers (built by their first call), the same initial weights for the same seed."""
    init = lambda k: keras.initializers.GlorotUniform(seed + k)  # noqa: E731
    layers = [keras.layers.Dense(16, activation="tanh", kernel_initializer=init(0)),
              keras.layers.Dense(16, activation="relu", kernel_initializer=init(1)),
              keras.layers.Dense(8, activation="tanh", kernel_initializer=init(2)),
              keras.layers.Dense(3, kernel_initializer=init(3))]
    if batch_norm:
        layers.insert(1, keras.layers.BatchNormalization(momentum=0.8))
    return layers


def loss_fn(logits, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["y"], logits, from_logits=True))


def network(layers):
    return Network(blocks=[(f"b{k}", layer) for k, layer in enumerate(layers)], loss=loss_fn, inputs="x",
                   loss_fields=("y",))


def batches(count: int = 2, size: int = BATCH):
    rng = np.random.default_rng(3)
    return [{"x": tf.constant(rng.normal(size=(size, 5)).astype("float32")),
             "y": tf.constant(rng.integers(0, 3, size=size).astype("int64"))} for _ in range(count)]


def plain_loop(layers, data, optimizer):
    """A user's loop over the whole batch: layers built by their first call, one GradientTape and update per
    step."""
    for b in data:
        with tf.GradientTape() as tape:
            h = b["x"]
            for layer in layers:
                h = layer(h, training=True)
            loss = loss_fn(h, b)
        variables = [v for layer in layers for v in layer.trainable_variables]
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))


def weights(layers) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for layer in layers
                           for v in layer.trainable_variables])


def initial_weights(seed: int = 0) -> np.ndarray:
    layers = make_layers(seed)
    h = batches(1)[0]["x"]
    for layer in layers:
        h = layer(h)
    return weights(layers)


def relative_update_distance(ours: np.ndarray, theirs: np.ndarray, start: np.ndarray) -> float:
    """|Δ ours - Δ theirs| / |Δ theirs|: the whole update (every variable, as one vector) compared."""
    mine, reference = ours - start, theirs - start
    return float(np.linalg.norm(mine - reference) / np.linalg.norm(reference))


TRAINERS = {
    "engine-2-sections": lambda net, opt: Engine(net, opt, sections=2),
    "engine-3-sections-store": lambda net, opt: Engine(net, opt, sections=3,
                                                       policy=["store", "recompute", "recompute"]),
    "engine-auto": lambda net, opt: Engine(net, opt, sections="auto"),  # planned for the micro-batch
    "whole": lambda net, opt: WholeGraph(net, opt, sections=2),
    "recompute_grad": lambda net, opt: RecomputeGrad(net, opt, sections=2),
}


@pytest.mark.parametrize("optimizer,trainer", [
    ("sgd", "engine-2-sections"), ("sgd", "whole"),
    # the same sums under other trainers and Adam (scale-blind at its first step, but its count must move once)
    *[pytest.param(o, t, marks=pytest.mark.slow) for o, t in [
        ("adam", "engine-2-sections"), ("sgd", "engine-3-sections-store"), ("adam", "engine-3-sections-store"),
        ("sgd", "recompute_grad"), ("adam", "recompute_grad"), ("adam", "whole"), ("sgd", "engine-auto")]]])
def test_micro_batches_update_as_one_step_over_the_whole_batch(trainer, optimizer):
    """Two steps of 24 examples as micro-batches of 7 (sizes 6, 6, 6, 6) equal two steps of a plain GradientTape
    loop over the whole 24: the update over every variable, as one vector, within float32 rounding. SGD's update
    is the gradient itself (a gradient summed without its shares, or averaged over the wrong count, moves it by
    a factor); Adam's step counter must move once per batch."""
    make_opt = {"sgd": lambda: keras.optimizers.SGD(0.5, momentum=0.5),
                "adam": lambda: keras.optimizers.Adam(1e-2)}[optimizer]
    data = batches(2)
    start = initial_weights()
    reference = make_layers()
    plain_loop(reference, data, make_opt())

    layers = make_layers()
    opt = make_opt()
    trained = MicroBatched(TRAINERS[trainer](network(layers), opt), micro_batch=7)
    losses = [trained.train_step(b)["loss"] for b in data]
    assert trained.sizes == [6, 6, 6, 6]
    assert trained.borders.real_batch == 6  # built (and with sections="auto" planned) for the micro-batch
    assert int(opt.iterations.numpy()) == 2  # one update per batch
    distance = relative_update_distance(weights(layers), weights(reference), start)
    assert distance < 1e-5, distance
    # the loss reported is the whole batch's mean (at the weights before its step)
    assert np.isfinite(losses).all()


def test_the_loss_is_the_mean_over_the_whole_batch_and_runs_are_per_micro_batch():
    data = batches(1)[0]
    layers = make_layers()
    h = data["x"]
    for layer in make_layers():
        h = layer(h, training=True)
    expected = float(loss_fn(h, data))
    engine = MicroBatched(Engine(network(layers), keras.optimizers.SGD(0.1), sections=2), micro_batch=5)
    reading = engine.train_step(data)
    assert engine.sizes == [5, 5, 5, 5, 4]
    assert reading["loss"] == pytest.approx(expected, rel=1e-5)
    assert reading["forward_runs"] == [2, 1]  # per micro-batch: the first section re-runs in its backward
    assert engine.apply_reason.startswith("gradients are summed over 5 micro-batches")


@pytest.mark.parametrize("batch,micro,sizes", [(7500, 2000, [1875] * 4), (10, 3, [3, 3, 2, 2]), (8, 8, [8]),
                                               (7, 1, [1] * 7), (9, 4, [3, 3, 3])])
def test_micro_batch_sizes_are_as_equal_as_they_can_be(batch, micro, sizes):
    assert micro_sizes(batch, micro) == sizes
    parts = split({"x": tf.range(batch)}, sizes)
    assert np.concatenate([p["x"].numpy() for p in parts]).tolist() == list(range(batch))


@pytest.mark.parametrize("micro", [0, -3, 2.5, True, "max"])
def test_a_bad_micro_batch_is_refused_in_one_line(micro):
    with pytest.raises(ValueError, match=r"^micro_batch=.*expected examples per micro-batch") as err:
        MicroBatched(Engine(network(make_layers()), keras.optimizers.SGD(0.1)), micro_batch=micro)
    assert "\n" not in str(err.value)


def test_a_micro_batch_larger_than_the_batch_is_refused():
    engine = MicroBatched(Engine(network(make_layers()), keras.optimizers.SGD(0.1)), micro_batch=BATCH + 1)
    with pytest.raises(ValueError, match=rf"^micro_batch={BATCH + 1}: larger than the batch; allowed: 1 to the "
                                         rf"batch \({BATCH}\)"):
        engine.train_step(batches(1)[0])


def test_a_built_trainer_is_refused():
    engine = Engine(network(make_layers()), keras.optimizers.SGD(0.1))
    engine.build(batches(1)[0])
    with pytest.raises(ValueError, match="built already"):
        MicroBatched(engine, 4)


def test_batch_norm_statistics_are_per_micro_batch_and_the_check_compares_like_with_like():
    """With batch norm the update is not one whole step's (each micro-batch is normalized by its own statistics,
    and the moving averages update once per micro-batch); the exactness check then compares the micro-batched
    sectioned step with a whole-graph step of the same micro-batches, and says how far one whole step is."""
    data = batches(1, 32)[0]
    layers = make_layers(batch_norm=True)
    engine = MicroBatched(Engine(network(layers), keras.optimizers.SGD(0.1), sections=2), micro_batch=8)
    report = sections.compare_with_whole(engine, data, examples=32)
    assert report["micro_batches"] == 4
    assert report["exact"], report
    assert report["one_step_rel_error"] > 1e-3  # batch norm over 8 examples is not batch norm over 32
    bn = layers[1]
    h = layers[0](data["x"]).numpy()  # the first layer's output at the weights the step starts from
    engine.train_step(data)
    # four momentum updates of the moving mean, one per micro-batch of 8
    mean = np.zeros(16)
    for k in range(4):
        mean = 0.8 * mean + 0.2 * h[8 * k: 8 * k + 8].mean(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), mean, rtol=1e-4, atol=1e-6)


@pytest.mark.slow  # the fast set checks the same report on a batch-norm model
def test_without_batch_statistics_the_check_also_matches_one_whole_step():
    data = batches(1, 32)[0]
    engine = MicroBatched(Engine(network(make_layers()), keras.optimizers.SGD(0.1), sections=3), micro_batch=8)
    report = sections.compare_with_whole(engine, data, examples=32)
    assert report["exact"] and report["micro_batches"] == 4
    assert report["one_step_rel_error"] < 1e-5, report


@pytest.mark.slow  # 3-9 s; the fast set checks the sum's shares with SGD
def test_loss_scaled_micro_batches_apply_the_unscaled_sum_once():
    """Under a LossScaleOptimizer (mixed_float16's) each micro-batch's gradients are of the scaled loss; their sum
    is unscaled once, by the optimizer's apply: the update equals a plain loop's with the inner optimizer."""
    data = batches(1)
    start = initial_weights()
    reference = make_layers()
    plain_loop(reference, data, keras.optimizers.SGD(0.5))
    layers = make_layers()
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5), initial_scale=1024.0)
    trained = MicroBatched(Engine(network(layers), opt, sections=2), micro_batch=8)
    trained.train_step(data[0])
    distance = relative_update_distance(weights(layers), weights(reference), start)
    assert distance < 1e-5, distance
    _, grads = trained.gradients(data[0])  # unscaled, as Trainer.gradients
    assert max(float(tf.reduce_max(tf.abs(g))) for g in grads if g is not None) < 100


class MeanTokens(keras.layers.Layer):
    def call(self, x, training=None):
        return tf.reduce_mean(x, axis=1)


def test_sparse_gradients_of_an_embedding_are_summed_sparse_and_applied_once():
    """An embedding's gradient is sparse (IndexedSlices): the micro-batches' slices, scaled by their shares, are
    joined (as one step over the batch gives them) and applied once."""
    def layers():
        return [keras.layers.Embedding(20, 6, embeddings_initializer=keras.initializers.RandomNormal(seed=1)),
                MeanTokens(), keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(2))]

    rng = np.random.default_rng(0)
    data = [{"x": tf.constant(rng.integers(0, 20, size=(BATCH, 4)).astype("int32")),
             "y": tf.constant(rng.integers(0, 3, size=BATCH).astype("int64"))}]
    reference, ours, fresh = layers(), layers(), layers()
    h = data[0]["x"]
    for layer in fresh:  # the initial weights
        h = layer(h)
    start = weights(fresh)
    plain_loop(reference, data, keras.optimizers.SGD(0.5))
    trained = MicroBatched(Engine(network(ours), keras.optimizers.SGD(0.5), sections=2), micro_batch=10)
    trained.train_step(data[0])
    _, grads = trained.gradients(data[0])
    assert isinstance(grads[0], tf.IndexedSlices)
    distance = relative_update_distance(weights(ours), weights(reference), start)
    assert distance < 1e-5, distance
