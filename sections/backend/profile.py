"""A probe of each block: border shapes (from a small slice), activation memory and forward time (at the
real batch by default; figures from a smaller slice are scaled to it). Each block is compiled the way the
engine compiles a section, so the memory measured is what a compiled backward keeps, not what an eager tape
would."""

from __future__ import annotations

import time
from dataclasses import dataclass

import keras
import tensorflow as tf

from ..schedule.planner import DOES_NOT_FIT
from .device import release
from .lean import lean_scope
from .memory import MemoryMeter, one_op_order
from .relaxed import RelaxedFunction
from .structure import float_leaves, nbytes


@dataclass(frozen=True)
class BlockProfile:
    """One block's measured costs, at the real batch."""

    name: str
    output_bytes: int       # its output border
    kept_bytes: int         # activations its compiled backward needs (a chain of blocks accumulates these)
    transient_bytes: int    # gradient buffers alive only while its own backward runs
    forward_seconds: float  # one compiled forward (the re-run cost)
    stored_bytes: int = 0   # what a tape keeps from its compiled forward until its backward (policy "store")
    entry_bytes: int = 0    # of kept_bytes and stored_bytes, its input border's (held by the caller when it
                            # starts a section)


_NOT_ACTIVATIONS = {"Const", "ReadVariableOp", "Identity", "Placeholder", "VarHandleOp", "NoOp", "Shape",
                    "AssignVariableOp", "AssignAddVariableOp", "StatelessRandomGetKeyCounter"}


def shape_costs(network, small, real: int, input_specs, output_specs) -> list[int]:
    """Activation bytes of each block counted from the tensor shapes of its traced forward (every float
    tensor an op produces), at the real batch. Nothing runs, so this is the same on every run and machine."""
    pb = int(tf.nest.flatten(small[network.inputs])[0].shape[0])
    costs = []
    for block, specs in zip(network.blocks, [input_specs, *output_specs[:-1]]):
        specs = specs_at(specs, pb)
        fn = tf.function(lambda x, b=block: b(x, small, training=True))
        total = 0
        for op in fn.get_concrete_function(specs).graph.get_operations():
            if op.type in _NOT_ACTIVATIONS:
                continue
            for t in op.outputs:
                if t.dtype.is_floating and t.shape.is_fully_defined():
                    total += t.shape.num_elements() * t.dtype.size
        costs.append(total * real // pb)
    return costs


def specs_at(structure, batch: int):
    """``structure``'s TensorSpecs with ``batch`` as their first dimension."""
    return tf.nest.map_structure(lambda t: tf.TensorSpec([batch] + t.shape.as_list()[1:], t.dtype), structure)


def _block_functions(block, batch):
    state = list(block.layer.non_trainable_variables)

    def forward(h, snapshot):
        with keras.StatelessScope(state_mapping=list(zip(state, snapshot))):
            return block(h, batch, training=True)

    def train(h, snapshot):
        with tf.GradientTape() as tape:
            xs = float_leaves(h)
            tape.watch(xs)
            with keras.StatelessScope(state_mapping=list(zip(state, snapshot))):
                out = block(h, batch, training=True)
        ys = float_leaves(out)
        variables = [_first_component(v) for v in block.layer.trainable_variables]
        if ys and (xs or variables):
            return tape.gradient(ys, xs + variables, output_gradients=[tf.ones_like(y) for y in ys])
        return []

    return RelaxedFunction(forward, batch_args=(0,)), RelaxedFunction(train, batch_args=(0,))


class ProbeMemo:
    """Probe figures at one probe slice, kept on the network (``Network.probe_memos``) across the engines built on
    it: ``batch=max`` builds one per trial batch, and trials whose probe slices have the same shapes measure the
    same thing. ``blocks``: the block profiles, scaled to ``real``; ``sections``: each section's figure and spread
    at the slice (unscaled; none for a section the device had no memory for: it may fit beside another batch)."""

    def __init__(self):
        self.real: int | None = None
        self.blocks: list | None = None
        self.sections: dict = {}


def probe_memo(network, small, lean, plain: bool = False) -> ProbeMemo:
    """The network's memo for probes of the slice ``small`` (its shapes and dtypes) under ``lean`` (``plain``: the
    probes without lean gradients)."""
    key = (repr(lean), plain, tuple((tuple(t.shape), t.dtype.name) for t in tf.nest.flatten(small)))
    return network.probe_memos.setdefault(key, ProbeMemo())


def rescaled(profiles: list, real: int, new: int) -> list:
    """Block profiles measured for batch ``real``, for batch ``new`` (every figure grows with the batch)."""
    k = new / real
    return [BlockProfile(p.name, int(p.output_bytes * k), int(p.kept_bytes * k), int(p.transient_bytes * k),
                         p.forward_seconds * k, int(p.stored_bytes * k), int(p.entry_bytes * k)) for p in profiles]


class SectionProbe:
    """Measures runs of blocks as one compiled section (forward, then backward from its output), on the probe
    slice, state untouched; figures scaled to the real batch and cached per span.

    A section's backward holds what its blocks keep together, which is not the sum of what each keeps alone
    (the compiled graph frees and reuses buffers across blocks): the planner reads these measured figures for
    the sections it chooses. Borders are kept every ``stride`` blocks and others re-computed from the nearest.
    """

    RUNS = 3  # the executor's op order (so the peak) varies call to call: the largest of these is used
    RUNS_ONE_ORDER = 2  # ops on one inter-op thread run in one order: the peak repeats, two runs show it does

    def __init__(self, network, small, real: int, meter: MemoryMeter, stride: int = 8, memo: ProbeMemo | None = None):
        self.network, self.small, self.real, self.meter = network, small, real, meter
        self.memo = ProbeMemo() if memo is None else memo
        self.pb = int(tf.nest.flatten(small[network.inputs])[0].shape[0])
        self.stride = stride
        self._borders = {0: small[network.inputs]}
        self._state = [(v, tf.identity(v.value)) for v in network.non_trainable_variables]
        self.measured: dict = {}   # (start, stop) -> activation bytes at the real batch (upstream gradient excluded)
        self.spread: dict = {}     # (start, stop) -> largest - smallest over the runs, bytes at the real batch
        self.seconds = 0.0         # spent measuring (tracing each section, running it)
        self.ran_out = 0           # sections the device had no memory for (each waits out the allocator's retry)
        self.reused = 0            # sections whose figures came from the memo (an earlier engine's probe)

    def border(self, i: int):
        j = max(k for k in self._borders if k <= i)
        h = self._borders[j]
        with lean_scope(False), keras.StatelessScope(state_mapping=self._state):  # a forward: nothing to keep
            for k in range(j, i):
                h = self.network.blocks[k](h, self.small, training=True)
                if (k + 1) % self.stride == 0:
                    self._borders[k + 1] = h
        return h

    def release(self) -> None:
        """Drop the cached borders (tensors at the probe batch: on keras.applications ResNet50 at a probe batch of
        64, 138 MiB held through training); a later measurement re-computes them from the input."""
        self._borders = {0: self._borders[0]}

    def __call__(self, start: int, stop: int) -> int:
        span = (start, stop)
        if span not in self.measured:
            if span in self.memo.sections:
                self.reused += 1
            else:
                began = time.perf_counter()
                self._measure(start, stop)
                self.seconds += time.perf_counter() - began
            if span in self.memo.sections:  # not where the device had no memory for it
                used, spread = self.memo.sections[span]
                scale = self.real / self.pb
                self.measured[span], self.spread[span] = int(used * scale), int(spread * scale)
        return self.measured[span]

    def _measure(self, start: int, stop: int) -> None:
        blocks = self.network.blocks[start:stop]
        state = unique_state(blocks)
        variables = _unique([_first_component(v) for b in blocks for v in b.layer.trainable_variables])
        small, last = self.small, stop == len(self.network.blocks)

        def train(h, snapshot):
            with tf.GradientTape() as tape:
                xs = float_leaves(h) if start > 0 else []
                tape.watch(xs)
                with keras.StatelessScope(state_mapping=list(zip(state, snapshot))):
                    out = h
                    for block in blocks:
                        out = block(out, small, training=True)
            ys = float_leaves(out)
            return tape.gradient(ys, xs + variables, output_gradients=[tf.ones_like(y) for y in ys])

        fn = RelaxedFunction(train, batch_args=(0,))
        try:
            h = self.border(start)
            snapshot = [tf.identity(v.value) for v in state]
            fn(self.pb, h, snapshot)  # tracing and kernel set-up
            runs = self.RUNS_ONE_ORDER if one_op_order() else self.RUNS
            used = [_measure(self.meter, fn, self.pb, h, snapshot) for _ in range(runs)]
            # The gradient arriving at the output is the caller's (the planner counts it as held), except at the
            # end of the chain, where it stands for the loss's gradient on the logits.
            upstream = 0 if last else nbytes(self.border(stop))
        except tf.errors.ResourceExhaustedError as err:  # the device has no memory for it: no plan runs it
            h = snapshot = None
            release(err)
            self.measured[(start, stop)], self.spread[(start, stop)] = DOES_NOT_FIT, 0
            self.ran_out += 1
            return
        self.memo.sections[(start, stop)] = (max(max(used) - upstream, 0), max(used) - min(used))

    def largest_spread(self) -> int:
        """The largest difference between repeated runs of one section (the executor's op order), bytes."""
        return max(self.spread.values(), default=0)


def unique_state(blocks) -> list:
    return _unique([v for b in blocks for v in b.layer.non_trainable_variables])


def _unique(items) -> list:
    seen, out = set(), []
    for x in items:
        if id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def gradient_bytes(network) -> list[int]:
    """Bytes of the gradients each block's backward produces (a variable shared by blocks counts once, at its
    last block: the first gradient the backward makes)."""
    seen, out = set(), []
    for block in reversed(network.blocks):
        total = 0
        for v in block.layer.trainable_variables:
            if id(v) not in seen:
                seen.add(id(v))
                total += nbytes(v)
        out.append(total)
    return out[::-1]


def _first_component(variable):
    """Under a strategy (the probe runs in cross-replica context, reading the first replica's copies), the
    first replica's copy of a mirrored variable: the one a gradient reaches."""
    value = getattr(variable, "value", variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return tf.distribute.get_strategy().experimental_local_results(value)[0]
    return variable


SPEC_BATCH = 64  # examples the shape and spec probes trace with (nothing they read depends on the batch size)


def probe_slice(network, batch, probe_batch: int = SPEC_BATCH) -> tuple[dict, int]:
    """The first ``probe_batch`` examples of a batch, and the real batch size."""
    real = int(tf.nest.flatten(batch[network.inputs])[0].shape[0])
    pb = max(1, min(probe_batch, real))
    return tf.nest.map_structure(lambda t: t[:pb], dict(batch)), real


def output_specs(network, small, real: int) -> tuple[list, object]:
    """Each block's output TensorSpecs at the real batch, from one eager forward of the probe slice
    (state untouched); and the network input's."""
    mapping = [(v, tf.identity(v.value)) for v in network.non_trainable_variables]
    h, specs = small[network.inputs], []
    with keras.StatelessScope(state_mapping=mapping):
        for block in network.blocks:
            h = block(h, small, training=True)
            specs.append(specs_at(h, real))
    return specs, specs_at(small[network.inputs], real)


def _measure(meter: MemoryMeter, fn, *args) -> int:
    meter.reset()
    base = meter.current()
    result = fn(*args)
    used = meter.peak() - base
    del result
    return used


def profile_blocks(network, small, real: int, meter: MemoryMeter) -> list[BlockProfile]:
    """Run each block compiled, forward and backward, on the probe slice ``small``, state untouched;
    figures are scaled to the ``real`` batch size."""
    pb = int(tf.nest.flatten(small[network.inputs])[0].shape[0])
    scale = real / pb
    profiles = []
    h = small[network.inputs]
    for block in network.blocks:
        snapshot = [tf.identity(v.value) for v in block.layer.non_trainable_variables]
        forward, train = _block_functions(block, small)
        out = forward(pb, h, snapshot)
        t0 = time.perf_counter()
        out = forward(pb, h, snapshot)
        tf.nest.map_structure(lambda t: t.numpy(), out)
        seconds = (time.perf_counter() - t0) * scale
        meter.reset()
        base = meter.current()
        with tf.GradientTape() as tape:
            tape.watch(float_leaves(h))
            kept_by_tape = forward(pb, h, snapshot)
        stored = meter.current() - base
        del tape, kept_by_tape
        train(pb, h, snapshot)  # the first call pays for tracing and kernel setup
        # The executor's op order (so the peak) varies call to call: plan for the larger of two.
        used = max(_measure(meter, train, pb, h, snapshot) for _ in range(2))
        in_bytes, out_bytes = nbytes(h), nbytes(out)
        measured = meter.available and used > 0
        # Besides its kept activations, a backward holds the upstream gradient, the input gradient and
        # about one more temporary of the output's size.
        transient = 2 * out_bytes + in_bytes
        kept = max(used - transient, out_bytes) if measured else 2 * out_bytes
        profiles.append(BlockProfile(
            name=block.name,
            output_bytes=nbytes(specs_at(out, real)),
            kept_bytes=int(kept * scale),
            transient_bytes=int(transient * scale),
            forward_seconds=seconds,
            stored_bytes=int(max(stored, out_bytes) * scale) if measured else 4 * out_bytes * int(scale),
        ))
        h = out
    return profiles
