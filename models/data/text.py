"""Character-level text for language models: next-character prediction over a corpus read from disk.

The default corpus is the Python standard library's own ``.py`` files (present wherever Python is, no
download; it differs slightly between Python versions, so figures are comparable only at the same
version). Files are ordered by a hash of their relative path and taken until ``max_chars``, so the
sample is spread over the whole library yet identical on every machine with the same Python. The
concatenated text is split by position: the last ``valid_fraction`` is the validation split.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import tensorflow as tf

from .._util import check_int
from ._source import AUTOTUNE, check_batch_size, check_seed
from .source import BaseSource

UNKNOWN_ID = 0
# Folders of the standard library that are not its own code: test suites (with deliberately broken or
# odd-encoded files), third-party packages, caches.
_STDLIB_SKIP = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> tuple[Path, list[Path]]:
    """The standard library folder and its ``.py`` files (tests and site-packages excluded), sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if not _STDLIB_SKIP & set(p.relative_to(root).parts[:-1])]
    return root, sorted(files)


def _hash_order(root: Path, files: list[Path]) -> list[Path]:
    return sorted(files, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).hexdigest())


def _read_text(path: Path) -> str | None:
    """The file as UTF-8 text, or ``None`` when it is binary (a NUL byte, or not UTF-8)."""
    raw = path.read_bytes()
    if b"\0" in raw:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_corpus(path: str | None, max_chars: int | None) -> tuple[str, str]:
    """``(text, origin)`` from a text file, a folder of text files, or (``None``) the standard library.

    A folder contributes every non-hidden file that is UTF-8 text (binary files are skipped), in the
    hashed order; everything stops at ``max_chars`` characters (``None``: no limit). A missing path, a
    binary file, or no text at all raises one error naming the path.
    """
    if path is None:
        root, files = stdlib_files()
        origin = f"Python standard library .py files under {root}"
    else:
        root = Path(os.path.expanduser(str(path)))
        origin = str(root)
        if root.is_file():
            files = [root]
        elif root.is_dir():
            files = sorted(p for p in root.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(root).parts)
                           and "__pycache__" not in p.parts)
        else:
            raise FileNotFoundError(f"data.path={str(path)!r}: no such file or folder; give a UTF-8 text file or "
                                    f"a folder of them, or null for the Python standard library.")
    if root.is_file():
        text = _read_text(root)
        if text is None:
            raise ValueError(f"data.path={str(path)!r}: not a text file (binary, or not UTF-8); give a UTF-8 "
                             f"text file or a folder of them.")
        chunks = [text]
    else:
        chunks, total = [], 0
        for file in _hash_order(root, files):
            if max_chars is not None and total >= max_chars:
                break
            text = _read_text(file)
            if text:
                chunks.append(text)
                total += len(text)
    text = "".join(chunks)
    if max_chars is not None:
        text = text[:max_chars]
    if not text:
        where = f"data.path={str(path)!r}" if path is not None else f"data.path=null ({origin})"
        raise ValueError(f"{where}: no text in it (empty, or only binary files); give a UTF-8 text file or a "
                         f"folder of them.")
    return text, origin


class TextSource(BaseSource):
    """Next-character batches ``{"tokens", "targets"}`` (int32 ``[batch, seq_len]``; targets shifted by one).

    The vocabulary is the characters of the training split, sorted, with id ``0`` for any other
    character (one that appears only in validation). Training windows start at positions drawn
    from ``(seed, batch index)``, uniformly over the training split, so the same seed gives the same
    batches and the iterator's checkpoint holds a counter. Evaluation reads consecutive windows of
    the validation split (stride ``seq_len``: each validation character after the first is a target
    once, up to the last whole window); with ``eval_chars`` set and smaller, ``eval_chars // seq_len`` windows spread evenly
    over the split instead.

    Args:
        name: the data set's name.
        text: the whole corpus.
        seq_len: characters a window feeds the model (and the model's position count).
        valid_fraction: share of the text, at its end, held out for validation.
        eval_chars: about how many validation targets one evaluation reads (``None``: all).
        origin: where the text came from, for messages.
    """

    metric = "bits_per_char"
    metric_direction = "minimize"  # lower is better (runner.config.direction: what a sweep optimizes)

    def __init__(self, name: str, text: str, seq_len: int = 128, valid_fraction: float = 0.1,
                 eval_chars: int | None = None, origin: str = ""):
        self.seq_len = check_int("seq_len", seq_len)
        if isinstance(valid_fraction, bool) or not isinstance(valid_fraction, (int, float)) \
                or not 0 < valid_fraction < 1:
            raise ValueError(f"valid_fraction={valid_fraction!r}: must be a number in (0, 1).")
        self.name, self.origin = name, origin
        split = int(round(len(text) * (1 - valid_fraction)))
        train, valid = text[:split], text[split:]
        for which, part in (("training", train), ("validation", valid)):
            if len(part) < self.seq_len + 1:
                raise ValueError(f"{name} ({origin}): the {which} split has {len(part)} characters, fewer than "
                                 f"seq_len + 1 = {self.seq_len + 1}; give more text, a smaller seq_len, or "
                                 f"another valid_fraction.")
        self.vocab = "".join(sorted(set(train)))
        self.vocab_size = len(self.vocab) + 1
        self.train_ids = self.encode(train)
        self.valid_ids = self.encode(valid)
        self.eval_chars = None if eval_chars is None else check_int("eval_chars", eval_chars)
        self.model_args = {"vocab_size": self.vocab_size, "seq_len": self.seq_len}

    def encode(self, text: str) -> np.ndarray:
        """Character ids (int32); characters outside the vocabulary get ``UNKNOWN_ID``."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        known = np.frombuffer(self.vocab.encode("utf-32-le"), dtype=np.uint32)
        pos = np.minimum(np.searchsorted(known, codes), len(known) - 1)
        return np.where(known[pos] == codes, pos + 1, UNKNOWN_ID).astype(np.int32)

    def decode(self, ids) -> str:
        return "".join(self.vocab[i - 1] if i > 0 else "\N{REPLACEMENT CHARACTER}" for i in np.asarray(ids).ravel())

    def eval_windows(self) -> np.ndarray:
        """The validation windows ``[n, seq_len + 1]`` evaluation reads (tokens ``[:, :-1]``, targets ``[:, 1:]``)."""
        t = self.seq_len
        room = len(self.valid_ids) - 1 - t  # the last start that fits
        count = room // t + 1
        if self.eval_chars is not None and self.eval_chars // t < count:
            count = max(1, self.eval_chars // t)
            starts = np.arange(count) * room // max(count - 1, 1)  # spread evenly over the split
        else:
            starts = np.arange(count) * t
        return self.valid_ids[starts[:, None] + np.arange(t + 1)[None, :]]

    def train_batches(self, batch_size: int, seed: int = 0, shard=None) -> tf.data.Dataset:
        """Endless batches of windows whose starts are drawn from ``(seed, batch index)``."""
        batch_size, seed = check_batch_size(batch_size), check_seed(seed)
        ids = tf.constant(self.train_ids)
        offsets = tf.range(self.seq_len + 1, dtype=tf.int64)[None, :]
        high = len(self.train_ids) - self.seq_len

        def window(i):
            key = tf.stack([tf.constant(seed, tf.int64), i])
            starts = tf.random.stateless_uniform([batch_size], key, 0, high, dtype=tf.int64)
            return _split(tf.gather(ids, starts[:, None] + offsets))

        ds = tf.data.Dataset.counter().map(window, num_parallel_calls=AUTOTUNE, deterministic=True)
        return ds.prefetch(AUTOTUNE)

    def eval_batches(self, batch_size: int) -> tf.data.Dataset:
        """One ordered pass over the validation windows (the last batch may be smaller)."""
        batch_size = check_batch_size(batch_size)
        return tf.data.Dataset.from_tensor_slices(self.eval_windows()).batch(batch_size).map(_split).prefetch(AUTOTUNE)

    def __repr__(self) -> str:
        return (f"TextSource({self.name!r}, train={len(self.train_ids)} chars, valid={len(self.valid_ids)} chars, "
                f"vocab={self.vocab_size}, seq_len={self.seq_len})")


def _split(windows):
    return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


def text(path: str | None = None, seq_len: int = 128, max_chars: int | None = 3_000_000,
         valid_fraction: float = 0.1, eval_chars: int | None = 65_536) -> TextSource:
    """Character-level text as a ``TextSource``.

    Args:
        path: a UTF-8 text file or a folder of them; ``None``: the Python standard library's ``.py`` files.
        seq_len: characters per window.
        max_chars: read at most this many characters (``None``: everything).
        valid_fraction: share of the text, at its end, held out for validation.
        eval_chars: most validation targets one evaluation reads (``None``: the whole split).
    """
    if max_chars is not None:
        max_chars = check_int("max_chars", max_chars)
    corpus, origin = read_corpus(path, max_chars)
    return TextSource("text", corpus, seq_len, valid_fraction, eval_chars, origin)
