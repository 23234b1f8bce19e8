"""What users would use instead of sections, at the same partition and compiled the same way:
one whole-graph step, and ``tf.recompute_grad`` around each section."""

from __future__ import annotations

import logging

import tensorflow as tf

from ..backend.relaxed import RelaxedFunction
from ..backend.replicas import local_size
from .base import Trainer
from .section_functions import compile_partition

log = logging.getLogger("sections")


class WholeGraph(Trainer):
    """One ordinary compiled ``GradientTape`` step over the whole network (the partition only labels the
    table). Each section's counter is incremented inside its forward code, like the engine's."""

    strategy = "whole"

    def __init__(self, network, optimizer, sections=1, policy=None, jit_compile: bool = False, check: bool = False,
                 memory_budget=None, probe_batch: int | None = None, device: str | None = None, distribute=None,
                 lean: bool = False, apply: str = "at_end"):
        # policy, check, memory_budget, lean and apply belong to the sectioned engine; accepted so configs can switch
        # classes (a baseline runs every layer's own Keras gradient).
        super().__init__(network, optimizer, sections, jit_compile=jit_compile, probe_batch=probe_batch,
                         device=device, distribute=distribute)

    def _settle(self, batch):
        starts = self._starts()
        self.compiled = compile_partition(self.network, self.borders, self.replicas, starts,
                                          [self.strategy] * (len(starts) + 1))

    def _prepare(self) -> None:
        self._train_fn = RelaxedFunction(self.replicas.wrap(self._train), self.jit_compile, batch_args=(0,))
        self._grads_fn = RelaxedFunction(self.replicas.wrap(self._tape_gradients), self.jit_compile, batch_args=(0,))

    def _step(self, batch) -> dict:
        self.meter.reset()
        loss = self._train_fn(local_size(batch, self.replicas), batch)
        return self._stats(loss, self.meter.peaks())

    def _gradients(self, batch):
        return self._grads_fn(local_size(batch, self.replicas), batch)

    def _train(self, batch):
        loss, grads = self._tape_gradients(batch)
        variables = self.network.trainable_variables
        self.optimizer.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return loss

    def _run_section(self, sec, h, batch):
        self.compiled.counters[sec.index].assign_add(1)
        return self.network.run_blocks(h, batch, True, sec.start, sec.stop)

    def _tape_gradients(self, batch):
        with tf.GradientTape() as tape:
            h = batch[self.network.inputs]
            for sec in self.sections:
                h = self._section_output(sec, h, batch)
            loss = self.network.loss(h, batch)
            scaled = self._scale_loss(loss)
        return loss, tape.gradient(scaled, self.network.trainable_variables)

    def _section_output(self, sec, h, batch):
        return self._run_section(sec, h, batch)

    def _trace_counts(self) -> dict[str, int]:
        return {"step": self._train_fn.tracing_count()}


class RecomputeGrad(WholeGraph):
    """Every section but the last wrapped in ``tf.recompute_grad`` (TensorFlow's gradient checkpointing)
    inside one compiled step. Re-runs update batch-norm statistics again: not exact, as users get it."""

    strategy = "recompute_grad"

    def _settle(self, batch):
        super()._settle(batch)
        if len(self.sections) == 1:  # said, not silently the whole step under another name
            log.warning("recompute_grad with one section checkpoints nothing (every section but the last is "
                        "wrapped): give sections=2 or more")

    def _section_output(self, sec, h, batch):
        if sec.index == len(self.sections) - 1:
            return self._run_section(sec, h, batch)
        structure = h

        def run(*flat):
            inner = tf.nest.pack_sequence_as(structure, list(flat))
            return tf.nest.flatten(self._run_section(sec, inner, batch))

        flat = tf.recompute_grad(run)(*tf.nest.flatten(h))
        return tf.nest.pack_sequence_as(self.sections[sec.index + 1].input_specs, flat)

