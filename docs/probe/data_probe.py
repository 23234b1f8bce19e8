"""Replays the data cases of issue 37 against the own-data sources and prints one line per case with its outcome.

    python docs/probe/data_probe.py            # from the repository root; a few seconds on CPU

Each case makes its own small files in a temporary folder (no network) and ends in one of:
``refused`` (one line naming the problem), ``named`` (the failing file or record named while reading),
``counted`` (left out, and the count said), ``correct`` (the data as it is), or ``SILENTLY WRONG``.
The exit status is 1 when any case is silently wrong (`tests/test_data_integrity.py` runs it, slow).
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf  # noqa: E402

from models import data  # noqa: E402
from runner.run import datafeed  # noqa: E402

SHARD = dict(image_key="img", label_key="cls", num_classes=3)


def folder(root: Path, classes=("a", "b"), per_class=10) -> Path:
    rng = np.random.default_rng(0)
    for name in classes:
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            tf.io.write_file(str(root / name / f"{i:03d}.png"), tf.io.encode_png(image))
    return root


def shards(root: Path, n=3, per_shard=10) -> str:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for s in range(n):
        with tf.io.TFRecordWriter(str(root / f"part-{s}.tfrecord")) as writer:
            for i in range(per_shard):
                png = tf.io.encode_png(rng.integers(0, 256, (8, 6, 3), dtype=np.uint8)).numpy()
                feature = {"img": tf.train.Feature(bytes_list=tf.train.BytesList(value=[png])),
                           "cls": tf.train.Feature(int64_list=tf.train.Int64List(value=[(s + i) % 3]))}
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())
    return str(root / "part-*.tfrecord")


def offsets(path: Path) -> list[int]:
    raw, found = path.read_bytes(), [0]
    while found[-1] < len(raw):
        found.append(found[-1] + 16 + struct.unpack("<Q", raw[found[-1]:found[-1] + 8])[0])
    return found


def read_all(source) -> int:
    """Examples of one training epoch and the test split, read through the runner's error reporting."""
    n = 0
    for batch in datafeed.checked(source.train_batches(source.train_size, 0).take(1), source):
        n += len(batch["label"])
    for batch in datafeed.checked(source.eval_batches(16), source):
        n += len(batch["label"])
    return n


# ---------------------------------------------------------------- the cases: each returns (outcome, detail)
def link_loop(tmp: Path):
    root = folder(tmp / "imgs")
    os.symlink("..", root / "a" / "up")
    source = data.image_folder(str(root))
    total = source.train_size + source.test_size
    return ("counted" if total == 20 and source.info.get("link_loops") else "SILENTLY WRONG",
            f"{total} examples of 20 files; {source.describe().split(', ')[-1]}")


def webp_files(tmp: Path):
    root = folder(tmp / "imgs")
    (root / "a" / "x.webp").write_bytes(b"RIFF\0\0\0\0WEBPVP8 ")
    source = data.image_folder(str(root))
    return ("counted" if source.info.get("unreadable") == 1 else "SILENTLY WRONG", source.describe().split(", ")[-1])


def png_corrupt_mid_file(tmp: Path):
    root = folder(tmp / "imgs")
    raw = bytearray((root / "b" / "003.png").read_bytes())
    raw[60:90] = b"\0" * 30
    (root / "b" / "003.png").write_bytes(bytes(raw))
    try:
        read_all(data.image_folder(str(root)))
    except datafeed.DataError as err:
        named = "b/003.png" in str(err)
        return ("named" if named else "unnamed error", str(err))
    return "SILENTLY WRONG", "read without an error"


def png_corrupt_skipped(tmp: Path):
    png_corrupt_mid_file(tmp)
    source = data.image_folder(str(tmp / "imgs"), skip_corrupt=True)
    ok = source.info.get("skipped_corrupt") == 1 and read_all(source) == 19
    return ("counted" if ok else "SILENTLY WRONG", f"skipped_corrupt={source.info.get('skipped_corrupt')}")


def class_renamed_on_resume(tmp: Path):
    root, run = folder(tmp / "imgs", classes=("b", "c")), tmp / "run"
    run.mkdir()
    datafeed.write_record(run, data.image_folder(str(root)))
    (root / "c").rename(root / "a")
    from omegaconf import OmegaConf

    from runner.errors import ConfigError

    cfg = OmegaConf.create({"resume": str(run), "resume_data": "same"})
    try:
        datafeed.resumed_data(cfg, data.image_folder(str(root)), lambda **kw: data.image_folder(str(root), **kw))
    except ConfigError as err:
        return "refused", str(err)[:160] + "..."
    return "SILENTLY WRONG", "resumed on renamed classes"


def images_added_on_resume(tmp: Path):
    root, run = folder(tmp / "imgs"), tmp / "run"
    run.mkdir()
    datafeed.write_record(run, data.image_folder(str(root)))
    folder(root, classes=("a",), per_class=14)
    from omegaconf import OmegaConf

    from runner.errors import ConfigError

    cfg = OmegaConf.create({"resume": str(run), "resume_data": "same"})
    try:
        datafeed.resumed_data(cfg, data.image_folder(str(root)), lambda **kw: data.image_folder(str(root), **kw))
    except ConfigError as err:
        return "refused", str(err).split("since that run: ")[1][:160] + "..."
    return "SILENTLY WRONG", "resumed on other files"


def arrays_changed(tmp: Path):
    rng = np.random.default_rng(0)
    np.savez(tmp / "a.npz", x=rng.integers(0, 256, (20, 4, 4), np.uint8), y=np.arange(20) % 2)
    before = data.arrays(str(tmp / "a.npz")).fingerprint()
    np.savez(tmp / "a.npz", x=rng.integers(0, 256, (20, 4, 4), np.uint8), y=np.arange(20) % 2)
    said = data.compare_fingerprints(before, data.arrays(str(tmp / "a.npz")).fingerprint())
    return ("refused" if said else "SILENTLY WRONG", "; ".join(said) or "no change seen")


def arrays_uint16(tmp: Path):
    x = np.random.default_rng(0).integers(0, 65536, (20, 4, 4), np.uint16)
    np.savez(tmp / "a.npz", x=x, y=np.arange(20) % 2)
    source = data.arrays(str(tmp / "a.npz"))
    top = float(next(iter(source.eval_batches(20)))["image"].numpy().max())
    return ("correct" if top <= 1 else "SILENTLY WRONG", source.describe().split(", ")[-1])


def shard_cut_short(tmp: Path):
    files = shards(tmp / "s")
    shard = tmp / "s" / "part-1.tfrecord"
    shard.write_bytes(shard.read_bytes()[:offsets(shard)[7] + 5])
    try:
        data.tfrecord(files, files, **SHARD)
    except ValueError as err:
        return "refused", str(err)
    return "SILENTLY WRONG", "read up to the cut"


def corrupt_record(tmp: Path):
    files = shards(tmp / "s")
    shard = tmp / "s" / "part-1.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[offsets(shard)[4] + 20] ^= 0xFF
    shard.write_bytes(bytes(raw))
    try:
        read_all(data.tfrecord(files, files, **SHARD))
    except datafeed.DataError as err:
        return ("named" if "part-1.tfrecord" in str(err) else "unnamed error"), str(err)
    return "SILENTLY WRONG", "read without an error"


def corrupt_record_skipped(tmp: Path):
    corrupt_record(tmp)
    files = str(tmp / "s" / "part-*.tfrecord")
    source = data.tfrecord(files, files, skip_corrupt=True, **SHARD)
    ok = source.info.get("skipped_corrupt") == 1 and read_all(source) == 48
    return ("counted" if ok else "SILENTLY WRONG", source.describe().split(", ")[-1])


def glob_matches_a_folder(tmp: Path):
    shards(tmp / "s")
    try:
        data.tfrecord(str(tmp / "s"), str(tmp / "s"), **SHARD)
    except ValueError as err:
        return "refused", str(err)
    return "SILENTLY WRONG", "accepted"


def tfds_version_missing(tmp: Path):
    import tensorflow_datasets as tfds

    features = tfds.features.FeaturesDict({"image": tfds.features.Image(shape=(4, 4, 3)),
                                           "label": tfds.features.ClassLabel(names=["x", "y"])})
    images = np.zeros((4, 4, 4, 3), np.uint8)
    split = tf.data.Dataset.from_tensor_slices({"image": images, "label": np.arange(4) % 2})
    tfds.dataset_builders.store_as_tfds_dataset(name="probe_tiny", version="1.0.0", features=features,
                                                data_dir=str(tmp), split_datasets={"train": split, "test": split})
    try:
        data.tfds(name="probe_tiny:9.0.0", data_dir=str(tmp))
    except ValueError as err:
        return ("refused" if "available: 1.0.0" in str(err) else "unnamed error"), str(err)
    return "SILENTLY WRONG", "accepted"


CASES = {"image folders": [link_loop, webp_files, png_corrupt_mid_file, png_corrupt_skipped, class_renamed_on_resume,
                           images_added_on_resume],
         "arrays": [arrays_changed, arrays_uint16],
         "TFRecord": [shard_cut_short, corrupt_record, corrupt_record_skipped, glob_matches_a_folder],
         "TFDS": [tfds_version_missing]}


def main() -> int:
    wrong = 0
    for family, cases in CASES.items():
        for case in cases:
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    outcome, detail = case(Path(tmp))
                except Exception as err:  # noqa: BLE001 - a crash is an outcome too
                    outcome, detail = "crashed", f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            wrong += outcome not in ("refused", "named", "counted", "correct")
            print(f"{family:13s} {case.__name__:26s} {outcome:15s} {detail}", flush=True)
    print(f"{wrong} case(s) not held")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
