"""The data source contract, declared: what the runner reads of any source (``DataSource``), and defaults for the
members a simple source has nothing to say about (``BaseSource``).

Every bundled source satisfies ``DataSource`` (``tests/test_protocols.py`` checks each, with its signatures); the
runner reads a source only through these members, and refuses one that lacks any, naming them.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping, Protocol, runtime_checkable


@runtime_checkable
class DataSource(Protocol):
    """What a data builder returns (docs/DATA.md, "The contract: write your own source").

    - ``name``: the data set's name; ``model_args``: keyword arguments for the model builder (``num_classes``,
      ``input_shape``; ``vocab_size`` ...).
    - ``metric``: the metric the network reports that the runner optimizes (None: ``eval_loss``);
      ``metric_direction``: ``"maximize"`` or ``"minimize"``, a class attribute (sweeps read it before any job runs,
      through the builder's return annotation).
    - ``info``: JSON-able facts for ``data.json`` and ``metrics.json["data"]`` (may be empty).
    - ``train_size``: training examples (None: unknown without reading everything); ``batch=max`` stops there.
    - ``train_batches(batch_size, seed, shard)``: endless dict batches of exactly ``batch_size``, the same seed the
      same batches, an iterator a ``tf.train.Checkpoint`` can save; ``shard=(index, count)`` under multi-worker:
      this worker trains rows ``index*B/count .. (index+1)*B/count`` of each batch (a source may load only those
      and leave zeros elsewhere, or load every row).
    - ``eval_batches(batch_size)``: one finite pass over the held-out split, in a fixed order.
    - ``fingerprint()``: what the data is, for a resume to compare (``models.data._fingerprint``); None: unknown.
    - ``describe()``: the run header's ``data:`` line (None: no line).
    - ``find_unreadable()``: after an input failure that names no file, which file or record it is (None: unknown).
    """

    name: str
    model_args: dict
    metric: str | None
    metric_direction: str
    info: Mapping[str, Any]
    train_size: int | None

    def train_batches(self, batch_size: int, seed: int = 0, shard: tuple[int, int] | None = None): ...

    def eval_batches(self, batch_size: int): ...

    def fingerprint(self) -> dict | None: ...

    def describe(self) -> str | None: ...

    def find_unreadable(self) -> str | None: ...


#: The members ``DataSource`` declares, in its order (for the runner's one-line refusal of a source lacking some).
MEMBERS = ("name", "model_args", "metric", "metric_direction", "info", "train_size", "train_batches", "eval_batches",
           "fingerprint", "describe", "find_unreadable")


class BaseSource:
    """Defaults for what a source may have nothing to say about: no metric of its own (``eval_loss``, minimized), no
    info, an unknown size, no fingerprint, no header line, no way to find an unreadable file. A source subclasses it
    and defines ``name``, ``model_args``, ``train_batches`` and ``eval_batches`` (and what else it knows)."""

    metric: str | None = None
    metric_direction = "minimize"  # of eval_loss; a source with a metric declares its own
    info: Mapping[str, Any] = MappingProxyType({})
    train_size: int | None = None

    def fingerprint(self) -> dict | None:
        return None

    def describe(self) -> str | None:
        return None

    def find_unreadable(self) -> str | None:
        return None


def missing_members(source) -> list[str]:
    """The members of ``DataSource`` that ``source`` lacks (empty: it conforms)."""
    return [name for name in MEMBERS if not hasattr(source, name)]
