"""One section's traced count against the same section run on the device: counted without and with kernels' work
buffers (``sections.backend.workspace``), run in TensorFlow's order and in the order its ops were made
(``tf_internals.run_in_creation_order``, as the engine runs a backward), each with its median seconds (BENCHMARKS.md,
"What a section's count missed").

    .venv/bin/python docs/bench/planner/span_count.py --model resnet50 --spans 0:5 8:12 16:26 43:51

One process under ``TF_CPU_BFC_MEM_LIMIT_IN_MB=--device`` (oneDNN off, as the runner sets under a limit). A span
``s:t`` is blocks ``s .. t-1`` traced as ``static_cost`` traces a section (forward, then the backward with a unit
gradient at its output); "run" is its peak beyond the bytes in use before the call (Grappler's constant folding
off: it would fold the unit gradient into a constant held outside the call). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(model: str, spans: list, repeats: int, trace: bool = False) -> None:
    sys.path.insert(0, str(HERE))
    import zoo

    net, batch = zoo.image_model(model)
    import statistics
    import time

    import keras
    import tensorflow as tf

    from sections import Engine
    from sections.backend.lean import lean_scope
    from sections.backend.liveness import graph_memory
    from sections.backend.static_cost import batch_specs, section_step
    from sections.backend.tf_internals import run_in_creation_order
    from sections.backend.workspace import Workspaces

    # The trace's unit gradient (``ones_like``) would be folded into a constant the function holds from its first
    # call, outside "before" and the run's peak; in the engine the upstream gradient is a tensor like any other.
    tf.config.optimizer.set_experimental_options({"constant_folding": False})
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections=2)
    engine.build(batch)  # the border specs
    borders, meter, mib = engine.borders, engine.meter, 2**20
    work = Workspaces(meter, room=engine.device_memory.total)  # as the engine measures them
    for s, t in spans:
        blocks = net.blocks[s:t]
        state = [v for b in blocks for v in b.layer.non_trainable_variables]
        specs = borders.specs_before(s)
        fields = batch_specs(borders.probe_slice, borders.real_batch)
        h = tf.nest.map_structure(lambda spec: tf.random.uniform(spec.shape, dtype=spec.dtype), specs)
        snapshot = [tf.identity(v.value) for v in state]
        row = []
        for ordered in (False, True):
            split: list = []
            step, _ = section_step(blocks, split, [])
            train = chained(step, split, run_in_creation_order) if ordered else step
            with lean_scope(engine.lean):
                fn = tf.function(train)
                state_specs = [tf.TensorSpec(v.shape, v.dtype) for v in state]
                graph = fn.get_concrete_function(specs, fields, state_specs).graph
                if not ordered:
                    row.append(f"counted {graph_memory(graph, split[0]).peak / mib:.1f}, with work buffers "
                               f"{graph_memory(graph, split[0], work).peak / mib:.1f} MiB")
                fn(h, batch, snapshot)
                meter.reset()
                before = meter.current()
                out = fn(h, batch, snapshot)
                peak = meter.peak() - before
                del out
                seconds = []
                for _ in range(repeats):
                    began = time.perf_counter()
                    out = fn(h, batch, snapshot)
                    float(tf.reduce_sum(out[0]) if out else 0.0)
                    seconds.append(time.perf_counter() - began)
                    del out
                if trace and ordered:
                    print(f"blocks {s}-{t}, creation order: " + allocations(fn, h, batch, snapshot), flush=True)
            order = "creation" if ordered else "TensorFlow's"
            row.append(f"run in {order} order {peak / mib:.1f} MiB, "
                       f"{statistics.median(seconds):.3f} s")
        print(f"blocks {s}-{t}: " + "; ".join(row), flush=True)


def allocations(fn, *args) -> str:
    """One call of ``fn`` under TensorFlow's profiler: its allocator events of at least 1 MiB, in order, as
    ``+op chunk MiB (in use MiB)`` and ``-chunk MiB (in use MiB)`` (the chunk: what the allocator gave, at least
    what was asked)."""
    import tempfile

    import tensorflow as tf

    from runner.record import peak

    with tempfile.TemporaryDirectory() as folder:
        tf.profiler.experimental.start(folder)
        out = fn(*args)
        del out
        tf.profiler.experimental.stop()
        files = sorted(Path(folder).glob("**/*.xplane.pb"))
        events = peak._events(files[-1]) if files else []
    shown = []
    for kind, stats in events:
        size, in_use = (stats.get("allocation_bytes") or 0) / 2**20, (stats.get("bytes_allocated") or 0) / 2**20
        if kind == "MemoryAllocation" and size >= 1:
            shown.append(f"+{stats.get('tf_op')} {size:.1f} ({in_use:.1f})")
        elif kind != "MemoryAllocation" and size >= 1:
            shown.append(f"-{size:.1f} ({in_use:.1f})")
    return ", ".join(shown) or "no allocator events"


def chained(step, split: list, run_in_creation_order):
    """``step`` with its backward chained in creation order, as the engine runs a section's backward."""
    import tensorflow as tf

    def train(*args):
        graph = tf.compat.v1.get_default_graph()
        grads = step(*args)
        run_in_creation_order(graph, split[-1], len(graph.get_operations()))
        return grads

    return train


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--spans", nargs="+", default=["0:5", "8:12", "16:26", "43:51"], help="s:t block spans")
    parser.add_argument("--device", type=int, default=2000, help="the emulated device's MiB")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per span and order")
    parser.add_argument("--trace", action="store_true",
                        help="also print one creation-order call's allocator events of at least 1 MiB")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    spans = [tuple(int(x) for x in span.split(":")) for span in args.spans]
    if args.worker:
        worker(args.model, spans, args.repeats, args.trace)
        return
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_ENABLE_ONEDNN_OPTS="0", TF_CPU_ALLOCATOR_USE_BFC="true",
               TF_CPU_BFC_MEM_LIMIT_IN_MB=str(args.device))
    subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, check=True)


if __name__ == "__main__":
    main()
