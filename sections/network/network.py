"""A network as a chain of named blocks: the unit the engine cuts into sections."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import keras
import tensorflow as tf

from .. import rules

LossFn = Callable[[Any, Mapping[str, tf.Tensor]], tf.Tensor]


@dataclass(frozen=True)
class Block:
    """One named step of a network.

    Args:
        name: unique name; a ``group/`` prefix (``scale1/block_0``) lets a boundary name a whole group.
        layer: a Keras layer called as ``layer(h, training=...)``, or ``layer((h, *fields), training=...)``.
        fields: batch keys handed to the layer beside the running tensor ``h``.
    """

    name: str
    layer: Any
    fields: tuple[str, ...] = ()

    @property
    def group(self) -> str:
        return self.name.split("/", 1)[0]

    def __call__(self, h, batch: Mapping[str, tf.Tensor], training: bool):
        if self.fields:
            return self.layer((h, *(batch[f] for f in self.fields)), training=training)
        return self.layer(h, training=training)


class Network:
    """A chain of named blocks, a loss computed on the last block's output, and optional metrics.

    Args:
        blocks: ``(name, layer)`` or ``(name, layer, fields)`` items, or ``Block``s, in order.
        loss: ``loss(outputs, batch) -> scalar``; computed inside the last section.
        inputs: the batch key fed to the first block.
        metrics: ``{name: fn(outputs, batch) -> scalar}`` reported by evaluation.
        loss_fields: the batch keys the loss and metrics read. Each section's compiled functions then see
            only the fields their blocks (and, for the last section, the loss) read, so a field's shape
            retraces only the sections that use it. ``None``: the last section sees the whole batch.
        boundaries: ``{name: block index}``, the names a ``sections`` list may use and the block each
            starts a section at. ``None``: block names and group prefixes (``scale1`` for ``scale1/...``).

    Example:
        >>> net = Network([("stem", keras.layers.Dense(8)), ("head", keras.layers.Dense(2))],
        ...               loss=lambda out, batch: tf.reduce_mean(tf.square(out)), inputs="x")
    """

    def __init__(
        self,
        blocks: Sequence[Block | tuple],
        loss: LossFn,
        inputs: str = "image",
        metrics: Mapping[str, LossFn] | None = None,
        loss_fields: Sequence[str] | None = None,
        boundaries: Mapping[str, int] | None = None,
    ):
        self.blocks = [b if isinstance(b, Block) else _to_block(b) for b in blocks]
        if not self.blocks:
            raise ValueError("Network needs at least one block; got an empty list.")
        names = [b.name for b in self.blocks]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"Block names must be unique; repeated: {dupes}.")
        if not callable(loss):
            raise ValueError(f"loss must be callable as loss(outputs, batch); got {loss!r}.")
        self.loss = loss
        self.inputs = inputs
        self.metrics = dict(metrics or {})
        self.loss_fields = None if loss_fields is None else tuple(loss_fields)
        self.boundaries = dict(boundaries) if boundaries is not None else rules.default_boundaries(names)
        bad = {k: v for k, v in self.boundaries.items() if not isinstance(v, int) or not 0 <= v < len(names)}
        if bad:
            raise ValueError(f"boundaries must map names to block indices 0..{len(names) - 1}; got {bad}.")

    def boundary_starts(self, names: Sequence[str]) -> list[int]:
        """Block indices where sections 1.. start, for a list of boundary names (ValueError naming the
        valid ones otherwise)."""
        return rules.resolve_boundaries(self.boundaries, names)

    @property
    def block_names(self) -> list[str]:
        return [b.name for b in self.blocks]

    @property
    def required_keys(self) -> list[str]:
        """Batch keys the network reads through its blocks (the loss may read more)."""
        keys = [self.inputs]
        for b in self.blocks:
            keys += [f for f in b.fields if f not in keys]
        return keys + [f for f in self.loss_fields or () if f not in keys]

    def fields_for(self, start: int, stop: int | None, batch_keys) -> list[str]:
        """The batch keys blocks ``start..stop-1`` read; the last blocks also get the loss's."""
        keys = list(dict.fromkeys(f for b in self.blocks[start:stop] for f in b.fields))
        if stop is None or stop >= len(self.blocks):
            extra = batch_keys if self.loss_fields is None else self.loss_fields
            keys += [k for k in extra if k not in keys]
        return keys

    @property
    def layers(self) -> list:
        return [b.layer for b in self.blocks]

    @property
    def trainable_variables(self) -> list:
        return unique_variables(v for layer in self.layers for v in layer.trainable_variables)

    @property
    def non_trainable_variables(self) -> list:
        return unique_variables(v for layer in self.layers for v in layer.non_trainable_variables)

    @property
    def variables(self) -> list:
        return self.trainable_variables + self.non_trainable_variables

    def check_batch(self, batch: Mapping[str, Any]) -> None:
        """Raise a ValueError naming any batch key a block asks for that is missing."""
        if not isinstance(batch, Mapping):
            raise ValueError(f"A batch must be a dict of tensors; got {type(batch).__name__}.")
        missing = [k for k in self.required_keys if k not in batch]
        if missing:
            raise ValueError(
                f"Batch is missing key(s) {missing} needed by the network; batch has {sorted(batch)}."
            )

    def run_blocks(self, h, batch, training: bool, start: int = 0, stop: int | None = None):
        """Run blocks ``start..stop-1`` on ``h``."""
        for block in self.blocks[start:stop]:
            h = block(h, batch, training)
        return h

    def forward(self, batch, training: bool):
        """The whole chain on a batch: the last block's output."""
        return self.run_blocks(batch[self.inputs], batch, training)

    def build(self, batch) -> None:
        """Create every layer's variables by tracing one training call. Nothing runs: no random draws, no
        state updates, so a step after it computes what a plain loop building its layers lazily would."""
        self.check_batch(batch)
        specs = tf.nest.map_structure(lambda t: tf.TensorSpec([None, *t.shape[1:]], t.dtype), dict(batch))
        # In a stateless scope Keras defers creating variables to the scope's exit, where they are made
        # eagerly (so a strategy's scope mirrors them), and the trace's state writes are dropped.
        try:
            with keras.StatelessScope():
                tf.function(lambda b: self.forward(b, training=True)).get_concrete_function(specs)
        except tf.errors.ResourceExhaustedError as err:  # left half made: a second build says "already initialized"
            from ..backend.device import VariablesDoNotFit
            from ..backend.structure import nbytes

            failed = re.search(r"OOM when allocating tensor with (shape\[[^\]]*\]) and type (\w+)", str(err))
            failed = f"{failed.group(2)} {failed.group(1)}" if failed else str(err).splitlines()[0][:120]
            raise VariablesDoNotFit(
                f"the model's variables could not be made on the device: it ran out of memory initializing them "
                f"({rules.human_bytes(nbytes(self.variables))} of variables declared; the failing allocation "
                f"{failed}); a device with more memory, or a smaller model, is needed.", what="model") from None

    @classmethod
    def from_keras(cls, model, loss, inputs: str = "image", fields=None, metrics=None, loss_fields=None,
                   max_blocks: int = 64, keep=(), names_hint: str | None = None) -> "Network":
        """A network cut from a built Keras Functional or Sequential model at its layer names: ``sections.from_keras``
        (``sections.network.keras_network``, where its arguments are told), a ``KerasNetwork``."""
        from .keras_network import from_keras  # it builds on this module: imported when called

        return from_keras(model, loss, inputs=inputs, fields=fields, metrics=metrics, loss_fields=loss_fields,
                          max_blocks=max_blocks, keep=keep, names_hint=names_hint)


def _to_block(item) -> Block:
    if not isinstance(item, (tuple, list)) or len(item) not in (2, 3):
        raise ValueError(f"A block is (name, layer) or (name, layer, fields); got {item!r}.")
    name, layer, *rest = item
    fields = tuple(rest[0]) if rest else ()
    if isinstance(rest[0] if rest else (), str):
        fields = (rest[0],)
    if not isinstance(name, str) or not name:
        raise ValueError(f"A block name must be a non-empty string; got {name!r}.")
    if not callable(layer):
        raise ValueError(f"Block {name!r}: layer must be a callable Keras layer; got {layer!r}.")
    return Block(name, layer, fields)


def unique_variables(variables) -> list:
    """Variables in first-seen order, each once (a layer may appear in several blocks)."""
    seen, out = set(), []
    for v in variables:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out
