"""Data sources: each builder returns a ``DataSource`` (``name``, ``model_args``, ``metric``, ``info``,
``train_batches(batch_size, seed, shard)``, ``eval_batches(batch_size)``, ``fingerprint()`` ...; docs/DATA.md).
The streamed image sources are one ``ImagePipeline`` composed of a reader and a decoder."""

from ._fingerprint import compare as compare_fingerprints
from ._fingerprint import file_signatures
from ._source import ImageSource
from ._stream import Decoder, ImagePipeline, Labels, Pixels, Reader, shuffled_indices
from .arrays import ArrayReader, arrays
from .digits import digits
from .image_folder import FileDecoder, FileReader, image_folder
from .mnist import mnist
from .sequences import SequenceSource, sequences
from .source import BaseSource, DataSource, missing_members
from .synthetic import synthetic
from .text import TextSource, text
from .tfds import tfds
from .tfrecord import ExampleDecoder, ShardReader, tfrecord
from .tokens import LabelledTokenSource, TokenSource, tokens

__all__ = ["digits", "mnist", "synthetic", "sequences", "text", "image_folder", "arrays", "tfrecord", "tfds", "tokens",
           "DataSource", "BaseSource", "missing_members", "ImageSource", "ImagePipeline", "Reader", "Decoder",
           "Labels", "Pixels", "FileReader", "FileDecoder", "ShardReader", "ExampleDecoder", "ArrayReader",
           "compare_fingerprints", "file_signatures", "shuffled_indices", "SequenceSource", "TextSource", "TokenSource", "LabelledTokenSource"]
