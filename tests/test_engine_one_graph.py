"""``Engine(one_graph=True)``: the whole sectioned step (re-runs gated on upstream gradients, state replayed) as
one compiled graph equals an ordinary whole-graph step."""

import keras
import numpy as np
import pytest

from sections import Engine, WholeGraph, compare_with_whole
from sections.backend.lean import gradient_traces
from engine_nets import assert_same_variables, hard_network, make_batch, reference_train, twin_networks

STEPS = 3


@pytest.mark.parametrize("sections", [1, 2, 5, ["split"], ["split/b", "head"]], ids=str)
def test_one_graph_step_equals_whole_graph_step(sections):
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    before = [v.numpy().copy() for v in ref.non_trainable_variables]
    ref_losses = reference_train(ref, [batch] * STEPS, keras.optimizers.Adam(1e-2))

    optimizer = keras.optimizers.Adam(1e-2)
    engine = Engine(net, optimizer, sections=sections, one_graph=True)
    steps = [engine.train_step(batch) for _ in range(STEPS)]

    np.testing.assert_allclose([s["loss"] for s in steps], ref_losses, rtol=1e-5)
    assert_same_variables(ref, net)
    assert int(optimizer.iterations.numpy()) == STEPS
    count = len(engine.sections)
    assert steps[-1]["forward_runs"] == [2] * (count - 1) + [1]  # counted inside the compiled code
    assert steps[-1]["peak_bytes"] == [None] * count
    assert engine.trace_counts()["step"] == 1
    moved = [not np.array_equal(b, v.numpy()) for b, v in zip(before, ref.non_trainable_variables)]
    assert sum(moved) >= 3


def test_one_graph_with_re_made_inputs_equals_whole_graph_step():
    """``lean="recompute"`` in one graph: the stem's convolution output is re-made once and shared by the next
    convolution's re-made input and the batch norm's backward, inside the one compiled step."""
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    ref_losses = reference_train(ref, [batch] * STEPS, keras.optimizers.Adam(1e-2))
    remade = gradient_traces()["remade_input"]
    engine = Engine(net, keras.optimizers.Adam(1e-2), sections=["split/b"], one_graph=True, lean="recompute")
    np.testing.assert_allclose([engine.train_step(batch)["loss"] for _ in range(STEPS)], ref_losses, rtol=1e-5)
    assert gradient_traces()["remade_input"] > remade
    # all variables as one vector: Adam magnifies rounding in near-zero gradients elementwise
    got, want = (np.concatenate([v.numpy().ravel() for v in n.variables]).astype("float64") for n in (net, ref))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) <= 1e-5


def test_one_graph_gradients_and_compare_with_whole():
    batch = make_batch()
    engine = Engine(hard_network(), keras.optimizers.Adam(1e-2), sections=5, one_graph=True)
    report = compare_with_whole(engine, batch, examples=8)
    assert report["exact"] is True, report

@pytest.mark.slow  # ~5 s; XLA exactness stays via test_jit_compiled_engine_equals_jit_whole_graph_step

def test_one_graph_jit_equals_jit_whole_graph_step():
    batch = make_batch()
    ref, net = twin_networks(hard_network, batch)
    whole = WholeGraph(ref, keras.optimizers.SGD(0.1, momentum=0.9), jit_compile=True)
    engine = Engine(net, keras.optimizers.SGD(0.1, momentum=0.9), sections=["split", "gate"], jit_compile=True,
                    one_graph=True)
    for _ in range(2):
        np.testing.assert_allclose(engine.train_step(batch)["loss"], whole.train_step(batch)["loss"], rtol=1e-5)
    assert_same_variables(ref, net, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(policy="store"), dict(policy=["recompute", "recreate"]), dict(check=True),
                                    dict(sections="auto", memory_budget="1GiB")], ids=str)
def test_one_graph_rejects_what_it_cannot_run(kwargs):
    args = {"sections": 2, **kwargs}
    with pytest.raises(ValueError, match="one_graph"):
        Engine(hard_network(), keras.optimizers.Adam(1e-2), one_graph=True, **args)
