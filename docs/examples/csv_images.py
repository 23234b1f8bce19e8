"""A new streamed source as one reader: a CSV of image paths and class numbers (``path,label`` per row, paths
relative to the CSV). The bundled pipeline does the rest: decoding (``FileDecoder``), rescale, augmentation,
sharding, symbolic checkpoints. docs/DATA.md shows it.
"""

from __future__ import annotations

import csv
import os

import tensorflow as tf

from models.data import FileDecoder, ImagePipeline, Labels, Pixels, file_signatures, shuffled_indices


class CSVReader:
    """The rows of `path` as keys `(image path, label)`; the first `test_fraction` of them held out."""

    unit = "file"  # what a key is, in the header's "N corrupt file(s) skipped"

    def __init__(self, path: str, test_fraction: float = 0.2):
        with open(path, newline="") as f:
            rows = [(os.path.join(os.path.dirname(path), image), int(label)) for image, label in csv.reader(f)]
        held = max(1, round(len(rows) * test_fraction))
        self.rows = {"train": rows[held:], "test": rows[:held]}

    @property
    def train_size(self) -> int:
        return len(self.rows["train"])

    @property
    def test_size(self) -> int:
        return len(self.rows["test"])

    def _tensors(self, split: str):
        paths, labels = zip(*self.rows[split])
        return tf.constant(paths), tf.constant(labels, tf.int32)

    def train_keys(self, seed: int) -> tf.data.Dataset:  # endless; each epoch's order drawn from (seed, epoch)
        paths, labels = self._tensors("train")
        return shuffled_indices(self.train_size, seed).map(lambda i: (paths[i], labels[i]))

    def test_keys(self) -> tf.data.Dataset:  # one pass, in file order
        return tf.data.Dataset.from_tensor_slices(self._tensors("test"))

    def fingerprint(self) -> dict:  # what a resume compares: each split's files and their contents
        return {"files": {split: file_signatures([p for p, _ in rows]) for split, rows in self.rows.items()}}

    def find_unreadable(self, decoder) -> str | None:  # after a failure that names no file
        for path, label in self.rows["train"] + self.rows["test"]:
            try:
                decoder.decodes((tf.constant(path), label))
            except tf.errors.OpError:
                return f"data: {path} cannot be decoded; remove its row from the CSV"
        return None


def csv_images(path: str | None = None, image_size=(32, 32), test_fraction: float = 0.2) -> ImagePipeline:
    """Images listed in a CSV, resized to `image_size`, classes `0 .. largest label`."""
    if path is None or not os.path.isfile(path):
        raise ValueError(f"data.path={path!r}: give a CSV file of rows path,label.")
    reader = CSVReader(path, test_fraction)
    labels = Labels.of(1 + max(label for rows in reader.rows.values() for _, label in rows))
    shape = (*image_size, 3)
    return ImagePipeline("csv_images", reader, FileDecoder(shape, resize=True), Pixels(shape, rescale=1 / 255),
                         labels, info={"path": os.path.abspath(path)})
