"""The engine: a cached forward pass, then a section-wise backward pass from the last section to the first."""

from __future__ import annotations

from typing import Mapping, Sequence

import tensorflow as tf

from . import _partition as part
from ._compile import SectionFunctions
from ._memory import MemoryMeter
from ._network import Network, unique_variables
from ._peers import PeerStep
from ._relaxed import RelaxedFunction
from ._profile import output_specs, probe_slice, profile_blocks, section_activation_bytes
from ._structure import nbytes

STRATEGIES = ("sectioned", "whole", "recompute_grad")


class ReplayMismatchError(RuntimeError):
    """A section's re-run forward differed from its first run (randomness the engine cannot replay)."""


class Engine:
    """Trains a ``Network`` section by section, exactly like one whole-graph step.

    Args:
        network: the chain of blocks and its loss.
        optimizer: a Keras 3 optimizer; applied once per step over all sections' gradients.
        sections: an int (that many contiguous sections balanced by measured activation memory),
            a list of boundary names (block names or group prefixes where sections start), or
            ``"auto"`` with ``memory_budget`` (the planner picks boundaries and policies).
        policy: ``"recompute"`` or ``"store"``, or one of them per section.
        strategy: ``"sectioned"`` (this engine), ``"whole"`` (one compiled whole-graph step) or
            ``"recompute_grad"`` (``tf.recompute_grad`` around each section in one compiled step).
        jit_compile: compile the step functions with XLA.
        check: compare each re-run's output with its cached border and raise on a mismatch.
        memory_budget: bytes (or a string like ``"2GiB"``) for ``sections="auto"``.
        probe_batch: examples used by the per-block memory probe.
        device: where memory is measured (default ``GPU:0`` when there is a GPU, else ``CPU:0``).

    Example:
        >>> engine = Engine(net, keras.optimizers.Adam(1e-3), sections=4)
        >>> stats = engine.train_step(batch)
        >>> stats["loss"], stats["forward_runs"], stats["peak_bytes"]
    """

    def __init__(
        self,
        network: Network,
        optimizer,
        sections: int | Sequence[str] | str = 1,
        policy: str | Sequence[str] = "recompute",
        strategy: str = "sectioned",
        jit_compile: bool = False,
        check: bool = False,
        memory_budget: int | str | None = None,
        probe_batch: int = 64,
        device: str | None = None,
    ):
        if not isinstance(network, Network):
            raise ValueError(f"network must be a sections.Network; got {type(network).__name__}.")
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown strategy {strategy!r}; allowed: {list(STRATEGIES)}.")
        self.network = network
        self.optimizer = optimizer
        self.strategy = strategy
        self.jit_compile = bool(jit_compile)
        self.check = bool(check)
        self.probe_batch = int(probe_batch)
        self.meter = MemoryMeter(device)
        names = network.block_names
        if isinstance(sections, tuple):
            sections = list(sections)
        self._sections_arg = sections
        self._policy_arg = policy
        self.memory_budget = None
        if sections == "auto":
            from ._planner import parse_bytes

            if memory_budget is None:
                raise ValueError("sections='auto' needs memory_budget (bytes or a string like '2GiB').")
            self.memory_budget = parse_bytes(memory_budget)
        elif isinstance(sections, str):
            raise ValueError(
                f"sections={sections!r}: must be an int >= 1, a list of boundary names, or 'auto'."
            )
        else:
            part.validate_sections_arg(sections, len(names), names)
        self._starts = None
        if isinstance(sections, list):
            self._starts = part.resolve_boundaries(names, sections)
        if sections != "auto":
            count = sections if isinstance(sections, int) else len(sections) + 1
            self._policies = part.policies_for(policy, count)
        self.sections: list[part.Section] = []
        self.profiles = None
        self.plan = None
        self._built = False

    # ------------------------------------------------------------------ build
    def build(self, batch: Mapping[str, tf.Tensor]) -> None:
        """Create variables, settle the partition and build the optimizer; no state is updated."""
        if self._built:
            return
        self.network.check_batch(batch)
        self.network.build(batch)
        self._probe = probe_slice(self.network, batch, self.probe_batch)
        self._output_specs, self._input_specs = output_specs(self.network, *self._probe)
        if self._sections_arg == "auto" or isinstance(self._sections_arg, int) and self._sections_arg > 1:
            self._profile()
        starts, policies = self._choose_partition(batch)
        self._make_sections(starts, policies)
        self._trainable = self.network.trainable_variables
        self._var_index = {id(v): i for i, v in enumerate(self._trainable)}
        if not getattr(self.optimizer, "built", False):
            self.optimizer.build(self._trainable)
        self._counters = [tf.Variable(0, dtype=tf.int64, trainable=False) for _ in self.sections]
        self._fns = [SectionFunctions(self.network, s, c, self.jit_compile, self.check)
                     for s, c in zip(self.sections, self._counters)]
        self._fields = [self.network.fields_for(s.start, s.stop, list(batch)) for s in self.sections]
        # Sparse (embedding) gradients change length with the batch's shapes: their length is left unknown.
        self._apply = RelaxedFunction(self._apply_gradients, self.jit_compile, batch_args=())
        self._peer = PeerStep(self.network, self.optimizer, self.sections, self._counters,
                              self.strategy, self.jit_compile) if self.strategy != "sectioned" else None
        self._evaluate = tf.function(self._evaluate_fn)
        self._built = True

    def _profile(self) -> list:
        """Measure every block (compiled, on the probe slice); done once, when a choice needs it."""
        if self.profiles is None:
            self.profiles = profile_blocks(self.network, *self._probe, self.meter)
            for s in self.sections:
                s.activation_bytes = section_activation_bytes(self.profiles[s.start:s.stop], s.policy)
        return self.profiles

    def _choose_partition(self, batch):
        if self._sections_arg == "auto":
            from ._planner import plan_partition

            self.plan = plan_partition(self.profiles, self._input_bytes(), self.memory_budget,
                                       base_bytes=self._base_bytes(batch))
            return self.plan.starts, self.plan.policies
        if self._starts is not None:
            return self._starts, self._policies
        costs = [p.kept_bytes for p in self.profiles] if self.profiles else [1] * len(self.network.blocks)
        return part.balanced_starts(costs, self._sections_arg), self._policies

    def _base_bytes(self, batch) -> int:
        """Memory alive through a whole step: variables, optimizer slots (built next) and the batch."""
        variables = sum(nbytes(v) for v in self.network.variables)
        slots = 2 * sum(nbytes(v) for v in self.network.trainable_variables)
        return variables + slots + nbytes(batch)

    def _input_bytes(self) -> int:
        return nbytes(self._input_specs)

    def _make_sections(self, starts, policies) -> None:
        blocks = self.network.blocks
        bounds = [0, *starts, len(blocks)]
        for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            layers = [b.layer for b in blocks[lo:hi]]
            trainable = unique_variables(v for layer in layers for v in layer.trainable_variables)
            state = unique_variables(v for layer in layers for v in layer.non_trainable_variables)
            in_specs = self._input_specs if lo == 0 else self._output_specs[lo - 1]
            self.sections.append(part.Section(
                index=k, start=lo, stop=hi, block_names=[b.name for b in blocks[lo:hi]],
                policy=policies[k], variables=trainable, state_variables=state,
                input_bytes=nbytes(in_specs), input_specs=in_specs,
                activation_bytes=section_activation_bytes(self.profiles[lo:hi], policies[k]) if self.profiles else 0,
            ))

    # ------------------------------------------------------------------ the step
    def train_step(self, batch: Mapping[str, tf.Tensor]) -> dict:
        """One training step; returns loss, forward runs and peak bytes per section."""
        self.build(batch)
        self.network.check_batch(batch)
        batch = dict(batch)
        if self._peer is not None:
            return self._peer_step(batch)
        loss, grads, peaks, step_peak = self._sectioned_gradients(batch)
        self.meter.reset()
        self._apply(0, *self._present(grads))
        return {
            "loss": float(loss),
            "forward_runs": self._read_counters(),
            "peak_bytes": peaks,
            "step_peak_bytes": max(step_peak, self.meter.peak()),
        }

    def gradients(self, batch: Mapping[str, tf.Tensor]) -> tuple[tf.Tensor, list]:
        """Loss and gradients (aligned with ``network.trainable_variables``; None where a variable gets none),
        computed as a step would, state updates included, but not applied."""
        self.build(batch)
        self.network.check_batch(batch)
        batch = dict(batch)
        if self._peer is not None:
            loss, grads = self._peer.gradients(batch)
        else:
            loss, grads, _, _ = self._sectioned_gradients(batch)
        self._read_counters()
        return loss, list(grads)

    def _sectioned_gradients(self, batch):
        """The section cycle: the cached forward pass, then the backward from the last section to the first."""
        last = len(self.sections) - 1
        fns, meter = self._fns, self.meter
        views = [{key: batch[key] for key in fields} for fields in self._fields]

        # Forward: run sections 0..K-2 once, keeping only their border outputs (and stored tapes).
        meter.reset()
        borders = [batch[self.network.inputs]]
        snapshots, tapes, stored_outputs = [None] * last, [None] * last, [None] * last
        out = None
        for k in range(last):
            if self.sections[k].policy == "store":
                tapes[k] = tf.GradientTape()
                with tapes[k]:
                    tapes[k].watch(fns[k]._sources(borders[k]))
                    out = stored_outputs[k] = fns[k].forward_stored(borders[k], views[k])
            else:
                out, snapshots[k] = fns[k].forward(borders[k], views[k])
            borders.append(out)
        del out  # the borders list is the only owner, so a border dies right after its section's backward
        peaks = [0] * len(self.sections)
        step_peak = meter.peak()

        # Backward: from the last section to the first, each handing the gradient on its input back.
        grads: list = [None] * len(self._trainable)
        upstream = None
        for k in range(last, -1, -1):
            meter.reset()
            if k == last:
                loss, upstream, var_grads = fns[k].fused(borders[k], views[k])
            elif tapes[k] is not None:
                upstream, var_grads = fns[k].stored_backward(tapes[k], borders[k], stored_outputs[k], upstream)
                tapes[k] = stored_outputs[k] = None
            else:
                expected = borders[k + 1] if self.check else None
                upstream, var_grads, diff = fns[k].backward(borders[k], views[k], upstream, snapshots[k], expected)
                if self.check:
                    self._raise_on_mismatch(k, float(diff))
                snapshots[k] = None
            # Section k's input is spent once its own backward is done (check mode keeps it one section
            # longer, to compare against the re-run of section k-1).
            if not self.check:
                borders[k] = None
            elif k < last:
                borders[k + 1] = None
            self._accumulate(grads, self.sections[k].variables, var_grads)
            peaks[k] = meter.peak()
        borders.clear()
        return loss, grads, peaks, max(step_peak, *peaks)

    def _peer_step(self, batch) -> dict:
        self.meter.reset()
        loss = self._peer(batch)
        peak = self.meter.peak()
        return {
            "loss": float(loss),
            "forward_runs": self._read_counters(),
            "peak_bytes": [None] * len(self.sections),
            "step_peak_bytes": peak,
        }

    def _raise_on_mismatch(self, k: int, diff: float, tol: float = 1e-4) -> None:
        if diff > tol:
            sec = self.sections[k]
            raise ReplayMismatchError(
                f"{sec.name} ({sec.block_names[0]}..{sec.block_names[-1]}): the re-run forward differs from "
                f"the first run (max relative difference {diff:.3g} > {tol}). Randomness inside it is not "
                f"replayable; draw it through a keras.random.SeedGenerator, or use policy='store' for it."
            )

    def _accumulate(self, grads: list, variables: list, var_grads) -> None:
        for v, g in zip(variables, var_grads):
            if g is None:
                continue
            i = self._var_index[id(v)]
            grads[i] = g if grads[i] is None else _add_gradients(grads[i], g)

    def _present(self, grads: list):
        idx = tuple(i for i, g in enumerate(grads) if g is not None)
        return [grads[i] for i in idx], idx

    def _apply_gradients(self, grads, idx):
        self.optimizer.apply_gradients(zip(grads, [self._trainable[i] for i in idx]))

    def _read_counters(self) -> list[int]:
        runs = [int(c.numpy()) for c in self._counters]
        for c in self._counters:
            c.assign(0)
        return runs

    # ------------------------------------------------------------------ evaluation and reporting
    def _evaluate_fn(self, batch):
        out = self.network.forward(batch, training=False)
        values = {"loss": self.network.loss(out, batch)}
        for name, fn in self.network.metrics.items():
            values[name] = fn(out, batch)
        return values

    def evaluate(self, batch: Mapping[str, tf.Tensor]) -> dict:
        """Loss and metrics in inference mode (no state changes)."""
        self.build(batch)
        self.network.check_batch(batch)
        return {k: float(v) for k, v in self._evaluate(dict(batch)).items()}

    def partition_rows(self) -> list[dict]:
        """The partition as table rows."""
        self._require_built()
        self._profile()
        rows = []
        for s in self.sections:
            last = s.index == len(self.sections) - 1
            policy = "fused (last)" if last and self.strategy == "sectioned" else s.policy
            rows.append({
                "section": s.index,
                "blocks": _span(s.block_names),
                "n_blocks": len(s.block_names),
                "params": s.num_parameters,
                "input_border": _fmt_specs(s.input_specs),
                "border_bytes": part.human_bytes(s.input_bytes),
                "est_activation": part.human_bytes(s.activation_bytes),
                "policy": policy if self.strategy == "sectioned" else f"{self.strategy}",
            })
        return rows

    def describe(self) -> str:
        """The partition as a plain-text table."""
        table = part.format_table(self.partition_rows())
        if self.plan is not None:
            table += "\n" + self.plan.summary()
        return table

    def trace_counts(self) -> dict[str, int]:
        """Traced graphs per compiled function (stays constant over steps of a fixed batch shape)."""
        self._require_built()
        counts = {}
        for f in self._fns:
            counts.update(f.trace_counts())
        counts["apply"] = self._apply.tracing_count()
        if self._peer is not None:
            counts["peer_step"] = self._peer.trace_count()
        return counts

    def _require_built(self) -> None:
        if not self._built:
            raise RuntimeError("The engine is not built yet: call engine.build(batch) or train_step(batch) first.")


def _add_gradients(a, b):
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0),
                                a.dense_shape)
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def _fmt_specs(specs) -> str:
    leaves = tf.nest.flatten(specs)
    text = ", ".join("x".join(str(d) for d in t.shape.as_list()) for t in leaves)
    return text if len(leaves) == 1 else f"({text})"
