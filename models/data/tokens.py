"""Token arrays for transformers (``model=keras_hub``): rows of token ids from an ``.npy`` or an ``.npz``.

Without labels each row of ``L`` ids is a language-modelling window: ``tokens = row[:-1]``, ``targets = row[1:]``
(next-token prediction). With labels, ``tokens = row`` and ``label`` is one class per row (``[n]``: sequence
classification) or per token (``[n, L]``: token classification). ``pad_id`` marks padding: the model's padding
mask and the loss leave it out. The ids are checked against ``vocab_size`` in one line naming the largest id.
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from ._source import AUTOTUNE, check_batch_size, check_seed
from .source import BaseSource


class TokenSource(BaseSource):
    """Next-token windows ``{"tokens", "targets"}`` (int32 ``[batch, L - 1]``) of token-id rows.

    Training batches are an endless sequence of epochs, each a permutation of the training rows drawn from
    ``(seed, epoch)``; evaluation reads the test rows in order (the last batch may be smaller).
    """

    metric = "bits_per_token"
    metric_direction = "minimize"

    def __init__(self, name: str, train, test, vocab_size: int, pad_id: int | None, info: dict | None = None):
        self.name, self.info = name, info or {}
        self._train, self._test = train, test
        self.vocab_size, self.pad_id = vocab_size, pad_id
        self.seq_len = train[0].shape[1] - self._shift
        self.model_args = {"vocab_size": vocab_size, "seq_len": self.seq_len, "pad_id": pad_id, "unit": "token"}

    _shift = 1  # a window of L ids feeds L - 1 and predicts the next one at each

    @property
    def train_size(self) -> int:
        return len(self._train[0])

    @property
    def test_size(self) -> int:
        return len(self._test[0])

    def _example(self, rows, labels):
        return {"tokens": rows[:, :-1], "targets": rows[:, 1:]}

    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        rows, labels = (tf.constant(a) if a is not None else None for a in self._train)
        n = self.train_size

        def epoch(e):
            key = tf.stack([tf.constant(seed, tf.int64), e])
            return tf.data.Dataset.from_tensor_slices(tf.random.experimental.stateless_shuffle(tf.range(n), key))

        def gather(idx):
            return self._example(tf.gather(rows, idx), None if labels is None else tf.gather(labels, idx))

        ds = tf.data.Dataset.counter().flat_map(epoch).batch(batch_size, drop_remainder=True)
        return ds.map(gather, num_parallel_calls=AUTOTUNE, deterministic=True).prefetch(AUTOTUNE)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        batch_size = check_batch_size(batch_size)
        rows, labels = self._test
        parts = (rows,) if labels is None else (rows, labels)
        ds = tf.data.Dataset.from_tensor_slices(parts).batch(batch_size)
        return ds.map(lambda r, y=None: self._example(r, y)).prefetch(AUTOTUNE)

    def describe(self) -> str:
        pad = f", pad_id {self.pad_id}" if self.pad_id is not None else ""
        return (f"{self.name}: {self.train_size} train / {self.test_size} test rows of {self._train[0].shape[1]} token "
                f"ids, vocabulary {self.vocab_size}{pad}{self._label_words()}")

    def _label_words(self) -> str:
        return ", next-token targets"


class LabelledTokenSource(TokenSource):
    """``{"tokens", "label"}``: whole rows of ids, with one class per row or per token."""

    metric = "accuracy"
    metric_direction = "maximize"
    _shift = 0

    def __init__(self, name: str, train, test, vocab_size: int, pad_id: int | None, num_classes: int,
                 info: dict | None = None):
        super().__init__(name, train, test, vocab_size, pad_id, info)
        self.num_classes = num_classes
        self.labels = "token" if train[1].ndim == 2 else "sequence"
        self.model_args = {**self.model_args, "num_classes": num_classes, "labels": self.labels}

    def _example(self, rows, labels):
        return {"tokens": rows, "label": labels}

    def _label_words(self) -> str:
        return f", {self.num_classes} classes per {'token' if self.labels == 'token' else 'row'}"


def tokens(path: str | None = None, x_key: str = "x", y_key: str | None = None, test_fraction: float = 0.1,
           split_seed: int = 0, vocab_size: int | None = None, pad_id: int | None = None,
           num_classes: int | None = None) -> TokenSource | LabelledTokenSource:
    """Token-id rows ``[n, L]`` from ``path`` (an ``.npy``, or an ``.npz`` with ``x_key`` and optionally ``y_key``).

    Args:
        path: the file.
        x_key, y_key: the ``.npz`` arrays of ids and (optionally) labels: ``[n]`` or ``[n, L]`` integers.
        test_fraction: share of the rows, drawn with ``split_seed``, held out for evaluation.
        vocab_size: ids must be below it; ``None``: the largest id + 1.
        pad_id: the padding id (``None``: no padding).
        num_classes: ``None``: the largest label + 1.
    """
    x, y = _load(path, x_key, y_key)
    top = int(x.max())
    if x.min() < 0:
        raise ValueError(f"data.path={path!r}: token ids must be >= 0; found {int(x.min())}.")
    if vocab_size is None:
        vocab_size = top + 1
    elif isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= top:
        raise ValueError(f"data.vocab_size={vocab_size!r}: the largest token id in data.path is {top}; give a "
                         f"vocab_size > {top} (or null: {top + 1}).")
    if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < vocab_size):
        raise ValueError(f"data.pad_id={pad_id!r}: must be a token id in 0..{vocab_size - 1}, or null (no padding).")
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, (int, float)) or not 0 < test_fraction < 1:
        raise ValueError(f"data.test_fraction={test_fraction!r}: must be a number in (0, 1).")
    held = int(round(len(x) * test_fraction))
    if not 0 < held < len(x):
        raise ValueError(f"data.test_fraction={test_fraction}: holds out {held} of {len(x)} rows; need at least one "
                         f"on each side.")
    order = np.random.default_rng(check_seed(split_seed)).permutation(len(x))
    train, test = np.sort(order[held:]), np.sort(order[:held])
    info = {"path": os.path.abspath(str(path)), "rows": int(len(x)), "length": int(x.shape[1])}
    split = lambda a, rows: None if a is None else a[rows]
    if y is None:
        return TokenSource("tokens", (x[train], None), (x[test], None), vocab_size, pad_id, info)
    classes = int(y.max()) + 1 if num_classes is None else num_classes
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 1 or y.max() >= classes:
        raise ValueError(f"data.num_classes={num_classes!r}: the labels hold 0..{int(y.max())}; give an integer > "
                         f"{int(y.max())} or null.")
    return LabelledTokenSource("tokens", (x[train], split(y, train)), (x[test], split(y, test)), vocab_size, pad_id,
                               classes, info)


def _load(path, x_key: str, y_key: str | None):
    """(ids int32 [n, L], labels int32 [n] / [n, L] or None), checked."""
    if path is None:
        raise ValueError("data.path: give an .npy of token ids [rows, length], or an .npz with data.x_key (and "
                         "data.y_key for labels).")
    full = os.path.expanduser(str(path))
    if not os.path.isfile(full):
        raise ValueError(f"data.path={path!r}: no such file (an .npy of token ids, or an .npz).")
    try:
        loaded = np.load(full, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(f"data.path={path!r}: not a NumPy .npy or .npz file ({err}).") from err
    if isinstance(loaded, np.ndarray):
        if y_key is not None:
            raise ValueError(f"data.y_key={y_key!r}: labels come from an .npz; {path!r} is an .npy of token ids.")
        x, y = loaded, None
    else:
        with loaded:
            missing = [k for k in (x_key, y_key) if k is not None and k not in loaded.files]
            if missing:
                raise ValueError(f"data.path={path!r} has no array {missing[0]!r}; its arrays: {loaded.files} "
                                 f"(data.x_key, data.y_key).")
            x, y = loaded[x_key], (loaded[y_key] if y_key is not None else None)
    if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer) or len(x) < 2 or x.shape[1] < 2:
        raise ValueError(f"data.path={path!r}: token ids must be an integer array [rows >= 2, length >= 2]; got "
                         f"{x.dtype} {list(x.shape)}.")
    if y is not None:
        if not np.issubdtype(y.dtype, np.integer) or y.shape not in ((len(x),), x.shape) or y.min() < 0:
            raise ValueError(f"data.y_key={y_key!r}: labels must be integers >= 0, one per row [{len(x)}] or per token "
                             f"{list(x.shape)}; got {y.dtype} {list(y.shape)}.")
        y = y.astype(np.int32)
    return x.astype(np.int32), y
