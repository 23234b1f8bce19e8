"""The engine under tf.distribute: MirroredStrategy over the 2 logical CPU devices tests/conftest.py makes.

References are built independently: a whole-graph step under the same strategy (the baseline class), and a
plain single-device GradientTape loop over fresh layers built lazily by their first call.
"""

import numpy as np
import pytest
import tensorflow as tf
import keras

from sections import Engine, Network, RecomputeGrad, WholeGraph
from sections.backend.lean import gradient_traces
from sections.backend.replicas import DistributeError
from engine_nets import hard_network, loss_fn, make_batch
from test_engine_v2 import plain_loop  # a user's single-device loop: layers built by their first call

CPUS = [d.name for d in tf.config.list_logical_devices("CPU")]
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 logical CPU devices (tests/conftest.py)")


_STRATEGY = []


def strategy():
    """One strategy for the module, reducing without collective ops (the runner's mirrored CPU strategy, made
    in this process by tests/test_runner_distribute.py, would share their keys)."""
    if not _STRATEGY:
        _STRATEGY.append(tf.distribute.MirroredStrategy(CPUS[:2], cross_device_ops=tf.distribute.ReductionToOneDevice()))
    return _STRATEGY[0]


def batches(n=3, size=16):
    return [make_batch(size, seed=s) for s in range(n)]


def trained(cls, factory, st, data, **kw):
    """A trainer of ``cls`` over a network made by ``factory`` under ``st``, built on the first batch."""
    with st.scope():
        net = factory()
        optimizer = keras.optimizers.Adam(1e-2)
    trainer = cls(net, optimizer, distribute=st, **kw)
    trainer.build(data[0])
    return net, trainer


SCHEDULES = [
    dict(sections=3),
    dict(sections=3, policy="store"),
    dict(sections=4, policy=["recompute", "recreate", "store", "recompute"]),
    dict(sections=3, one_graph=True),
]
# store is also in the recreate schedule, and one_graph takes ~5 s: both run in the slow set
FAST_SCHEDULES = [pytest.param(kw, marks=pytest.mark.slow) if i in (1, 3) else kw for i, kw in enumerate(SCHEDULES)]


@pytest.mark.parametrize("kw", FAST_SCHEDULES + [dict(sections=3, lean=True), dict(sections=["split/b"], lean="recompute")],
                         ids=["recompute", "store", "recreate", "one_graph", "recompute-lean", "remade-inputs"])
def test_sectioned_step_under_a_strategy_equals_a_whole_graph_step_under_it(kw):
    """Batch norm (per-replica statistics), dropout, a stochastic gate and a tuple border with an int tensor.

    With Keras's own gradients (``lean=False``) the step is bit-identical to the whole-graph step; lean batch-norm
    gradients round differently, so those cases are compared within float32 rounding. ``"recompute"``: the first
    section holds the stem's batch norm and ReLU and the convolution reading them, which re-makes its input in each
    replica's backward."""
    kw = {"lean": False, **kw}
    remade = gradient_traces()["remade_input"]
    st, data = strategy(), batches()
    a, engine = trained(Engine, hard_network, st, data, **kw)
    b, whole = trained(WholeGraph, hard_network, st, data)
    for va, vb in zip(a.variables, b.variables):
        vb.assign(va)
    for batch in data:
        got, want = engine.train_step(batch), whole.train_step(batch)
        if kw["lean"]:
            np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
        else:
            assert got["loss"] == want["loss"]
    if kw["lean"]:  # all variables as one vector: Adam magnifies rounding in near-zero gradients elementwise
        diff = np.sqrt(sum(np.sum((va.numpy() - vb.numpy()) ** 2.0) for va, vb in zip(a.variables, b.variables)))
        size = np.sqrt(sum(np.sum(vb.numpy() ** 2.0) for vb in b.variables))
        assert diff / size <= 1e-5, diff / size
        assert (gradient_traces()["remade_input"] > remade) == (kw["lean"] == "recompute")
        return
    for va, vb in zip(a.variables, b.variables):
        np.testing.assert_array_equal(va.numpy(), vb.numpy(), err_msg=va.path)
    assert engine.evaluate(data[0]) == whole.evaluate(data[0])


def dense_layers(sync_bn=False):
    init = lambda k: keras.initializers.GlorotUniform(seed=k)  # noqa: E731
    layers = [keras.layers.Flatten(), keras.layers.Dense(12, activation="relu", kernel_initializer=init(1)),
              keras.layers.Dense(12, activation="tanh", kernel_initializer=init(2)),
              keras.layers.Dense(3, kernel_initializer=init(3))]
    if sync_bn:
        layers.insert(2, keras.layers.BatchNormalization(synchronized=True, momentum=0.5))
    return layers


def dense_network(sync_bn=False):
    layers = dense_layers(sync_bn)
    return Network([(f"l{i}", layer) for i, layer in enumerate(layers)], loss=loss_fn, inputs="image")


@pytest.mark.parametrize("kw,sync_bn", [(SCHEDULES[0], False), (SCHEDULES[1], False), (SCHEDULES[2], False),
                                         (SCHEDULES[0], True), (dict(sections=4, policy=["recompute", "recreate",
                                                                                         "recompute", "store"]), True)],
                         ids=["recompute", "store", "recreate", "recompute-synchronized-bn", "recreate-synchronized-bn"])
def test_without_per_replica_statistics_it_equals_one_device_on_the_global_batch(kw, sync_bn):
    """Each replica's loss is scaled by 1/replicas and Keras sums the gradients once: the step is the global
    batch's. Synchronized batch norm normalizes with the global batch's moments and updates its moving
    statistics once per step (re-runs replay them), so it matches one device too."""
    st, data = strategy(), batches()
    net, engine = trained(Engine, lambda: dense_network(sync_bn), st, data, **kw)
    losses = [engine.train_step(batch)["loss"] for batch in data]
    reference = dense_layers(sync_bn)
    want = plain_loop(reference, data)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    ours = [v for block in net.blocks for v in block.layer.variables]
    theirs = [v for layer in reference for v in layer.variables]
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=b.path)


def test_gradients_are_the_global_batch_gradients_and_runs_count_per_replica():
    st, data = strategy(), batches(1)
    net, engine = trained(Engine, dense_network, st, data, sections=3)
    loss, grads = engine.gradients(data[0])
    reference = dense_layers()
    with tf.GradientTape() as tape:
        h = data[0]["image"]
        for layer in reference:
            h = layer(h, training=True)
        want_loss = loss_fn(h, data[0])
    want = tape.gradient(want_loss, [v for layer in reference for v in layer.trainable_variables])
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-5, atol=1e-7)
    stats = engine.train_step(data[0])
    assert stats["forward_runs"] == [2, 2, 1]  # one replica's runs: the first forward and one re-run
    assert set(stats["device_peak_bytes"]) == {"CPU:0"}  # logical CPU devices share one allocator
    counts = engine.trace_counts()
    engine.train_step(data[0])
    assert engine.trace_counts() == counts


def test_a_batch_the_replicas_cannot_share_is_one_clear_error():
    st = strategy()
    _, engine = trained(Engine, dense_network, st, batches(1), sections=2)
    with pytest.raises(DistributeError, match=r"^batch 15 does not divide by the 2 replicas; use a multiple of 2\.$"):
        engine.train_step(make_batch(15))


def test_an_optimizer_or_layers_made_outside_the_scope_are_refused():
    st, data = strategy(), batches(1)
    with st.scope():
        net = dense_network()
    engine = Engine(net, keras.optimizers.Adam(1e-2), sections=2, distribute=st)
    with pytest.raises(DistributeError, match="optimizer Adam was created outside the strategy's scope"):
        engine.build(data[0])
    engine = Engine(hard_network(), keras.optimizers.Adam(1e-2), sections=2, distribute=st)
    with pytest.raises(DistributeError, match=r"variable\(s\) were created outside the strategy's scope"):
        engine.build(data[0])


def test_store_across_synchronized_batch_norm_is_refused_in_one_line():
    st, data = strategy(), batches(1)
    _, engine = trained(Engine, lambda: dense_network(sync_bn=True), st, data, sections=["l3"], policy="store")
    with pytest.raises(ValueError, match=r"^section_0: policy 'store' cannot keep a tape across a cross-replica op"):
        engine.train_step(data[0])

@pytest.mark.slow  # ~4 s

def test_recompute_grad_and_the_planner_run_under_a_strategy():
    st, data = strategy(), batches(2)
    a, rg = trained(RecomputeGrad, dense_network, st, data, sections=3)
    b, whole = trained(WholeGraph, dense_network, st, data)
    for va, vb in zip(a.variables, b.variables):
        vb.assign(va)
    got, want = rg.train_step(data[0]), whole.train_step(data[0])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    alone = RecomputeGrad(dense_network(), keras.optimizers.Adam(1e-2), sections=3).train_step(data[0])
    assert got["forward_runs"] == alone["forward_runs"]  # counted per replica: what one device counts
    _, auto = trained(Engine, dense_network, st, data, sections="auto", memory_budget="64MiB")
    assert auto.sections[0].input_specs.shape[0] == 8  # planned for one replica's share of the batch of 16
    assert np.isfinite(auto.train_step(data[1])["loss"])
