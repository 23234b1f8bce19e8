"""Plans remembered across processes: what a plan depends on as a key, and a chosen plan as plain data.

A plan's dry step reads the allocator's slack, which differs by process (the same plan 178.9-225.0 MiB over 17
processes of one command), so two fresh searches can choose two plans. A plan remembered under its key is tried
first by the next process of the same set-up: the planner makes it again from the record (the room it was solved
for, the sections it counted) and it runs where it is the same schedule and its dry step fits; anything else is
a fresh search. A record that names another model's plan, or a stale one, costs one dry step, never a wrong step.
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


def schedule_record(schedule) -> dict:
    """A schedule as JSON-able data (compared, never built from)."""
    return {"starts": list(schedule.starts), "policies": [p.name for p in schedule.policies],
            "actions": sorted([p, t, mode, q] for (p, t), (mode, q) in schedule.actions.items()),
            "plain": sorted(schedule.plain)}


def _kinds(layer) -> list[str]:
    """The block's kind and its parts' kinds (a Keras model's layers, a cut Keras graph's operations)."""
    return [type(layer).__name__, *(type(part).__name__ for part in getattr(layer, "layers", ()))]


def _shapes(layer) -> list:
    """Its variables' shapes and dtypes (not their names: Keras numbers them by what the process made before)."""
    return [[list(v.shape), str(v.dtype)] for v in [*layer.trainable_variables, *layer.non_trainable_variables]]
