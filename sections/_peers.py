"""What users would use instead of sections, compiled the same way: a whole-graph step and tf.recompute_grad."""

from __future__ import annotations

import tensorflow as tf

from ._relaxed import RelaxedFunction


class PeerStep:
    """One compiled training step over the whole network.

    ``whole``: an ordinary ``GradientTape`` step. ``recompute_grad``: every section but the last wrapped in
    ``tf.recompute_grad`` (TensorFlow's gradient checkpointing) inside the same step. Each section's
    counter is incremented inside its forward code, so re-runs by ``tf.recompute_grad`` are counted.
    """

    def __init__(self, network, optimizer, sections, counters, strategy: str, jit_compile: bool):
        self.network = network
        self.optimizer = optimizer
        self.sections = sections
        self.counters = counters
        self.strategy = strategy
        self.variables = network.trainable_variables
        self._step = RelaxedFunction(self._train, jit_compile, batch_args=(0,))
        self._grads = RelaxedFunction(self._gradients, jit_compile, batch_args=(0,))

    def __call__(self, batch):
        """One training step; returns the loss."""
        return self._step(_size(self.network, batch), batch)

    def gradients(self, batch):
        """Loss and gradients (aligned with ``network.trainable_variables``) without applying them."""
        return self._grads(_size(self.network, batch), batch)

    def trace_count(self) -> int:
        return self._step.tracing_count()

    def _section_fn(self, sec, batch, structure):
        def run(*flat):
            self.counters[sec.index].assign_add(1)
            h = tf.nest.pack_sequence_as(structure, list(flat))
            return tf.nest.flatten(self.network.run_blocks(h, batch, True, sec.start, sec.stop))
        return run

    def _train(self, batch):
        loss, grads = self._gradients(batch)
        self.optimizer.apply_gradients([(g, v) for g, v in zip(grads, self.variables) if g is not None])
        return loss

    def _gradients(self, batch):
        with tf.GradientTape() as tape:
            h = batch[self.network.inputs]
            last = len(self.sections) - 1
            for sec in self.sections:
                if self.strategy == "recompute_grad" and sec.index < last:
                    structure = h
                    flat = tf.recompute_grad(self._section_fn(sec, batch, structure))(*tf.nest.flatten(h))
                    h = tf.nest.pack_sequence_as(self.sections[sec.index + 1].input_specs, flat)
                else:
                    self.counters[sec.index].assign_add(1)
                    h = self.network.run_blocks(h, batch, True, sec.start, sec.stop)
            loss = self.network.loss(h, batch)
        return loss, tape.gradient(loss, self.variables)


def _size(network, batch) -> int:
    return int(tf.nest.flatten(batch[network.inputs])[0].shape[0])
