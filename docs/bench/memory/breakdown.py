"""What holds a step's peak: the live allocations at the moment of the peak, from TensorFlow's profiler.

Issue 22 asks, where a target is out of reach, for the smallest peak reachable and what holds it (which tensors).
The allocator's statistics give the peak; the profiler's trace of the same allocator (``MemoryAllocation`` and
``MemoryDeallocation`` events, each with the op that asked and the tensor's shape) gives who holds it. One job runs
in this process: the model built as ``targets/frontier.py`` builds it, two warm steps, then one profiled step, read
by ``runner.record.peak`` (as the runner's ``train.profile_steps`` writes ``peak_breakdown.md``).

    PYTHONPATH=. python docs/bench/memory/breakdown.py --model ResNet50 --batch 256 --sections 13 --top 25
    PYTHONPATH=. python docs/bench/memory/breakdown.py --model resnet --batch 2048 --budget-mib 700
"""
import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "targets"))
MiB = 2**20


def main():
    from frontier import MODES, RESNET_CUTS, build

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="resnet")
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--sections", default="", help="a fixed partition (frontier.py's --cuts values); empty: whole")
    ap.add_argument("--budget-mib", type=float, default=0, help="sections='auto' under this budget")
    ap.add_argument("--lean", default="recompute", help="off, on, recompute")
    ap.add_argument("--probe-batch", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--warm", type=int, default=2, help="steps before the profile")
    ap.add_argument("--profile-steps", type=int, default=1,
                    help="steps profiled (2: what a step leaves allocated shows up in the next one's peak)")
    args = ap.parse_args()

    from sections import allocator

    allocator.configure()
    import tensorflow as tf

    from runner.record import peak
    from sections import Engine, WholeGraph

    net, opt, data = build(args.model, args.batch)
    if args.budget_mib:
        trainer = Engine(net, opt, sections="auto", memory_budget=int(args.budget_mib * MiB), lean=MODES[args.lean],
                         probe_batch=args.probe_batch)
    elif args.sections:
        cuts = RESNET_CUTS[int(args.sections)] if args.model.startswith("resnet") else int(args.sections)
        trainer = Engine(net, opt, sections=cuts, lean=MODES[args.lean])
    else:
        trainer = WholeGraph(net, opt)
    trainer.build(data)
    peaks = [trainer.train_step(data)["step_peak_bytes"] for _ in range(args.warm)]
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        peaks += [trainer.train_step(data)["step_peak_bytes"] for _ in range(args.profile_steps)]
        tf.profiler.experimental.stop()
        found = peak.read(Path(logdir), max(peaks[args.warm:]))
    plan = getattr(trainer, "plan", None)
    sections = len(trainer.sections) if hasattr(trainer, "sections") else 1
    print(f"{args.model} batch {args.batch}, {sections} section(s)"
          + (f"; {plan.summary()}" if plan is not None else "")
          + f"\nstep peaks (allocator statistics) {[round(p / MiB) for p in peaks]} MiB\n")
    print(found.table(args.top) if found else "the profile traced no allocation")

if __name__ == "__main__":
    main()
