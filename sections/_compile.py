"""The compiled pieces of a sectioned step: forward, re-run backward, and the fused last section."""

from __future__ import annotations

import keras
import tensorflow as tf

from ._relaxed import RelaxedFunction
from ._structure import float_leaves


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
    """Builds the ``tf.function``s of one section.

    ``counter`` is a ``tf.Variable`` incremented inside each compiled forward execution, so forward
    runs are counted by the code that ran, not assumed.
    """

    def __init__(self, network, section, counter: tf.Variable, jit_compile: bool, check: bool):
        self.network = network
        self.section = section
        self.counter = counter
        self.check = check
        self.needs_input_grad = section.index > 0
        batch_args = {"forward": (0, 1), "forward_stored": (0, 1), "backward": (0, 1, 2, 4), "fused": (0, 1)}
        self._compiled = {name: RelaxedFunction(getattr(self, "_" + name), jit_compile, args)
                          for name, args in batch_args.items()}

    def _call(self, name, h, *args):
        return self._compiled[name](int(tf.nest.flatten(h)[0].shape[0]), h, *args)

    def forward(self, h, batch):
        return self._call("forward", h, batch)

    def forward_stored(self, h, batch):
        return self._call("forward_stored", h, batch)

    def backward(self, h, batch, upstream, snapshot, expected):
        return self._call("backward", h, batch, upstream, snapshot, expected)

    def fused(self, h, batch):
        return self._call("fused", h, batch)

    def _run(self, h, batch):
        self.counter.assign_add(1)
        sec = self.section
        return self.network.run_blocks(h, batch, True, sec.start, sec.stop)

    def _sources(self, h):
        return float_leaves(h) if self.needs_input_grad else []

    def _forward(self, h, batch):
        """Forward without a tape; returns the output and the section's state before it ran."""
        snapshot = [tf.identity(v.value) for v in self.section.state_variables]
        with tf.control_dependencies(snapshot):
            out = self._run(h, batch)
        return out, snapshot

    def _forward_stored(self, h, batch):
        """Forward meant to run under a caller's tape, which keeps what the backward needs."""
        return self._run(h, batch)

    def _backward(self, h, batch, upstream, snapshot, expected):
        """Re-run the forward from the cached input and state, then a vector-Jacobian product."""
        mapping = list(zip(self.section.state_variables, snapshot))
        with tf.GradientTape() as tape:
            xs = self._sources(h)
            tape.watch(xs)
            # State reads come from the snapshot and state writes are dropped: batch-norm statistics
            # update once per step, and seed generators replay the forward pass's random draws.
            with keras.StatelessScope(state_mapping=mapping):
                out = self._run(h, batch)
        ys = float_leaves(out)
        grads = tape.gradient(ys, xs + self.section.variables,
                              output_gradients=_zeros_for_missing(ys, upstream))
        diff = max_relative_diff(out, expected) if expected is not None else tf.constant(0.0)
        return grads[: len(xs)], grads[len(xs):], diff

    def _fused(self, h, batch):
        """The last section: forward, loss and backward in one run."""
        with tf.GradientTape() as tape:
            xs = self._sources(h)
            tape.watch(xs)
            out = self._run(h, batch)
            loss = self.network.loss(out, batch)
        grads = tape.gradient(loss, xs + self.section.variables)
        return loss, grads[: len(xs)], grads[len(xs):]

    def stored_backward(self, tape, h, out, upstream):
        """Backward of a stored section from the tape kept during its forward (no re-run)."""
        xs = self._sources(h)
        ys = float_leaves(out)
        grads = tape.gradient(ys, xs + self.section.variables,
                              output_gradients=_zeros_for_missing(ys, upstream))
        return grads[: len(xs)], grads[len(xs):]

    def trace_counts(self) -> dict[str, int]:
        return {f"{self.section.name}/{k}": f.tracing_count() for k, f in self._compiled.items()}
