"""The least-memory plan ``sections="auto"`` builds for a zoo model, trained on a device large enough for it: each
section's peak, its counted activation bytes and the base beside them (BENCHMARKS.md, "ResNet50 at 0.6").

    .venv/bin/python docs/bench/planner/least_plan_sections.py --model resnet50 --device 420

Runs one process under ``TF_CPU_BFC_MEM_LIMIT_IN_MB=--device`` (oneDNN off, as the runner sets under a limit):
plans with no budget, then swaps in the calibrator's least-memory plan and trains ``--steps`` steps. ``--batch``
and ``--max-blocks`` change the zoo's batch and a keras.applications model's block limit; ``--order tensorflow``
leaves each backward in TensorFlow's order (the engine's chain replaced by nothing); ``--apply at_end`` updates
once after the backward. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model: str, steps: int, batch_size: int | None = None, max_blocks: int | None = None,
           order: str = "creation", apply: str = "auto") -> None:
    sys.path.insert(0, str(HERE))
    import zoo

    net, batch = zoo.image_model(model, batch_size, max_blocks)
    import keras

    from sections import Engine

    if order == "tensorflow":  # the engine's chain of each backward replaced by nothing: TensorFlow's own order
        import sections.step.section_functions as section_functions

        section_functions.run_in_creation_order = lambda graph, first, last: None
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections="auto", apply=apply)
    engine.build(batch)
    cal = engine.calibrator
    print("planning's dry steps, predicted -> measured (MiB):",
          [f"{d['sections']} sections {d['predicted'] / 2**20:.1f} -> {d['measured'] / 2**20:.1f}"
           for d in engine.dry_runs])
    least = cal._least_plan()
    engine.adopt(least.schedule)  # the plan that runs (the calibrator's choice may be another)
    engine.plan = least
    mib = 2**20
    print(f"least {least.schedule.num_sections} sections, starts {list(least.schedule.starts)}, "
          f"predicted {least.predicted_peak / mib:.1f} MiB; base {cal.search.base / mib:.1f} MiB")
    print("counted activation bytes (MiB):", [round(cal.counted[span] / mib, 1) for span in least.leaves
                                              if span in cal.counted])
    print("predicted per section (MiB):", [round((held + cal.counted.get(span, 0)) / mib, 1)
                                           for span, held in zip(least.leaves, least.leaf_held)])
    print(f"kernels' work buffers: {len(engine.workspaces.cache)} ops measured in {engine.workspaces.seconds:.1f} s, "
          f"largest {max(engine.workspaces.cache.values(), default=0) / mib:.1f} MiB")
    for step in range(steps):
        reading = engine.train_step(batch)
        print(f"step {step + 1}: peak {reading['step_peak_bytes'] / mib:.1f} MiB, per section (MiB):",
              [round(p / mib, 1) if p else p for p in reading["peak_bytes"]], flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--device", type=int, default=420, help="the emulated device's MiB")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=None, help="the batch (default: the zoo's)")
    parser.add_argument("--max-blocks", type=int, default=None, help="a keras.applications model's block limit")
    parser.add_argument("--order", choices=["creation", "tensorflow"], default="creation",
                        help="a section's backward in creation order (the engine's) or TensorFlow's")
    parser.add_argument("--apply", choices=["auto", "at_end"], default="auto", help="the engine's apply")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.worker:
        worker(args.model, args.steps, args.batch, args.max_blocks, args.order, args.apply)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(args.device))
    subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, check=True)


if __name__ == "__main__":
    main()
