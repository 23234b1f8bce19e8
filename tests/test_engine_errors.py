"""Bad input gets one clear ValueError, before anything is trained."""

import keras
import pytest

from sections import Engine
from engine_nets import hard_network, make_batch


def engine(**kw):
    return Engine(hard_network(), keras.optimizers.Adam(1e-3), **kw)


@pytest.mark.parametrize("kw,message", [
    (dict(sections=["nope"]), r"Unknown section boundary 'nope'; valid boundary names are: \['stem', 'split'"),
    (dict(sections=["gate", "split"]), "out of order"),
    (dict(sections=["split", "split/a"]), "same place twice"),
    (dict(sections=["stem"]), "first block"),
    (dict(sections=6), r"sections=6: more sections than blocks; this network has 5 blocks"),
    (dict(sections=0), "sections=0: must be at least 1"),
    (dict(sections=2.5), "must be an int >= 1"),
    (dict(sections=3, policy=["store", "recompute"]), "policy has 2 entries"),
    (dict(policy="cache"), r"Unknown policy 'cache'; allowed: \['recompute', 'store', 'recreate'\]"),
    (dict(policy="stor"), r"did you mean 'store'"),
    (dict(sections="auto", memory_budget="150%"), r"memory_budget='150%': a percentage of the device's memory"),
    (dict(sections="auto", memory_budget="lots"), "memory_budget='lots'"),
])
def test_bad_arguments(kw, message):
    with pytest.raises(ValueError, match=message):
        engine(**kw)


def test_missing_batch_key_trains_nothing():
    net = hard_network()
    e = Engine(net, keras.optimizers.Adam(1e-3), sections=2)
    batch = make_batch()
    e.build(batch)
    before = [v.numpy().copy() for v in net.variables]
    del batch["aux"]
    with pytest.raises(ValueError, match=r"missing key\(s\) \['aux'\]"):
        e.train_step(batch)
    for b, v in zip(before, net.variables):
        assert (b == v.numpy()).all()


@pytest.mark.parametrize("sections", [4, ["b2"]])
def test_a_budget_without_sections_auto_is_refused_not_ignored(sections):
    """Only the planner plans to a budget: a fixed partition with a budget was silently ignored by the engine and
    SectionedModel (the rule lived in the runner alone); now it is one rule in ``sections.rules``."""
    from sections import Engine
    from sections.rules import RuleError
    from engine_nets import conv_stack

    with pytest.raises(RuleError, match=r"memory_budget='1GiB': only sections='auto' plans to a budget"):
        Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections=sections, memory_budget="1GiB")


@pytest.mark.parametrize("trainer", ["WholeGraph", "RecomputeGrad"])
def test_sections_auto_on_a_baseline_is_one_rule(trainer):
    """The baselines do not plan: ``sections="auto"`` is the rule ``auto_needs_engine`` (``sections.rules``)."""
    import sections
    from sections.rules import RuleError
    from engine_nets import conv_stack

    with pytest.raises(RuleError, match=r"sections='auto' plans the sectioned engine") as err:
        getattr(sections, trainer)(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections="auto")
    assert err.value.rule == "auto_needs_engine"


def test_recompute_grad_over_one_section_says_it_checkpoints_nothing(caplog):
    from sections import RecomputeGrad
    from engine_nets import conv_stack

    with caplog.at_level("WARNING", logger="sections"):
        RecomputeGrad(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections=1).build(make_batch(n=8))
    assert "recompute_grad with one section checkpoints nothing" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sections"):
        RecomputeGrad(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections=2).build(make_batch(n=8))
    assert "checkpoints nothing" not in caplog.text


def test_a_step_asked_not_to_re_plan_raises_out_of_memory_where_auto_would_re_plan(monkeypatch):
    """On a device with a hard limit ``sections="auto"`` re-plans a step that runs out of memory; with
    ``replan=False`` (the runner's diagnostic re-run) the step as compiled raises ``OutOfMemory`` instead."""
    import dataclasses

    import tensorflow as tf

    from sections import Engine, OutOfMemory
    from engine_nets import conv_stack, make_batch

    batch = make_batch(n=8, size=8, classes=10)
    engine = Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections="auto", memory_budget="1GiB")
    engine.build(batch)
    engine.device_memory = dataclasses.replace(engine.device_memory, hard=True)
    replanned = []

    def out_of_memory(b):
        raise tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[1024]")

    monkeypatch.setattr(engine.executor, "step", out_of_memory)
    monkeypatch.setattr(engine.calibrator, "replan_below", lambda err, b: replanned.append(err))
    # each out of memory frees the failed step with gc.collect(): a full collection over a test worker's heap (about
    # a second each, late in a run) and nothing this test reads
    from sections.backend import device

    monkeypatch.setattr(device.gc, "collect", lambda *args: 0)
    with pytest.raises(OutOfMemory):
        engine.train_step(batch, replan=False)
    assert replanned == []
    with pytest.raises(OutOfMemory):
        engine.train_step(batch)
    assert len(replanned) == 3  # MAX_REPLANS attempts, then it stops


def test_a_step_out_of_memory_with_the_bytes_free_runs_once_more_on_its_plan_before_re_planning(monkeypatch,
                                                                                                  caplog):
    """Where the failing request and the step's peak fit the device together, the allocator lacked a free chunk,
    not bytes: the step runs again on the same plan (once) before the budget comes down. Where they do not fit, it
    re-plans at once."""
    import dataclasses

    import tensorflow as tf

    from sections import Engine, OutOfMemory
    from sections.backend import device
    from engine_nets import conv_stack, make_batch

    batch = make_batch(n=8, size=8, classes=10)
    engine = Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections="auto", memory_budget="1GiB")
    engine.build(batch)
    engine.device_memory = dataclasses.replace(engine.device_memory, hard=True, total=2**30)
    monkeypatch.setattr(device.gc, "collect", lambda *args: 0)  # as above: nothing this test reads
    replanned, calls = [], []
    step = engine.executor.step
    failure = tf.errors.ResourceExhaustedError(None, None, "OOM when allocating tensor with shape[1024,1024] and "
                                                           "type float on /job:localhost/replica:0/task:0/device:CPU:0")

    def fails_first(b):
        calls.append(b)
        if len(calls) == 1:
            raise failure
        return step(b)

    monkeypatch.setattr(engine.executor, "step", fails_first)
    monkeypatch.setattr(engine.calibrator, "replan_below", lambda err, b: replanned.append(err))
    with caplog.at_level("WARNING", logger="sections"):
        stats = engine.train_step(batch)
    assert len(calls) == 2 and replanned == [] and stats["loss"] > 0
    assert "though that much was free in pieces; running the step again from the state before it" in caplog.text
    assert engine.calibrator.runs_again == 1

    assert engine.calibrator.ran_again_last

    def always(b):
        calls.append(b)
        raise failure

    monkeypatch.setattr(engine.executor, "step", always)
    # The step before ran again too: a plan at the allocator's edge is re-planned at once where a smaller one exists
    monkeypatch.setattr(engine.calibrator, "running_least", lambda: False)
    calls.clear()
    with pytest.raises(OutOfMemory):
        engine.train_step(batch)
    assert len(calls) == 4 and len(replanned) == 3 and not engine.calibrator.ran_again_last
    # the least-memory plan has nothing below it: it runs again as the first time
    monkeypatch.setattr(engine.calibrator, "running_least", lambda: True)
    engine.calibrator.ran_again_last = True
    calls.clear(), replanned.clear()
    with pytest.raises(OutOfMemory):
        engine.train_step(batch)
    assert len(calls) == 5 and len(replanned) == 3  # once more on the plan, then MAX_REPLANS re-plans
    engine.device_memory = dataclasses.replace(engine.device_memory, total=2 * 2**20)  # under the 4 MiB request
    calls.clear(), replanned.clear()
    with pytest.raises(OutOfMemory):
        engine.train_step(batch)
    assert len(calls) == 4 and len(replanned) == 3  # no bytes to spare: re-planned at once


@pytest.mark.parametrize("in_use, requested, total, budget_from", [
    (2**20, 4 * 2**20, 2**30, "plan"),  # the bytes were free in pieces: below the running plan's measured peak
    (2**30 - 2**20, 4 * 2**20, 2**30, "in use"),  # they were not: below what was in use
])
def test_a_step_out_of_memory_re_plans_below_the_plan_where_the_bytes_were_free_else_below_what_was_in_use(
        monkeypatch, in_use, requested, total, budget_from):
    """What the budget comes down to after a step ran out (the search itself stubbed: its dry steps are the
    calibration tests')."""
    import dataclasses

    from sections import OutOfMemory
    from sections.step.executor import DRY_NOISE
    from engine_nets import conv_stack, make_batch

    batch = make_batch(n=8, size=8, classes=10)
    engine = Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections="auto", memory_budget="1GiB")
    engine.build(batch)
    calibrator = engine.calibrator
    calibrator.plan = dataclasses.replace(calibrator.plan, predicted_peak=300 * 2**20)
    monkeypatch.setattr(calibrator, "calibrate", lambda b: None)
    device = dataclasses.replace(engine.device_memory, hard=True, total=total)
    calibrator.replan_below(OutOfMemory("out of memory", device, requested, "[1024,1024] float", in_use), batch)
    expected = 300 * 2**20 if budget_from == "plan" else in_use
    assert calibrator.budget == int(expected * (1 - DRY_NOISE)), calibrator.budget


@pytest.mark.parametrize("shape, dtype", [((), "int64"), ((7,), "float32"), ((3, 3, 512, 160), "float32"),
                                          ((0, 4), "float32"), ((5,), "bool"), ((600, 700), "float16")])
def test_a_dry_steps_write_back_restores_every_value_and_keeps_no_view_of_the_copy(shape, dtype):
    import numpy as np

    from sections.step.executor import ALIGN, host_copy, write_back

    values = (np.arange(int(np.prod(shape))) % 7).reshape(shape).astype(dtype)
    variable = keras.Variable(values, dtype=dtype)
    saved = host_copy([variable])
    assert not saved[0].size or saved[0].ctypes.data % ALIGN == 0
    variable.assign(np.ones(shape, dtype))
    write_back([variable], saved)
    assert np.array_equal(variable.numpy(), values) and variable.dtype == dtype
    if dtype != "bool" and values.size:
        variable.assign_add(np.ones(shape, dtype))  # the variable owns its buffer: the host copy is not written
        assert np.array_equal(saved[0], values)
