"""How far the planner's plan is from the optimum under its own cost model, at each budget (issue 22, item 2).

For each model: per-block costs (synthetic, or probed the way ``Engine(sections="auto")`` probes: ``profile_blocks``
at the real batch, and every span of blocks measured as one compiled run by ``SectionProbe``, so no section is
an estimate), then at budgets from the least peak any schedule reaches (the exact search's) to the whole chain's
peak (one section), beside the base (variables, optimizer slots, batch): the planner's objective (forward work
plus its per-section overhead, in units of one forward of the chain) at its default 300 memory slots and at
3000 (what rounding costs), the exact optimum (``sections/schedule/exact.py``), the ratios, and both peaks.

    PYTHONPATH=. python docs/bench/planner/optimality.py \
        --models synthetic:7:0,synthetic:10:2,resnet:32,MobileNetV2:32:64 --sweep 200
"""
import argparse
import random
import time

MiB = 2**20


def synthetic(n: int, seed: int):
    """Random costs; ``n == 0``: 4-7 blocks, drawn as tests/test_planner_exact.py draws its chains."""
    from sections.backend.profile import BlockProfile

    rng = random.Random(seed)
    n = n or rng.randint(4, 7)
    tenth = lambda lo, hi: rng.randint(lo, hi) * MiB // 10
    ps = [BlockProfile(f"b{i}", tenth(1, 40), tenth(2, 120), tenth(1, 40), rng.choice([0.01, 0.02, 0.05, 0.1]),
                       stored_bytes=tenth(2, 140)) for i in range(n)]
    return ps, {}, [tenth(0, 20) for _ in range(n)]


def probed(spec: str):
    """``resnet:<batch>`` (the notebook ResNet, 28x28x1) or ``<keras.applications name>:<size>:<batch>``
    (``weights=None``, cut by ``from_keras`` into at most 8 blocks)."""
    import numpy as np
    import keras
    import tensorflow as tf

    from sections.backend.memory import MemoryMeter
    from sections.backend.profile import SectionProbe, gradient_bytes, probe_slice, profile_blocks

    parts = spec.split(":")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if parts[0] == "resnet":
        from models import build_resnet

        b = int(parts[1])
        net = build_resnet(num_classes=10, input_shape=(28, 28, 1))
        batch = {"image": rng.normal(size=(b, 28, 28, 1)), "label": rng.integers(0, 10, b)}
    else:
        from models.keras_app import build_keras_app

        size, b = int(parts[1]), int(parts[2])
        net = build_keras_app(parts[0], 10, [size, size, 3], max_blocks=8)
        batch = {"image": rng.uniform(-1, 1, size=(b, size, size, 3)), "label": rng.integers(0, 10, b)}
    batch = {k: tf.constant(v.astype("float32" if v.dtype.kind == "f" else "int32")) for k, v in batch.items()}
    meter = MemoryMeter()
    small, real = probe_slice(net, batch, b)
    t = time.perf_counter()
    profiles = profile_blocks(net, small, real, meter)
    probe = SectionProbe(net, small, real, meter)
    n = len(profiles)
    measured = {(s, e): probe(s, e) for s in range(n) for e in range(s + 1, n + 1)}
    print(f"{spec}: {n} blocks, {len(measured)} spans measured in {time.perf_counter() - t:.0f} s, largest spread "
          f"between repeated runs {probe.largest_spread() / MiB:.2f} MiB")
    return profiles, measured, gradient_bytes(net)


def compare(name, profiles, measured, grads, points: int):
    from sections import plan_schedule
    from sections.schedule.exact import exact_schedule, least_peak
    from sections.schedule.planner import NoPlanFits, _Chain, _least_memory
    from sections.schedule.policies import Store

    total = sum(p.forward_seconds for p in profiles)
    overhead = 0.01 * total / len(profiles)
    options = dict(measured=measured, grad_bytes=grads)
    t = time.perf_counter()
    floor = least_peak(profiles, **options)
    whole = exact_schedule(profiles, float("inf"), section_overhead=overhead, **options).peak
    dp_floor = _least_memory(_Chain(profiles, 0, measured, grads), [Store()], 1.0)
    try:
        plan_schedule(profiles, 0, int(floor), margin=0.0, section_overhead=overhead, **options)
        advised = floor
    except NoPlanFits as err:
        advised = err.advised
    print(f"\n### {name}: {len(profiles)} blocks, one forward {total * 1e3:.2f} ms; peaks beside the base: whole "
          f"chain {whole / MiB:.2f} MiB, exact floor {floor / MiB:.2f} MiB ({floor / whole:.3f} of whole), "
          f"planner's floor (exact bytes) {dp_floor / MiB:.2f} MiB ({dp_floor / floor:.3f}x the exact floor), "
          f"smallest budget it plans at (300 slots, its advice) {advised / MiB:.2f} MiB ({advised / floor:.3f}x)\n")
    print("| budget MiB (of whole) | DP cost (300 slots) | DP cost (3000) | exact cost | DP/exact (300) | "
          "DP/exact (3000) | DP peak MiB | exact peak MiB | exact sections |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for k in range(points):
        limit = floor + (whole - floor) * k / (points - 1)
        exact = exact_schedule(profiles, limit, section_overhead=overhead, **options)
        dp = {}
        for resolution in (300, 3000):
            try:
                plan = plan_schedule(profiles, 0, int(limit), margin=0.0, resolution=resolution,
                                     section_overhead=overhead, **options)
                dp[resolution] = (plan.rerun_seconds + total + overhead * plan.schedule.num_sections,
                                  plan.predicted_peak)
            except NoPlanFits:
                dp[resolution] = None
        cell = lambda r: f"{dp[r][0] / total:.3f}" if dp[r] else "refused"
        ratio = lambda r: f"{dp[r][0] / exact.cost:.3f}" if dp[r] else "-"
        if dp[300]:
            ratios.append(dp[300][0] / exact.cost)
        print(f"| {limit / MiB:.2f} ({limit / whole:.3f}) | {cell(300)} | {cell(3000)} | {exact.cost / total:.3f} | "
              f"{ratio(300)} | {ratio(3000)} | {dp[300][1] / MiB if dp[300] else float('nan'):.2f} | "
              f"{exact.peak / MiB:.2f} | {exact.sections} |")
    print(f"\nworst DP/exact (300 slots) {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}, DP refused "
          f"{points - len(ratios)} of {points} budgets; searches took {time.perf_counter() - t:.1f} s")


def sweep(chains: int, points: int):
    """Random 4-7 block chains (as tests/test_planner_exact.py draws them): how often and how far the plan is
    above the optimum, and why: slots (the gap closes at 30000 slots) or the planner's space (it does not)."""
    from sections import plan_schedule
    from sections.schedule.exact import exact_schedule, least_peak
    from sections.schedule.planner import NoPlanFits, _Chain, _least_memory
    from sections.schedule.policies import Store

    t = time.perf_counter()
    ratios, causes, refused, worst, floors = [], {"slots": 0, "space": 0}, 0, (1.0, None), []
    for seed in range(chains):
        profiles, _, grads = synthetic(0, seed)
        total = sum(p.forward_seconds for p in profiles)
        overhead = 0.01 * total / len(profiles)
        floor = least_peak(profiles, grad_bytes=grads)
        whole = exact_schedule(profiles, float("inf"), grad_bytes=grads, section_overhead=overhead).peak
        floors.append(_least_memory(_Chain(profiles, 0, grads=grads), [Store()], 1.0) / floor)
        for k in range(points):
            limit = floor + (whole - floor) * k / (points - 1)
            exact = exact_schedule(profiles, limit, grad_bytes=grads, section_overhead=overhead)
            cost = {}
            for resolution in (300, 30000):
                try:
                    plan = plan_schedule(profiles, 0, int(limit), margin=0.0, resolution=resolution,
                                         grad_bytes=grads, section_overhead=overhead)
                    cost[resolution] = plan.rerun_seconds + total + overhead * plan.schedule.num_sections
                except NoPlanFits:
                    cost[resolution] = None
            if cost[300] is None:
                refused += 1
                continue
            ratio = cost[300] / exact.cost
            ratios.append(ratio)
            if ratio > 1 + 1e-9:
                fine = cost[30000]
                causes["space" if fine is not None and fine > exact.cost * (1 + 1e-9) else "slots"] += 1
            if ratio > worst[0]:
                worst = (ratio, f"seed {seed}, budget {limit / MiB:.2f} MiB ({limit / whole:.3f} of whole), exact "
                                f"ops {exact.ops}")
    ratios.sort()
    gaps = sum(r > 1 + 1e-9 for r in ratios)
    print(f"\n### sweep: {chains} random chains of 4-7 blocks x {points} budgets (floor to whole)\n\n"
          f"planned {len(ratios)}, refused {refused} (below the planner's slotted floor); above the optimum "
          f"{gaps} ({gaps / len(ratios):.1%}: {causes['slots']} close at 30000 slots, {causes['space']} do not: "
          f"schedules outside the planner's space); DP/exact mean {sum(ratios) / len(ratios):.4f}, median "
          f"{ratios[len(ratios) // 2]:.3f}, 99th percentile {ratios[int(0.99 * len(ratios))]:.3f}, worst "
          f"{worst[0]:.3f} ({worst[1]}); the planner's floor (exact bytes) above the exact floor on "
          f"{sum(f > 1 + 1e-9 for f in floors)} of {chains} chains, by up to {max(floors):.3f}x; "
          f"{time.perf_counter() - t:.0f} s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="synthetic:7:0,synthetic:10:2,resnet:32,MobileNetV2:32:64",
                    help="synthetic:<blocks>:<seed>, resnet:<batch>, <keras.applications name>:<size>:<batch>")
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--sweep", type=int, default=0, help="also this many random 4-7 block chains, summarized")
    args = ap.parse_args()
    from sections import allocator

    print(allocator.configure())
    print("Costs are forward work plus the planner's per-section overhead (1% of a forward per block), in forwards "
          "of the whole chain; budgets and peaks beside the base.")
    for spec in filter(None, args.models.split(",")):
        kind = spec.split(":")
        profiles, measured, grads = synthetic(int(kind[1]), int(kind[2])) if kind[0] == "synthetic" else probed(spec)
        compare(spec, profiles, measured, grads, args.points)
    if args.sweep:
        sweep(args.sweep, args.points)


if __name__ == "__main__":
    main()
