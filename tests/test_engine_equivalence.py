"""The engine's step equals an ordinary whole-graph step, for every partition and policy."""

import keras
import numpy as np
import pytest

from sections import Engine, RecomputeGrad, WholeGraph
from engine_nets import (assert_same_variables, hard_network, make_batch, reference_train,
                         twin_networks)

STEPS = 3

CASES = [
    (1, "recompute"),
    (2, "recompute"),
    (2, "store"),
    (5, "recompute"),                         # every block its own section
    (5, "store"),
    (5, ["store", "recompute", "store", "recompute", "store"]),
    (["split"], "recompute"),                 # a group prefix as the boundary
    (["split/b", "head"], ["recompute", "store", "recompute"]),
    (["gate"], ["store", "recompute"]),
]


@pytest.mark.parametrize("sections,policy", CASES, ids=lambda v: str(v).replace(" ", ""))
def test_sectioned_step_equals_whole_graph_step(sections, policy):
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    before = [v.numpy().copy() for v in ref.non_trainable_variables]
    ref_losses = reference_train(ref, [batch] * STEPS, keras.optimizers.Adam(1e-2))

    optimizer = keras.optimizers.Adam(1e-2)
    engine = Engine(net, optimizer, sections=sections, policy=policy, check=True)
    losses = [engine.train_step(batch)["loss"] for _ in range(STEPS)]

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same_variables(ref, net)
    assert int(optimizer.iterations.numpy()) == STEPS
    # Not vacuous: state (batch-norm statistics, seed-generator states) really moved.
    moved = [not np.array_equal(b, v.numpy()) for b, v in zip(before, ref.non_trainable_variables)]
    assert sum(moved) >= 3

@pytest.mark.slow  # ~4 s; XLA under the one-graph engine and in precision tests

def test_jit_compiled_engine_equals_jit_whole_graph_step():
    # XLA draws its own random bits for stateless ops, so the reference is the XLA whole-graph step.
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    whole = WholeGraph(ref, keras.optimizers.SGD(0.1, momentum=0.9), jit_compile=True)
    engine = Engine(net, keras.optimizers.SGD(0.1, momentum=0.9), sections=["split", "gate"],
                    policy=["recompute", "store", "recompute"], jit_compile=True)
    for _ in range(2):
        np.testing.assert_allclose(engine.train_step(batch)["loss"], whole.train_step(batch)["loss"], rtol=1e-5)
    assert_same_variables(ref, net, rtol=1e-4, atol=1e-5)


def test_learning_rate_schedule_advances_once_per_step():
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    schedule = lambda: keras.optimizers.schedules.ExponentialDecay(0.05, decay_steps=1, decay_rate=0.5)
    reference_train(ref, [batch] * 3, keras.optimizers.Adam(schedule()))
    engine = Engine(net, keras.optimizers.Adam(schedule()), sections=5)
    for _ in range(3):
        engine.train_step(batch)
    assert_same_variables(ref, net)


def test_whole_strategy_equals_reference():
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    reference_train(ref, [batch] * 2, keras.optimizers.Adam(1e-2))
    engine = WholeGraph(net, keras.optimizers.Adam(1e-2), sections=3)
    for _ in range(2):
        stats = engine.train_step(batch)
    assert stats["forward_runs"] == [1, 1, 1]
    assert_same_variables(ref, net)


def test_recompute_grad_reruns_and_misses_batch_norm_statistics():
    """The peer TensorFlow offers re-runs each wrapped section, and with Keras 3 batch norm its re-run
    updates the moving statistics a second time: the comparison above detects exactly this."""
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    reference_train(ref, [batch], keras.optimizers.Adam(1e-2))
    engine = RecomputeGrad(net, keras.optimizers.Adam(1e-2), sections=["split", "gate"])
    stats = engine.train_step(batch)
    assert stats["forward_runs"] == [2, 2, 1]
    with pytest.raises(AssertionError):
        assert_same_variables(ref, net)


def test_evaluate_changes_no_state():
    batch = make_batch()
    net = hard_network()
    engine = Engine(net, keras.optimizers.Adam(1e-2), sections=2)
    engine.build(batch)
    before = [v.numpy().copy() for v in net.variables]
    values = engine.evaluate(batch)
    assert set(values) == {"loss", "accuracy"} and np.isfinite(values["loss"])
    for b, v in zip(before, net.variables):
        np.testing.assert_array_equal(b, v.numpy())


@pytest.mark.parametrize("trainer,exact", [(Engine, True), (WholeGraph, True), (RecomputeGrad, False)])
def test_compare_with_whole_reports_exactness_and_restores_state(trainer, exact):
    from sections import compare_with_whole

    batch = make_batch()
    net = hard_network()
    engine = trainer(net, keras.optimizers.Adam(1e-2), sections=["split", "gate"])
    engine.train_step(batch)
    before = [v.numpy().copy() for v in net.variables + list(engine.optimizer.variables)]
    report = compare_with_whole(engine, batch, examples=8)
    assert report["exact"] is exact, report
    for b, v in zip(before, net.variables + list(engine.optimizer.variables)):
        np.testing.assert_array_equal(b, v.numpy())
