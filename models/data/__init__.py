"""Data sources: each builder returns an object with ``name``, ``model_args``, ``metric``,
``train_batches(batch_size, seed)`` and ``eval_batches(batch_size)`` (see docs/DATA.md)."""

from ._fingerprint import compare as compare_fingerprints
from ._source import ImageSource
from ._stream import StreamSource
from .arrays import ArraySource, arrays
from .digits import digits
from .image_folder import ImageFolderSource, image_folder
from .mnist import mnist
from .sequences import SequenceSource, sequences
from .synthetic import synthetic
from .text import TextSource, text
from .tfds import TFDSSource, tfds
from .tfrecord import TFRecordSource, tfrecord
from .tokens import LabelledTokenSource, TokenSource, tokens

__all__ = ["digits", "mnist", "synthetic", "sequences", "text", "image_folder", "arrays", "tfrecord", "tfds", "tokens",
           "ImageSource", "StreamSource", "compare_fingerprints", "ImageFolderSource", "ArraySource", "TFRecordSource",
           "TFDSSource", "SequenceSource", "TextSource", "TokenSource", "LabelledTokenSource"]
