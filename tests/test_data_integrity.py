"""Nothing silently wrong in the data (issue 37): links walked once, every corrupt file or record named or skipped
and counted, and a resume that compares the data it continues on with the run's fingerprint."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from omegaconf import OmegaConf

from models import data
from runner.errors import ConfigError
from runner.run import datafeed
from test_data_sources import CHEAP, ROOT, one_line, runner, write_folder, write_shards

SHARD = dict(image_key="img", label_key="cls", num_classes=3)


def record_offsets(path: Path) -> list[int]:
    """Where each record of an uncompressed TFRecord file starts, and its end."""
    raw, offsets = path.read_bytes(), [0]
    while offsets[-1] < len(raw):
        offsets.append(offsets[-1] + 16 + struct.unpack("<Q", raw[offsets[-1]:offsets[-1] + 8])[0])
    return offsets


def corrupt_png_middle(path: Path) -> None:
    """Zero bytes inside the image data: the signature and the IEND end marker stay, decoding fails."""
    raw = bytearray(path.read_bytes())
    raw[60:90] = b"\0" * 30
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------- item 2: walking folders
def test_a_link_loop_in_a_class_folder_is_not_followed(tmp_path):
    root = write_folder(tmp_path / "imgs", classes=("a", "b"), per_class=10)
    os.symlink("..", root / "a" / "up")  # a/up -> the data folder: b's images would be labelled a, again and again
    source = data.image_folder(str(root))
    assert source.train_size + source.test_size == 20
    assert source.info["link_loops"] == 1 and f"not followed (e.g. {root / 'a' / 'up'})" in source.describe()


def test_a_file_reached_twice_through_links_counts_once_where_it_really_is(tmp_path):
    root = write_folder(tmp_path / "imgs", classes=("a", "b"), per_class=5)
    os.symlink(root / "b" / "001.png", root / "a" / "zz.png")
    os.symlink(root / "b", root / "a" / "also_b")  # a whole folder of b again, inside a
    source = data.image_folder(str(root), validation_split=0.1)
    assert source.train_size + source.test_size == 10
    assert str(root / "a" / "zz.png") in source.describe() and "reached twice through links, counted once" in \
        source.describe()
    files = source.reader.files["train"] + source.reader.files["test"]
    assert str(root / "b" / "001.png") in files and str(root / "a" / "zz.png") not in files


def test_image_files_tensorflow_cannot_decode_are_counted_and_named(tmp_path):
    root = write_folder(tmp_path / "imgs", classes=("a", "b"), per_class=4)
    (root / "a" / "x.webp").write_bytes(b"RIFF\0\0\0\0WEBPVP8 ")
    (root / "b" / "y.tiff").write_bytes(b"II*\0")
    source = data.image_folder(str(root))
    assert source.info["unreadable"] == 2 and source.train_size + source.test_size == 8
    assert "2 .tiff/.webp file(s) left out: TensorFlow cannot decode them (e.g. " in source.describe()
    (root / "c").mkdir()
    (root / "c" / "z.webp").write_bytes(b"RIFF")
    with pytest.raises(ValueError) as err:
        data.image_folder(str(root))
    assert "holds no images" in one_line(err) and "only 1 file(s) of a type TensorFlow cannot decode" in str(err.value)


# ---------------------------------------------------------------- item 3: corrupt files and records
def test_a_png_corrupt_mid_file_is_named_and_skip_corrupt_skips_it(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=4)
    corrupt_png_middle(root / "dog" / "002.png")  # signature and end marker intact: the quick check passes
    source = data.image_folder(str(root), validation_split=0.25)
    with pytest.raises(datafeed.DataError) as err:
        for _ in datafeed.checked(source.train_batches(9, 0).take(3), source):
            pass
        for _ in datafeed.checked(source.eval_batches(9), source):
            pass
    line = one_line(err)
    assert line.startswith(f"data: {root / 'dog' / '002.png'} cannot be decoded") and "data.skip_corrupt=true" in line
    skipping = data.image_folder(str(root), validation_split=0.25, skip_corrupt=True)
    assert skipping.info["skipped_corrupt"] == 1 and skipping.train_size + skipping.test_size == 11
    assert f"1 corrupt file(s) skipped (e.g. {root / 'dog' / '002.png'})" in skipping.describe()
    for _ in datafeed.checked(skipping.train_batches(11, 0).take(2), skipping):
        pass


def test_a_tfrecord_shard_cut_short_is_refused_or_read_to_its_last_whole_record(tmp_path):
    files = write_shards(tmp_path / "s", shards=3, per_shard=10)
    shard = tmp_path / "s" / "part-1.tfrecord"
    offsets = record_offsets(shard)
    whole = shard.read_bytes()
    for cut in (offsets[7] + 5, offsets[7] + 40):  # inside record 7's header, inside its data
        shard.write_bytes(whole[:cut])
        with pytest.raises(ValueError) as err:
            data.tfrecord(files, files, **SHARD)
        assert f"data.train_files: {shard} is cut short: record 7 (at byte {offsets[7]})" in one_line(err)
        assert "data.skip_corrupt=true to read its 7 whole records" in str(err.value)
    shard.write_bytes(shard.read_bytes()[:offsets[7] + 5])
    source = data.tfrecord(files, files, skip_corrupt=True, **SHARD)
    assert (source.train_size, source.info["skipped_corrupt"]) == (27, 1)
    assert "1 corrupt record(s) skipped" in source.describe()
    assert sum(len(b["label"]) for b in datafeed.checked(source.eval_batches(8), source)) == 27


def test_a_corrupt_record_mid_shard_names_the_shard_and_record_and_is_skipped(tmp_path):
    files = write_shards(tmp_path / "s", shards=3, per_shard=10)
    shard = tmp_path / "s" / "part-1.tfrecord"
    raw = bytearray(shard.read_bytes())
    raw[record_offsets(shard)[4] + 20] ^= 0xFF  # a byte of record 4's data: its checksum fails
    shard.write_bytes(bytes(raw))
    source = data.tfrecord(files, files, **SHARD)
    with pytest.raises(datafeed.DataError) as err:
        for _ in datafeed.checked(source.train_batches(30, 0).take(2), source):
            pass
    assert one_line(err).startswith(f"data: shard {shard}: record 4 cannot be read (corrupted record at ")
    skipping = data.tfrecord(files, files, skip_corrupt=True, **SHARD)
    assert skipping.train_size == 24 and skipping.info["skipped_corrupt"] == 1  # the rest of that shard is unreadable
    assert sum(len(b["label"]) for b in datafeed.checked(skipping.eval_batches(8), skipping)) == 24


def test_a_corrupt_image_inside_a_record_names_the_shard_and_record_and_is_skipped(tmp_path):
    files = write_shards(tmp_path / "s", shards=2, per_shard=6)
    shard = tmp_path / "s" / "part-0.tfrecord"
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    example = tf.train.Example.FromString(records[2])
    png = bytearray(example.features.feature["img"].bytes_list.value[0])
    png[60:80] = b"\0" * 20
    example.features.feature["img"].bytes_list.value[0] = bytes(png)
    records[2] = example.SerializeToString()
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in records:
            writer.write(record)
    source = data.tfrecord(files, files, **SHARD)
    with pytest.raises(datafeed.DataError) as err:
        for _ in datafeed.checked(source.eval_batches(12), source):
            pass
    assert one_line(err).startswith(f"data: shard {shard}: record 2's image cannot be decoded")
    skipping = data.tfrecord(files, files, skip_corrupt=True, **SHARD)
    assert skipping.train_size == 11 and skipping.info["skipped_corrupt"] == 1
    assert skipping.info["corrupt_example"] == f"{shard} record 2"
    for _ in datafeed.checked(skipping.train_batches(11, 0).take(3), skipping):
        pass


def test_a_glob_that_matches_only_a_folder_is_one_line(tmp_path):
    write_shards(tmp_path / "shards", shards=1, per_shard=2)
    with pytest.raises(ValueError) as err:
        data.tfrecord(str(tmp_path / "shard*"), str(tmp_path / "shard*"), **SHARD)
    assert "matches only folder(s)" in one_line(err) and "give the shard files, e.g." in str(err.value)


# ---------------------------------------------------------------- item 1: the data fingerprint and resume
def test_fingerprints_name_renamed_classes_moved_files_and_other_arrays(tmp_path):
    root = write_folder(tmp_path / "imgs", per_class=5)
    before = data.image_folder(str(root)).fingerprint()
    assert before["classes"] == {"cat": 0, "dog": 1, "emu": 2} and len(before["files"]["test"]) == 3
    assert data.compare_fingerprints(before, data.image_folder(str(root)).fingerprint()) == []
    (root / "emu").rename(root / "yak")
    said = data.compare_fingerprints(before, data.image_folder(str(root)).fingerprint())
    assert said == ["class 'emu' (number 2) is now 'yak'"]  # its files are the same files
    write_folder(root, classes=("cat",), per_class=9, seed=1)  # 4 images added to cat, 5 rewritten
    said = "; ".join(data.compare_fingerprints(before, data.image_folder(str(root)).fingerprint()))
    assert "file(s) added (e.g. cat/" in said and "changed (e.g. cat/000.png)" in said
    assert "of the run's test files would now be trained on" in said  # the split moved

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "a.npz", x=rng.integers(0, 256, (20, 4, 4), np.uint8), y=np.arange(20) % 2)
    first = data.arrays(str(tmp_path / "a.npz")).fingerprint()
    np.savez(tmp_path / "a.npz", x=rng.integers(0, 256, (20, 4, 4), np.uint16), y=np.arange(20) % 2)
    said = data.compare_fingerprints(first, data.arrays(str(tmp_path / "a.npz")).fingerprint())
    assert "array train images was [20, 4, 4] uint8, now [20, 4, 4] uint16" in said


def resume_cfg(folder: Path, path: Path, resume_data="same"):
    return OmegaConf.create({"resume": str(folder), "resume_data": resume_data,
                             "data": {"_target_": "models.data.image_folder", "path": str(path)}})


def test_resume_refuses_changed_data_in_one_line_or_continues_knowingly_with_the_class_numbers_kept(tmp_path):
    root, run = write_folder(tmp_path / "imgs", per_class=5), tmp_path / "run"
    run.mkdir()
    datafeed.write_record(run, data.image_folder(str(root)))
    (root / "dog").rename(root / "ant")  # sorted, ant would become class 0
    changed = data.image_folder(str(root))
    rebuild = lambda **kw: data.image_folder(str(root), **kw)  # noqa: E731
    with pytest.raises(ConfigError) as err:
        datafeed.resumed_data(resume_cfg(run, root), changed, rebuild)
    line = one_line(err)
    assert line.startswith(f"resume={run}: the data changed since that run: class 'dog' (number 1) is now 'ant'; "
                           f"a resume continues on the run's own data")
    assert "give resume_data=changed to continue on this data knowingly" in line
    kept, changes = datafeed.resumed_data(resume_cfg(run, root, "changed"), changed, rebuild)
    assert kept.class_names == ["cat", "ant", "emu"] and changes  # ant keeps dog's number
    datafeed.write_record(run, kept, resumed=True, changes=changes)
    assert json.loads((run / "data.1.json").read_text())["class_names"] == ["cat", "dog", "emu"]  # the old, kept
    assert json.loads((run / "data.json").read_text())["class_names"] == ["cat", "ant", "emu"]
    assert datafeed.resumed_data(resume_cfg(run, root), data.image_folder(str(root)), rebuild)[1] == []


def test_resume_data_is_checked_and_applies_only_to_a_resume():
    from hydra import compose, initialize_config_dir

    from runner.app import CONF
    from runner.config.checks import check_config

    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        for value, match in (("maybe", "resume_data=maybe: allowed: same"),
                             ("changed", "resume_data=changed: applies only with resume=")):
            with pytest.raises(ConfigError, match=match):
                check_config(compose("config", overrides=[f"resume_data={value}"]))


# ---------------------------------------------------------------- item 7: a complete run without its final files
def test_a_complete_run_missing_its_final_files_finishes_them_else_asks_for_more_steps(tmp_path):
    from runner.run.train import _finishing

    train = OmegaConf.create({"steps": 4, "save_model": True})
    assert _finishing(tmp_path, train, 4) is True  # metrics.json and model.keras missing
    for name in ("metrics.json", "model.keras"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ConfigError, match="must exceed the resumed run's step 4 .* final files are there"):
        _finishing(tmp_path, train, 4)
    assert _finishing(tmp_path, OmegaConf.create({"steps": 6}), 4) is False


@pytest.mark.slow  # ~50 s: three short runs
def test_through_the_runner_a_renamed_class_is_refused_and_a_lost_model_keras_is_written_again(tmp_path):
    root, run = write_folder(tmp_path / "imgs", per_class=6), tmp_path / "run"
    proc = runner("data=image_folder", f"data.path={root}", *CHEAP, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "data_fingerprint.json").is_file()
    (root / "emu").rename(root / "yak")
    proc = runner(f"resume={run}", "train.steps=6")
    assert proc.returncode == 2 and "class 'emu' (number 2) is now 'yak'" in proc.stderr.strip().splitlines()[-1]
    (root / "yak").rename(root / "emu")
    (run / "model.keras").unlink()
    proc = runner(f"resume={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "writing the missing model.keras without training further" in proc.stdout + proc.stderr
    assert (run / "model.keras").is_file() and json.loads((run / "metrics.json").read_text())["step"] == 4


@pytest.mark.slow  # ~20 s: every case of the probe
def test_the_data_probe_finds_no_case_silently_wrong():
    proc = subprocess.run([sys.executable, str(ROOT / "docs" / "probe" / "data_probe.py")], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and lines[-1] == "0 case(s) not held", proc.stdout[-3000:] + proc.stderr[-2000:]
    assert len(lines) >= 14 and not any("SILENTLY WRONG" in line for line in lines)
