"""Step time of sectionflow plans against whole-graph steps, interleaved in one process (a ratio noise cannot tilt).

Memory is measured one process per job (``frontier.py``); time, on a shared machine, moves by 10% between
processes, so this script builds every job in one process and runs their steps in turn, ``--rounds`` times,
reporting each job's median step over the rounds (the first round traces) and its ratio to ``whole``'s.
Jobs: ``whole``, ``sectioned:N:LEAN`` (N sections, lean ``on``/``off``/``recompute``) and
``auto:MiB:LEAN`` (``sections="auto"`` under a budget in MiB; its plan then runs as a fixed schedule on a fresh
copy of the model, so no step re-plans on memory the other jobs hold in this process: build the auto jobs first).

    TF_NUM_INTEROP_THREADS=1 PYTHONPATH=. python docs/bench/targets/interleave.py --model resnet --batch 2048 \\
        --jobs auto:837:recompute auto:1256:recompute whole --rounds 6
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from frontier import MODES, build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--jobs", nargs="+", default=["whole", "sectioned:1:recompute"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--base", default="whole", help="the job the ratios divide by")
    ap.add_argument("--probe-batch", type=int, default=None)
    args = ap.parse_args()
    from sections import allocator

    allocator.configure()
    from sections import Engine, WholeGraph

    trainers, data = {}, None
    for spec in args.jobs:
        net, opt, data = build(args.model, args.batch)
        kind, *rest = spec.split(":")
        if kind == "whole":
            trainer = WholeGraph(net, opt)
        elif kind == "sectioned":
            trainer = Engine(net, opt, sections=int(rest[0]), lean=MODES[rest[1]])
        else:
            planner = Engine(net, opt, sections="auto", memory_budget=f"{rest[0]}MiB", lean=MODES[rest[1]],
                             probe_batch=args.probe_batch)
            planner.build(data)
            print(f"{spec} planned: {planner.plan.summary()}", flush=True)
            net, opt, data = build(args.model, args.batch)
            trainer = Engine(net, opt, sections=planner.schedule, lean=MODES[rest[1]])
            del planner
        trainer.build(data)
        trainers[spec] = trainer
        print(f"built {spec}: {[s.stop - s.start for s in trainer.sections]} blocks per section", flush=True)
    times = {spec: [] for spec in trainers}
    for _ in range(args.rounds):
        for spec, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(data)
            times[spec].append(time.perf_counter() - start)
    base = statistics.median(times[args.base][1:])
    print(f"| job | median s (rounds 2..{args.rounds}) | time / {args.base} | all rounds |\n|---|---|---|---|")
    for spec, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"| {spec} | {med:.2f} | {med / base:.3f} | {', '.join(f'{t:.2f}' for t in ts)} |", flush=True)


if __name__ == "__main__":
    main()
