"""Plans remembered across processes: what a plan depends on as a key, and a chosen plan as plain data.

A plan's dry step reads the allocator's slack, which differs by process (the same plan 178.9-225.0 MiB over 17
processes of one command), and its counts include kernels' work buffers measured in the process, so two fresh
searches can choose two plans. A plan remembered under its key is tried first by the next process of the same
set-up: its schedule and figures are read back from the record, and it runs where its dry step fits; anything else
is a fresh search. A stale record costs one dry step, never a wrong step: what runs is a partition of these blocks,
measured in this process.
The engine reads and writes records through a mapping the caller gives (``Engine(plan_store=...)``): it keeps no
files.
"""

from __future__ import annotations

import hashlib
import json

import keras
import tensorflow as tf

FORMAT = 1  # a change to what a record holds or how the planner reads it makes old records miss


def plan_key(network, borders, optimizer, budget, device: str, lean, jit_compile: bool,
             apply_reason: str | None) -> str:
    """What the planner's choice depends on: the blocks (names, kinds, variables' shapes), the borders' specs at the real
    batch, the optimizer's kind, the budget (as given where it moves by process: on a CPU without a limit it is the
    machine's memory less what the process holds), the device, the engine's options, and TensorFlow's and Keras's
    versions."""
    blocks = [[b.name, _kinds(b.layer), b.fields, _shapes(b.layer)] for b in network.blocks]
    specs = [str(borders.specs_before(j)) for j in range(len(network.blocks))]
    batch = {k: [borders.real_batch, *v.shape[1:], v.dtype.name] for k, v in sorted(borders.probe_slice.items())}
    described = {"format": FORMAT, "tensorflow": tf.__version__, "keras": keras.__version__, "blocks": blocks,
                 "borders": specs, "batch": batch, "optimizer": type(optimizer).__name__, "budget": budget,
                 "device": device, "lean": repr(lean), "jit_compile": bool(jit_compile), "apply": apply_reason,
                 "precision": keras.config.dtype_policy().name}
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:40]


def record_of(plan, dry_step: int | None) -> dict:
    """A plan as JSON-able data: its schedule, the figures the planner gave it, and what its dry step measured."""
    schedule = plan.schedule
    return {"sections": schedule.num_sections,
            "schedule": {"starts": list(schedule.starts), "policies": [p.name for p in schedule.policies],
                         "actions": sorted([p, t, mode, q] for (p, t), (mode, q) in schedule.actions.items()),
                         "plain": sorted(schedule.plain)},
            "plan": {"modelled": int(plan.predicted_peak - plan.base_bytes), "rerun_seconds": plan.rerun_seconds,
                     "forward_runs": list(plan.forward_runs), "leaves": [list(span) for span in plan.leaves],
                     "measured_sections": plan.measured_sections, "apply_peak": int(plan.apply_peak),
                     "leaf_held": list(plan.leaf_held)},
            "dry_step": dry_step}


def plan_of(record, blocks: int, budget: int, base_bytes: int):
    """The ``Plan`` a record describes (``record_of``) for a network of ``blocks`` blocks, or None where it
    describes none (another format, sections outside the blocks, an unknown policy)."""
    from ..schedule.planner import Plan
    from ..schedule.policies import resolve
    from ..schedule.program import Schedule

    try:
        sched, figures = record["schedule"], record["plan"]
        starts = tuple(int(i) for i in sched["starts"])
        policies = tuple(resolve(name) for name in sched["policies"])
        if list(starts) != sorted(set(starts)) or any(not 0 < i < blocks for i in starts) or \
                len(policies) != len(starts) + 1:
            return None
        schedule = Schedule(starts, policies, {(int(p), int(t)): (str(mode), int(q))
                                               for p, t, mode, q in sched["actions"]},
                            frozenset(int(k) for k in sched["plain"]))
        return Plan(schedule, base_bytes + int(figures["modelled"]), float(figures["rerun_seconds"]), budget,
                    base_bytes, tuple(int(n) for n in figures["forward_runs"]),
                    tuple(tuple(int(i) for i in span) for span in figures["leaves"]),
                    measured_sections=int(figures["measured_sections"]), apply_peak=int(figures["apply_peak"]),
                    leaf_held=tuple(int(b) for b in figures["leaf_held"]))
    except (KeyError, TypeError, ValueError):
        return None


def _kinds(layer) -> list[str]:
    """The block's kind and its parts' kinds (a Keras model's layers, a cut Keras graph's operations)."""
    return [type(layer).__name__, *(type(part).__name__ for part in getattr(layer, "layers", ()))]


def _shapes(layer) -> list:
    """Its variables' shapes and dtypes (not their names: Keras numbers them by what the process made before)."""
    return [[list(v.shape), str(v.dtype)] for v in [*layer.trainable_variables, *layer.non_trainable_variables]]
