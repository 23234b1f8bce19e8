"""What the count cannot see: a ratio or a constant? Each plan of a ladder predicted from the least-memory plan.

    .venv/bin/python docs/bench/planner/fit_forms.py --models gpt2 resnet efficientnetb0

Per model (zoo.py's entries), one process on an unlimited BFC allocator (4000 MiB, oneDNN off): ``sections="auto"``
builds, then the least-memory plan and the plans the count puts within 1.25, 1.6, 2.2, 3.5 and 100 times its bytes
are dry-run. Each plan is predicted from the least plan's dry step two ways: at its ratio of measured to counted
bytes (what the search's fit does past its last point) and with its measured-minus-counted bytes added; errors
are printed in % of the absolute peak measured. Nothing is asserted (BENCHMARKS.md keeps the table).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
MiB = 2**20
ROOMS = (1.25, 1.6, 2.2, 3.5, 100)


def worker(model: str) -> dict:
    sys.path[:0] = [str(ROOT), str(HERE)]
    from sections.allocator import configure

    configure()
    import keras
    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads(1)
    import zoo
    from sections import Engine

    kind, args, b, shape = zoo.ZOO[model]
    keras.utils.set_random_seed(0)
    net = zoo._build(kind, args, shape)
    if kind == "keras_hub":
        tokens = tf.random.uniform((b, shape[0] + 1), 0, 256, dtype=tf.int32)
        batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    else:
        batch = {"image": tf.random.uniform((b, *shape)), "label": tf.range(b) % 10}
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections="auto", memory_budget="4000MiB")
    engine.build(batch)
    cal = engine.calibrator
    least = cal._least()
    plans, seen = [], set()
    for candidate in [least, *(cal._within(int(least.modelled * f)) for f in ROOMS)]:
        if candidate is None:
            continue
        plan = cal._plan_of(candidate)
        key = (tuple(plan.starts), tuple(plan.policies))
        if key in seen:
            continue
        seen.add(key)
        dry = cal.measurer.dry_step(plan.schedule, batch)
        plans.append({"sections": plan.schedule.num_sections, "modelled": candidate.modelled,
                      "measured": dry.peak - cal.search.base, "ran_out": dry.ran_out})
    return {"model": model, "base": cal.search.base, "plans": plans}


def report(result: dict) -> None:
    plans, base = result["plans"], result["base"]
    least = plans[0]
    ratio, extra = least["measured"] / least["modelled"], least["measured"] - least["modelled"]
    print(f"{result['model']} (base {base / MiB:.1f}): least {least['modelled'] / MiB:.1f}->"
          f"{least['measured'] / MiB:.1f} (x{ratio:.2f}, +{extra / MiB:.1f})")
    for p in plans[1:]:
        m, y = p["modelled"], p["measured"]
        err = lambda pred: 100 * (pred - y) / (y + base)  # noqa: E731
        print(f"   {p['sections']} sec {m / MiB:.1f}->{y / MiB:.1f}   ratio {err(ratio * m):+.1f}%   "
              f"constant {err(m + extra):+.1f}%" + ("   (ran out)" if p["ran_out"] else ""))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Ratio or constant: plans predicted from the least plan's dry step.")
    parser.add_argument("--models", nargs="*", default=["gpt2", "resnet", "efficientnetb0"])
    return parser


def main() -> None:
    args = build_parser().parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB="4000")
    for model in args.models:
        proc = subprocess.run([sys.executable, __file__, "--worker", model], env=env, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if not lines:
            print(f"{model}: failed ({proc.returncode}): {proc.stderr[-600:]}")
            continue
        report(json.loads(lines[-1]))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        print(json.dumps(worker(sys.argv[2])))
    else:
        main()
