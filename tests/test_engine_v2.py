"""Engine v2: exact from the very first call, multi-level recompute, and policies written outside the engine."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import Engine, Network, Schedule, Store, compare_with_whole
from sections.schedule.policies import Recompute, Recreate
from sections.schedule.program import count_forward_runs
from engine_nets import ConvBN, loss_fn


class InferenceNoise(keras.layers.Layer):
    """Draws through a SeedGenerator in inference mode as well as in training (a sampling layer)."""

    def __init__(self, seed, **kw):
        super().__init__(**kw)
        self.seed_generator = keras.random.SeedGenerator(seed)

    def call(self, x, training=None):
        scale = 0.5 if training else 0.1
        return x + scale * keras.random.normal(tf.shape(x), seed=self.seed_generator)


class Noisy(keras.layers.Layer):
    """Conv + batch norm + dropout + an inference-mode sampler: every kind of state a re-run must replay."""

    def __init__(self, filters, seed, **kw):
        super().__init__(**kw)
        self.conv = ConvBN(filters, seed=seed)
        self.drop = keras.layers.Dropout(0.25, seed=seed + 100)
        self.noise = InferenceNoise(seed + 200)

    def call(self, x, training=None):
        return self.noise(self.drop(self.conv(x, training=training), training=training), training=training)


def make_layers():
    """Fresh layers, nothing built: the same construction seeds give the same initial values."""
    head = keras.Sequential([keras.layers.GlobalAveragePooling2D(),
                             keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotUniform(9))])
    return [Noisy(4, seed=i) for i in range(6)] + [head]


def network(layers):
    return Network([(f"b{i}", layer) for i, layer in enumerate(layers)], loss=loss_fn, inputs="image")


def batch(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.normal(size=(n, 8, 8, 2)).astype("float32")),
            "label": tf.constant(rng.integers(0, 3, size=n).astype("int64"))}


def plain_loop(layers, batches, lr=1e-2):
    """A user's loop: layers built lazily by their first training call, one GradientTape per step."""
    optimizer = keras.optimizers.Adam(lr)
    losses = []
    for b in batches:
        with tf.GradientTape() as tape:
            h = b["image"]
            for layer in layers:
                h = layer(h, training=True)
            loss = loss_fn(h, b)
        variables = [v for layer in layers for v in layer.trainable_variables]
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    return losses


def assert_same(layers_a, layers_b):
    for la, lb in zip(layers_a, layers_b):
        assert len(la.variables) == len(lb.variables)
        for va, vb in zip(la.variables, lb.variables):
            np.testing.assert_allclose(np.asarray(va.numpy(), "float64"), np.asarray(vb.numpy(), "float64"),
                                       rtol=1e-5, atol=1e-6, err_msg=va.path)


@pytest.mark.parametrize("sections,policy", [
    pytest.param(1, "recompute", marks=pytest.mark.slow),  # test_engine_equivalence covers one section
    pytest.param(7, ["store", "recreate", "recreate", "recompute", "recreate", "store", "recompute"],
                 marks=pytest.mark.slow),  # the multi-level schedules below stay
    pytest.param("auto", None, marks=pytest.mark.slow),  # the planner is tested in test_planner
], ids=str)
def test_first_steps_equal_a_plain_loop_over_lazily_built_layers(sections, policy):
    batches = [batch(s) for s in range(2)]
    ref_layers = make_layers()
    ref_losses = plain_loop(ref_layers, batches)

    layers = make_layers()
    kw = dict(memory_budget="4GiB") if sections == "auto" else dict(policy=policy)
    engine = Engine(network(layers), keras.optimizers.Adam(1e-2), sections=sections, check=True, **kw)
    engine.build(batches[0])
    assert compare_with_whole(engine, batches[0], examples=4)["exact"]   # leaves everything as it found it
    losses = [engine.train_step(b)["loss"] for b in batches]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same(ref_layers, layers)


NESTED = Schedule(
    starts=(1, 2, 3, 4, 5, 6),
    policies=(Recompute(), Recreate(), Recreate(), Recreate(), Recompute(), Recompute(), Recompute()),
    # top descent keeps borders 0 and 4; border 3 is re-created from 0 keeping 2 on the way (two levels).
    actions={(0, 7): ("keep", 4), (4, 7): ("keep", 5), (5, 7): ("keep", 6),
             (0, 4): ("keep", 2), (2, 4): ("keep", 3)},
)


@pytest.mark.parametrize("schedule,runs", [
    (NESTED, [4, 3, 3, 2, 2, 2, 1]),
    (Schedule((1, 2, 3, 4, 5, 6), (Store(), Recreate(), Recreate(), Store(), Recreate(), Recompute(),
                                    Recompute())), [1, 3, 2, 1, 2, 2, 1]),
], ids=["nested", "store+recreate"])
def test_multi_level_schedules_equal_the_plain_loop(schedule, runs):
    batches = [batch(s) for s in range(2)]
    ref_layers = make_layers()
    plain_loop(ref_layers, batches)
    layers = make_layers()
    engine = Engine(network(layers), keras.optimizers.Adam(1e-2), sections=schedule, check=True)
    for b in batches:
        stats = engine.train_step(b)
        assert stats["forward_runs"] == runs == count_forward_runs(schedule)
    assert_same(ref_layers, layers)


class CountingStore(Store):
    """A policy written outside the engine: keeps the tape like `store`, and counts its calls."""

    name = "counting_store"

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, fns, h, view, snapshot):
        self.calls["forward"] += 1
        return super().forward(fns, h, view, snapshot)

    def backward(self, fns, kept, view, upstream, snapshot, expected=None):
        self.calls["backward"] += 1
        return super().backward(fns, kept, view, upstream, snapshot, expected)


def test_a_new_policy_plugs_in_without_touching_the_engine():
    batches = [batch(s) for s in range(2)]
    ref_layers = make_layers()
    plain_loop(ref_layers, batches)
    layers, counting = make_layers(), CountingStore()
    engine = Engine(network(layers), keras.optimizers.Adam(1e-2), sections=3, policy=[counting, "recompute", "store"])
    for b in batches:
        assert engine.train_step(b)["forward_runs"] == [1, 2, 1]
    assert counting.calls == {"forward": 2, "backward": 2}
    assert engine.sections[0].policy == "counting_store"
    assert_same(ref_layers, layers)
