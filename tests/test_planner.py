"""The memory-budget planner: fits the budget, prefers less re-run work, says what is reachable."""

import keras
import pytest

from sections import Engine, parse_bytes
from sections._planner import plan_partition
from sections._profile import BlockProfile
from engine_nets import conv_stack, make_batch

MiB = 2**20


def profiles(n=8, kept=10 * MiB, transient=4 * MiB, out=2 * MiB, seconds=0.01):
    return [BlockProfile(f"b{i}", None, out, kept, transient, True, seconds) for i in range(n)]


def test_large_budget_gives_one_stored_section():
    plan = plan_partition(profiles(), input_bytes=MiB, budget=10**12)
    assert plan.starts == [] and plan.policies == ["store"] and plan.rerun_seconds == 0


def test_plan_fits_budget_and_prefers_storing():
    ps = profiles()
    whole = MiB + 8 * 10 * MiB + 4 * MiB
    plan = plan_partition(ps, input_bytes=MiB, budget=int(0.6 * whole))
    assert plan.predicted_peak <= 0.6 * whole
    assert len(plan.starts) >= 1
    assert "store" in plan.policies[:-1] or plan.rerun_seconds > 0
    tighter = plan_partition(ps, input_bytes=MiB, budget=int(0.4 * whole))
    assert tighter.predicted_peak <= 0.4 * whole
    assert tighter.rerun_seconds >= plan.rerun_seconds


def test_budget_nothing_fits_names_smallest_reachable_peak():
    with pytest.raises(ValueError, match=r"no partition fits; the smallest predicted peak reachable is"):
        plan_partition(profiles(), input_bytes=MiB, budget=5 * MiB)


@pytest.mark.parametrize("text,value", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1e9", 10**9),
                                        (1234, 1234), ("64 KiB", 64 * 1024)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_auto_sections_on_a_real_network():
    batch = make_batch(n=64, size=16, classes=10)
    engine = Engine(conv_stack(depth=8), keras.optimizers.Adam(1e-3), sections="auto", memory_budget="10GiB")
    stats = engine.train_step(batch)
    assert len(engine.sections) == 1 and engine.plan.policies == ["store"]
    assert stats["forward_runs"] == [1]
    assert "predicted peak" in engine.describe()
