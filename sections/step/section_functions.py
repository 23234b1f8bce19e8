"""A schedule turned into section functions: its sections and their compiled functions (first forward, replayed
forward, re-run backward, the fused last section), as one ``Compiled`` record the executor runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import keras
import tensorflow as tf

from ..backend.lean import lean_scope
from ..backend.relaxed import RelaxedFunction
from ..backend.replicas import Replicas, local_size
from ..backend.structure import float_leaves, nbytes
from ..backend.tf_internals import run_in_creation_order
from ..network.network import unique_variables
from ..schedule.partition import Section
from ..schedule.program import Schedule


class ReplayMismatchError(RuntimeError):
    """A section's re-run forward differed from its first run (randomness the engine cannot replay)."""


def _zeros_for_missing(ys, grads):
    return [tf.zeros_like(y) if g is None else g for y, g in zip(ys, grads)]


def max_relative_diff(a, b) -> tf.Tensor:
    """max |a - b| / (1 + max |b|) over the leaves of two structures (used by check mode)."""
    diffs = []
    for x, y in zip(tf.nest.flatten(a), tf.nest.flatten(b)):
        x = tf.cast(x, tf.float32)
        y = tf.cast(y, tf.float32)
        diffs.append(tf.reduce_max(tf.abs(x - y)) / (1.0 + tf.reduce_max(tf.abs(y))))
    return tf.reduce_max(tf.stack(diffs)) if diffs else tf.constant(0.0)


class SectionFunctions:
    """The ``tf.function``s of one section.

    ``counter`` is a ``tf.Variable`` incremented inside each compiled forward execution, so forward runs are
    counted by the code that ran, not assumed. A section's first run in a step updates its state (batch-norm
    statistics, seed generators) and returns a snapshot of the state before it; every later run reads that
    snapshot and drops its state writes, so it computes exactly what the first run did. ``lean``: every run
    traces its layers inside ``lean_scope`` (batch norm and some activations with gradients that keep less).
    """

    def __init__(self, network, section, counter: tf.Variable, jit_compile: bool = False, tol: float = 1e-4,
                 scale_loss=None, replicas=None, lean: bool | str = False):
        self.network = network
        self.lean = lean  # one of rules.LEAN_MODES
        self.replicas = replicas or Replicas()
        # The loss the gradients are taken of (loss scaling for mixed precision, 1/replicas under a strategy).
        self.scale_loss = scale_loss or (lambda loss: loss)
        self.section = section
        self.counter = counter
        self.tol = tol
        self.needs_input_grad = section.index > 0
        batch_args = {"first": (0, 1), "replay": (0, 1), "rerun_backward": (0, 1, 2, 4), "fused": (0, 1)}
        self._compiled = {name: RelaxedFunction(self.replicas.wrap(getattr(self, name + "_body")), jit_compile, args)
                          for name, args in batch_args.items()}

    def _call(self, name, h, *args):
        return self._compiled[name](local_size(h, self.replicas), h, *args)

    # ---------------------------------------------------------------- what policies call
    def sources(self, h) -> list:
        """The input's tensors that get a gradient (none for the first section: its input is data)."""
        return float_leaves(h) if self.needs_input_grad else []

    def forward(self, h, view, snapshot=None):
        """Run the section: the first time in a step (``snapshot=None``) or a replay. Returns (output, snapshot)."""
        if snapshot is None:
            return self._call("first", h, view)
        return self._call("replay", h, view, snapshot), snapshot

    def rerun_backward(self, h, view, upstream, snapshot, expected=None):
        """Re-run from the cached input and state, then a vector-Jacobian product."""
        g_in, g_vars, diff = self._call("rerun_backward", h, view, upstream, snapshot, expected)
        diff = self.replicas.max(diff) if expected is not None else 0.0
        if diff > self.tol:
            sec = self.section
            raise ReplayMismatchError(
                f"{sec.name} ({sec.block_names[0]}..{sec.block_names[-1]}): the re-run forward differs from "
                f"the first run (max relative difference {diff:.3g} > {self.tol}). Randomness inside it is "
                f"not replayable; draw it through a keras.random.SeedGenerator, or use policy='store' for it.")
        return g_in, g_vars

    def tape_backward(self, tape, h, out, upstream):
        """Backward from a tape kept during the forward (no re-run). Under a strategy the tape recorded one
        multi-device call: each replica's components (its variables' copies included) are differentiated and
        packed back into per-replica values; on one device every value is its own single component."""
        parts = self.replicas.components
        xs, ys = self.sources(h), float_leaves(out)
        up = [parts(g) if g is not None else [tf.zeros_like(c) for c in parts(y)] for y, g in zip(ys, upstream)]
        sources = [parts(x) for x in xs] + [parts(v) for v in self.section.variables]
        grads = tape.gradient([c for y in ys for c in parts(y)], [c for group in sources for c in group],
                              output_gradients=[c for g in up for c in g])
        packed, i = [], 0
        for group in sources:
            packed.append(self.replicas.pack(grads[i:i + len(group)]))
            i += len(group)
        return packed[: len(xs)], packed[len(xs):]

    def watch(self, tape, h) -> None:
        """Watch the input's gradient-carrying tensors (each replica's components under a strategy)."""
        tape.watch([c for x in self.sources(h) for c in self.replicas.components(x)])

    def fused(self, h, view):
        """The last section: forward, loss and backward in one run. Returns (loss, input grads, variable grads)."""
        return self._call("fused", h, view)

    # ---------------------------------------------------------------- compiled bodies
    # Public: ``one_graph`` traces them into one step, and ``flops`` into its cost analysis.
    def _run(self, h, batch):
        self.counter.assign_add(1)
        sec = self.section
        with lean_scope(self.lean):
            return self.network.run_blocks(h, batch, True, sec.start, sec.stop)

    def _replaying(self, snapshot):
        # State reads come from the snapshot and state writes are dropped: batch-norm statistics update once
        # per step, and seed generators replay the first run's random draws.
        return keras.StatelessScope(state_mapping=list(zip(self.section.state_variables, snapshot)))

    def first_body(self, h, batch):
        snapshot = [tf.identity(v.value) for v in self.section.state_variables]
        with tf.control_dependencies(snapshot):
            out = self._run(h, batch)
        return out, snapshot

    def replay_body(self, h, batch, snapshot):
        with self._replaying(snapshot):
            return self._run(h, batch)

    def rerun_backward_body(self, h, batch, upstream, snapshot, expected):
        with tf.GradientTape() as tape:
            xs = self.sources(h)
            tape.watch(xs)
            with self._replaying(snapshot):
                out = self._run(h, batch)
        ys = float_leaves(out)
        with self._in_creation_order():
            grads = tape.gradient(ys, xs + self.section.variables, output_gradients=_zeros_for_missing(ys, upstream))
        diff = max_relative_diff(out, expected) if expected is not None else tf.constant(0.0)
        return grads[: len(xs)], grads[len(xs):], diff

    def fused_body(self, h, batch):
        with tf.GradientTape() as tape:
            xs = self.sources(h)
            tape.watch(xs)
            out = self._run(h, batch)
            loss = self.network.loss(out, batch)
            scaled = self.scale_loss(loss)
        with self._in_creation_order():
            grads = tape.gradient(scaled, xs + self.section.variables)
        return loss, grads[: len(xs)], grads[len(xs):]

    @contextlib.contextmanager
    def _in_creation_order(self):
        """The backward traced in this block runs its ops in the order they were made, the order the planner counts
        (``tf_internals.run_in_creation_order``). Not under a strategy: replicas trace into one graph, and each
        must stay free of the others."""
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        yield
        if not self.replicas.distributed:
            run_in_creation_order(graph, first, len(graph.get_operations()))

    def trace_counts(self) -> dict[str, int]:
        return {f"{self.section.name}/{k}": f.tracing_count() for k, f in self._compiled.items()}


@dataclass(frozen=True)
class Borders:
    """What a network's borders hold, read once at build from an eager forward of a small slice (no step runs):
    the slice and the real batch size, the input's TensorSpecs and every block output's at the real batch, and
    the batch's bytes."""

    probe_slice: dict
    real_batch: int
    input_specs: object
    output_specs: list
    batch_bytes: int

    def specs_before(self, block: int):
        """The specs of block ``block``'s input (the network input for block 0)."""
        return self.input_specs if block == 0 else self.output_specs[block - 1]


@dataclass(frozen=True)
class Compiled:
    """A schedule compiled: its sections, each one's forward-run counter, the batch fields it reads, its functions
    (none for the baselines, which compile one whole step), and per section the trainable variables (indices)
    whose gradient is whole once its backward has run."""

    schedule: Schedule | None
    sections: tuple[Section, ...]
    counters: tuple[tf.Variable, ...]
    fields: tuple[tuple[str, ...], ...]
    functions: tuple[SectionFunctions, ...] = ()
    complete: tuple[tuple[int, ...], ...] = ()

    def read_counters(self) -> list[int]:
        """Each section's forward runs since the last read, and the counters set back to zero."""
        runs = [int(c.numpy()) for c in self.counters]
        for c in self.counters:
            c.assign(0)
        return runs

    def views(self, batch) -> list[dict]:
        """Each section's part of the batch (the fields it reads)."""
        return [{key: batch[key] for key in fields} for fields in self.fields]


def make_sections(network, borders: Borders, starts, policies) -> list[Section]:
    """The sections of a partition (block starts), with their variables and input borders."""
    blocks = network.blocks
    bounds = [0, *starts, len(blocks)]
    sections = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        layers = [b.layer for b in blocks[lo:hi]]
        in_specs = borders.specs_before(lo)
        sections.append(Section(
            index=k, start=lo, stop=hi, block_names=[b.name for b in blocks[lo:hi]], policy=policies[k],
            variables=unique_variables(v for layer in layers for v in layer.trainable_variables),
            state_variables=unique_variables(v for layer in layers for v in layer.non_trainable_variables),
            input_bytes=nbytes(in_specs), input_specs=in_specs))
    return sections


def make_counters(replicas: Replicas, count: int) -> list[tf.Variable]:
    """One forward-run counter per section. Under a strategy every replica increments its counter; the first
    replica's count is kept, so forward runs read per replica."""
    with replicas.scope():
        return [tf.Variable(0, dtype=tf.int64, trainable=False,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA) for _ in range(count)]


def compile_partition(network, borders: Borders, replicas: Replicas, starts, policies,
                      schedule: Schedule | None = None, functions=None) -> Compiled:
    """A partition's sections, counters and fields; ``functions(section, counter)`` makes each section's compiled
    functions (None: none, as the baselines)."""
    sections = make_sections(network, borders, starts, policies)
    counters = make_counters(replicas, len(sections))
    fields = tuple(tuple(network.fields_for(s.start, s.stop, list(borders.probe_slice))) for s in sections)
    fns = tuple(functions(s, c) for s, c in zip(sections, counters)) if functions is not None else ()
    return Compiled(schedule, tuple(sections), tuple(counters), fields, fns, complete_after(network, sections))


def compile_schedule(network, borders: Borders, replicas: Replicas, schedule: Schedule, *, jit_compile: bool,
                     scale_loss, lean) -> Compiled:
    """A schedule's sections and each one's ``SectionFunctions`` (``lean``, but plain in ``schedule.plain``)."""
    return compile_partition(
        network, borders, replicas, list(schedule.starts), [p.name for p in schedule.policies], schedule,
        lambda s, c: SectionFunctions(network, s, c, jit_compile, scale_loss=scale_loss, replicas=replicas,
                                      lean=False if s.index in schedule.plain else lean))


def complete_after(network, sections) -> tuple[tuple[int, ...], ...]:
    """Per section, the trainable variables (indices into ``network.trainable_variables``) whose gradient is whole
    once its backward has run: those of no earlier section (the backward runs from the last section to the
    first)."""
    index = {id(v): i for i, v in enumerate(network.trainable_variables)}
    first = {}
    for section in sections:
        for v in section.variables:
            first.setdefault(index.get(id(v)), section.index)
    first.pop(None, None)  # non-trainable
    return tuple(tuple(sorted(i for i, k in first.items() if k == section.index)) for section in sections)
