"""The planner's dynamic program against an exact search over a step's operations (sections/schedule/exact.py),
which shares no code with it: on small random chains the plan is never cheaper than the optimum (one of them
would be wrong), never over its budget, and within a stated factor of the optimum."""

import random
from types import SimpleNamespace

import pytest

from sections import plan_schedule
from sections.backend.profile import BlockProfile
from sections.schedule.exact import exact_schedule, least_peak
from sections.schedule.planner import NoPlanFits
from sections.schedule.policies import Recompute, Store

MiB = 2**20


def random_chain(seed):
    """4-7 blocks, sizes in tenths of a MiB (so the planner's 300 memory slots round), gradients per block."""
    rng = random.Random(seed)
    n = rng.randint(4, 7)
    tenth = lambda lo, hi: rng.randint(lo, hi) * MiB // 10
    ps = [BlockProfile(f"b{i}", tenth(1, 40), tenth(2, 120), tenth(1, 40), rng.choice([0.01, 0.02, 0.05, 0.1]),
                       stored_bytes=tenth(2, 140)) for i in range(n)]
    return ps, [tenth(0, 20) for _ in range(n)]


def compare(ps, grads, limit, **options):
    """(DP's objective or None, its predicted peak, the exact plan or None) at one limit beside the base."""
    total = sum(p.forward_seconds for p in ps)
    overhead = 0.01 * total / len(ps)
    exact = exact_schedule(ps, limit, grad_bytes=grads, section_overhead=overhead, **options)
    try:
        plan = plan_schedule(ps, 0, int(limit), margin=0.0, grad_bytes=grads, section_overhead=overhead, **options)
    except NoPlanFits:
        return None, None, exact
    return plan.rerun_seconds + total + overhead * plan.schedule.num_sections, plan.predicted_peak, exact


def replay(ps, grads, ops, overhead, units=(Store(),)):
    """(work, peak) of an exact plan's operations, counted step by step: borders held (border 0 is the batch, in
    the base), tapes with both their borders, the waiting gradient, gradients of finished blocks, and during a
    backward the section's activations (blocks' estimate) or the tape policy's backward bytes."""
    n = len(ps)
    size = lambda i: 0 if i in (0, n) else ps[i - 1].output_bytes
    act = lambda a, b: max(sum(p.kept_bytes for p in ps[a:j + 1]) + ps[j].transient_bytes for j in range(a, b))
    unit = {u.name: u for u in units}
    held, tapes, g, work, peak = {0}, {}, n, 0.0, 0

    def memory():
        borders = held | {i for a, b in tapes for i in (a, b) if i < g}
        return (sum(size(i) for i in borders) + sum(c.kept_bytes for c in tapes.values()) + size(g)
                + sum(grads[g:]))

    for op in ops:
        extra = 0
        if op[0] == "free":
            held.discard(op[1])
        elif op[0] in ("forward", "tape"):
            a, b = op[1:3]
            assert a in held and a < b < g, op
            work += sum(p.forward_seconds for p in ps[a:b])
            held.add(b)
            if op[0] == "tape":
                profile = SimpleNamespace(activation_bytes=act(a, b), forward_seconds=0.0,
                                          stored_bytes=sum(p.stored_bytes for p in ps[a:b]),
                                          transient_bytes=max(p.transient_bytes for p in ps[a:b]))
                tapes[(a, b)] = unit[op[3]].cost(profile)
                work += tapes[(a, b)].extra_seconds + overhead
        else:
            a, b = op[1:3]
            assert b == g, op
            if op[0] == "leaf":
                assert a in held, op
                work += sum(p.forward_seconds for p in ps[a:b]) + overhead
                extra = act(a, b)
            else:
                extra = tapes[(a, b)].backward_bytes
            peak = max(peak, memory() + extra)
            tapes.pop((a, b), None)
            g = a
            held = {i for i in held if i < a} | {0}
        peak = max(peak, memory())
    assert g == 0 and not tapes
    return work, peak


#: The worst DP / optimum ratio measured over 200 such chains at 11 budgets each (2,000 comparisons) was 1.59
#: (one plan of 2,000; the mean was 1.002, 3% had any gap): the causes are the planner's 300 memory slots and
#: schedules outside its space (see exact.py). This factor is that measurement, not a design bound.
FACTOR = 1.6


@pytest.mark.parametrize("seed", range(12))
def test_the_plan_is_never_cheaper_than_the_optimum_never_over_budget_and_within_the_factor(seed):
    ps, grads = random_chain(seed)
    floor = least_peak(ps, grad_bytes=grads)
    whole = exact_schedule(ps, float("inf"), grad_bytes=grads).peak
    assert exact_schedule(ps, floor - 1, grad_bytes=grads) is None
    for k in range(11):
        limit = floor + (whole - floor) * k / 10
        dp, peak, exact = compare(ps, grads, limit)
        assert exact is not None and exact.peak <= limit
        work, peak = replay(ps, grads, exact.ops, 0.01 * sum(p.forward_seconds for p in ps) / len(ps))
        assert work == pytest.approx(exact.cost) and peak == exact.peak, (seed, k, exact.ops)
        if dp is None:  # below the planner's own floor (its space, or its slots): exact.py says why
            assert k < 10, "the planner refused the whole chain's own peak"
            continue
        assert peak <= limit, (seed, k)
        assert dp >= exact.cost * (1 - 1e-9), (seed, k, dp, exact.cost, exact.ops)
        assert dp <= FACTOR * exact.cost, (seed, k, dp, exact.cost, exact.ops)


@pytest.mark.parametrize("seed", range(6))
def test_other_units_and_measured_sections_are_priced_alike(seed):
    """With ``Recompute`` as a unit too, and a measured whole-chain section, the plan still never beats the
    optimum: both price sections from the same figures."""
    ps, grads = random_chain(100 + seed)
    measured = {(0, len(ps)): 12 * MiB, (1, len(ps)): 9 * MiB}
    options = dict(units=(Store(), Recompute()), measured=measured, calibration=0.8)
    floor = least_peak(ps, grad_bytes=grads, **options)
    whole = exact_schedule(ps, float("inf"), grad_bytes=grads, **options).peak
    for k in range(6):
        limit = floor + (whole - floor) * k / 5
        dp, peak, exact = compare(ps, grads, limit, **options)
        if dp is not None:
            assert peak <= limit and exact.cost * (1 - 1e-9) <= dp <= FACTOR * exact.cost, (seed, k)


def test_the_dp_floor_is_never_below_the_exact_floor():
    from sections.schedule.planner import _Chain, _least_memory

    for seed in range(12):
        ps, grads = random_chain(seed)
        assert _least_memory(_Chain(ps, 0, grads=grads), [Store()], 1.0) >= least_peak(ps, grad_bytes=grads)


def three_blocks():
    """Each block keeps 10 MiB, 4 MiB transient, 2 MiB borders, a 12 MiB tape; 1, 2 and 3 s forward."""
    return [BlockProfile(f"b{i}", 2 * MiB, 10 * MiB, 4 * MiB, float(i + 1), stored_bytes=12 * MiB)
            for i in range(3)]


@pytest.mark.parametrize("limit_mib, cost, peak_mib", [
    (40, 6.0, 34),  # one section: activations 3 x 10 + 4
    (34, 6.0, 34),
    (33, 7.0, 26),  # keep border 1, re-run block 0: border 1 + blocks 1-2's 24 MiB
    (26, 7.0, 26),
    (25, 9.0, 18),  # keep borders 1 and 2, re-run blocks 0 and 1: 2 + 2 + 14
    (18, 9.0, 18),
    (17, None, None),  # block 2's backward needs border 2 and 14 MiB; then blocks 0-1 need 18 at least
])
def test_the_exact_search_finds_the_hand_computed_optimum(limit_mib, cost, peak_mib):
    """Worked by hand: cost 6 needs every block run once (a tape on blocks 0-1 plus block 2 costs at least 40
    MiB); cost 7 re-runs block 0 (26 MiB, or 30 with a tape on block 1); cost 8 (block 1 or block 0 twice more)
    needs 26 MiB too; below 26 the cheapest keeps borders 1 and 2 (cost 9, 18 MiB), and nothing fits 17."""
    ps = three_blocks()
    plan = exact_schedule(ps, limit_mib * MiB, section_overhead=0.0)
    if cost is None:
        assert plan is None and least_peak(ps) == 18 * MiB
        return
    assert plan.cost == pytest.approx(cost) and plan.peak == peak_mib * MiB, plan.ops
    dp = plan_schedule(ps, 0, limit_mib * MiB, margin=0.0, resolution=limit_mib, section_overhead=0.0)
    assert dp.rerun_seconds + 6.0 == pytest.approx(cost)


def test_the_search_reaches_schedules_outside_the_planner_space():
    """A border used once as a relay and dropped before the backward reaches it: border 2 re-creates border 3
    for block 3's backward and is dropped, and blocks 0-2 re-run as one section from the batch. The planner
    holds a kept border until its gradient arrives, so with exact 1-MiB slots it pays more at 25 MiB."""
    rows = [(1, 5, 3, 0.1, 2), (3, 2, 3, 0.1, 3), (5, 3, 2, 0.05, 4), (5, 7, 4, 0.01, 12), (6, 3, 3, 0.1, 7),
            (2, 12, 2, 0.1, 3)]  # output, kept, transient MiB; forward s; stored MiB
    ps = [BlockProfile(f"b{i}", o * MiB, k * MiB, t * MiB, s, stored_bytes=st * MiB)
          for i, (o, k, t, s, st) in enumerate(rows)]
    grads = [g * MiB for g in (0, 1, 2, 0, 2, 2)]
    exact = exact_schedule(ps, 25 * MiB, grad_bytes=grads, section_overhead=0.001)
    # forward 0-1 and 2-3 once, block 4-5 as a section, block 2 again from border 2, block 3 as a section,
    # blocks 0-2 as a section: 0.2 + 0.06 + 0.201 + 0.05 + 0.011 + 0.251
    assert exact.cost == pytest.approx(0.773) and ("free", 2) in exact.ops, exact.ops
    plan = plan_schedule(ps, 0, 25 * MiB, margin=0.0, resolution=25, grad_bytes=grads, section_overhead=0.001)
    assert plan.rerun_seconds + 0.46 + 0.001 * plan.schedule.num_sections > exact.cost + 0.05
