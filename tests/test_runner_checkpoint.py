"""runner.run.checkpoint in-process: seed states saved, only finite state saved, broken checkpoints skipped,
leftover `_temp` folders removed, a failed write reported in one line."""

from __future__ import annotations

import logging

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
import keras  # noqa: E402

from models import build_mlp  # noqa: E402
from models.data import synthetic  # noqa: E402
from runner.errors import ConfigError  # noqa: E402
from runner.run.checkpoint import Checkpoints, CheckpointWriteError  # noqa: E402
from sections import Engine  # noqa: E402


def _setup(directory, keep=5):
    keras.utils.set_random_seed(0)
    data = synthetic(train_size=64, test_size=16)
    engine = Engine(build_mlp(hidden=[8], dropout=0.3, **data.model_args), optimizer=keras.optimizers.Adam(1e-2),
                    sections=2)
    batches = iter(data.train_batches(16, 0))
    engine.build(next(iter(data.train_batches(16, 0))))
    return engine, batches, Checkpoints(directory, engine, batches, keep)


def _values(variables):
    return [np.array(v) for v in variables]


def test_resume_restores_seed_generator_states_and_weights(tmp_path):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    seeds = [v for v in engine.network.variables if "seed" in v.path]
    assert seeds, [v.path for v in engine.network.variables]
    engine.train_step(next(batches))
    ckpt.save(1)
    saved, saved_seeds = _values(engine.network.variables), _values(seeds)
    engine.train_step(next(batches))
    assert any(not np.array_equal(a, b) for a, b in zip(saved_seeds, _values(seeds)))  # dropout drew
    step, path = ckpt.restore()
    assert step == 1 and path.endswith("ckpt-1")
    for a, b in zip(saved, _values(engine.network.variables)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("model", ["mlp-dropout", "attention"])
def test_a_restored_run_repeats_the_random_draws_of_its_next_step(tmp_path, model):
    """Dropout masks and the attention's Bernoulli sample come from seed-generator states in the checkpoint."""
    from models import build_attention

    keras.utils.set_random_seed(0)
    data = synthetic(train_size=64, test_size=16)
    network = (build_mlp(hidden=[8], dropout=0.5, **data.model_args) if model == "mlp-dropout"
               else build_attention(filters=[4, 4], hidden=8, **data.model_args))
    engine = Engine(network, optimizer=keras.optimizers.Adam(1e-2), sections=2)
    batches = iter(data.train_batches(16, 0))
    ckpt = Checkpoints(tmp_path / "checkpoints", engine, batches, 3)
    engine.train_step(next(batches))
    ckpt.save(1)
    expected = [float(engine.train_step(next(batches))["loss"]) for _ in range(2)]
    ckpt.restore()
    assert [float(engine.train_step(next(batches))["loss"]) for _ in range(2)] == expected


def test_nonfinite_state_is_never_saved(tmp_path, caplog):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    assert ckpt.save(1).endswith("ckpt-1")
    kernel = engine.network.trainable_variables[0]
    kernel.assign(tf.fill(kernel.shape, float("nan")))
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert ckpt.save(2) is None
    assert "holds NaN or Inf; checkpoint not saved" in caplog.text and kernel.path in caplog.text
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.index")) == ["ckpt-1.index"]
    assert ckpt.latest.endswith("ckpt-1")


def test_corrupted_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    engine.train_step(next(batches))
    ckpt.save(1)
    first = _values(engine.network.variables)
    engine.train_step(next(batches))
    ckpt.save(2)
    (data_file,) = (tmp_path / "checkpoints").glob("ckpt-2.data-*")
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="runner"):
        step, path = ckpt.restore()
    assert step == 1 and path.endswith("ckpt-1")
    assert "ckpt-2 is unreadable" in caplog.text and "resuming from ckpt-1" in caplog.text
    for a, b in zip(first, _values(engine.network.variables)):
        np.testing.assert_array_equal(a, b)


def test_garbled_state_file_is_ignored(tmp_path, caplog):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    ckpt.save(1)
    ckpt.save(2)
    (tmp_path / "checkpoints" / "checkpoint").write_bytes(b"\x00garbage{{{ not a proto")
    with caplog.at_level(logging.WARNING, logger="runner"):
        engine, batches, ckpt = _setup(tmp_path / "checkpoints")
        assert ckpt.restore()[0] == 2
    assert "checkpoint (the list of checkpoints) is unreadable" in caplog.text


def test_no_readable_checkpoint_is_one_config_error(tmp_path):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    ckpt.save(1)
    for path in (tmp_path / "checkpoints").glob("ckpt-1.*"):
        path.write_bytes(b"junk")
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    with pytest.raises(ConfigError, match="no checkpoint there can be read.*ckpt-1"):
        ckpt.restore()


def test_leftover_temp_folders_are_removed_on_the_next_save(tmp_path):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    ckpt.save(1)
    leftover = tmp_path / "checkpoints" / "ckpt-2_temp"
    (leftover / "part-00000-of-00001").mkdir(parents=True)
    ckpt.save(3)
    assert not leftover.exists() and (tmp_path / "checkpoints" / "ckpt-3.index").is_file()


def test_a_failed_write_stops_in_one_line_keeping_the_folder(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the checkpoint folder should be")
    engine, batches, ckpt = _setup(blocker / "checkpoints")
    with pytest.raises(CheckpointWriteError, match="could not write the step-1 checkpoint") as err:
        ckpt.save(1)
    assert "\n" not in str(err.value)


def test_a_full_disk_stops_in_one_line_keeping_earlier_checkpoints(tmp_path, monkeypatch):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    ckpt.save(1)
    temp = tmp_path / "checkpoints" / "ckpt-2_temp"

    def full_disk(**kwargs):  # what TensorFlow raised when a 4 MiB tmpfs filled up mid-save
        temp.mkdir()
        raise tf.errors.ResourceExhaustedError(None, None, (
            "{{function_node __wrapped__SaveV2_dtypes_24_device_/job:localhost/replica:0/task:0/device:CPU:0}} "
            f"{temp}/part-00000-of-00001.data-00000-of-00001.tempstate1; No space left on device [Op:SaveV2]"))

    monkeypatch.setattr(ckpt.manager, "save", full_disk)
    with pytest.raises(CheckpointWriteError) as err:
        ckpt.save(2)
    message = str(err.value)
    assert "could not write the step-2 checkpoint" in message and "No space left on device;" in message
    assert "{{" not in message and "[Op:" not in message and "\n" not in message
    assert message.endswith(f"newest: {tmp_path / 'checkpoints' / 'ckpt-1'})")
    assert not temp.exists() and (tmp_path / "checkpoints" / "ckpt-1.index").is_file()


def test_a_checkpoint_from_before_seed_states_still_resumes(tmp_path, caplog):
    engine, batches, ckpt = _setup(tmp_path / "checkpoints")
    engine.train_step(next(batches))
    old = tf.train.Checkpoint(step=tf.Variable(3, dtype=tf.int64), optimizer=engine.optimizer,
                              network=list(engine.network.layers), data=batches)
    old.save(str(tmp_path / "checkpoints" / "ckpt"))  # as CheckpointManager did: ckpt-1, step variable 3
    saved = _values(engine.network.trainable_variables)
    engine.train_step(next(batches))
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert ckpt.restore()[0] == 3
    assert "predates checkpointed seed-generator states" in caplog.text
    for a, b in zip(saved, _values(engine.network.trainable_variables)):
        np.testing.assert_array_equal(a, b)


def test_resume_runs_the_learning_rate_config_yaml_records(tmp_path, caplog):
    """An earlier resume changed the rate and was killed before saving: config.yaml has the new rate, the
    checkpoint the old one. The config's value is applied, and said so once."""
    from runner.config.resume import apply_optimizer_changes

    engine, batches, ckpt = _setup(tmp_path / "checkpoints")  # Adam 1e-2
    engine.train_step(next(batches))
    ckpt.save(1)
    ckpt.restore()
    with caplog.at_level(logging.INFO, logger="runner"):
        apply_optimizer_changes(engine.optimizer, {}, {"learning_rate": 5e-3})
    assert float(engine.optimizer.learning_rate) == pytest.approx(5e-3)
    assert "optimizer.learning_rate 0.01 in the checkpoint -> 0.005 as config.yaml records" in caplog.text
    ckpt.restore()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="runner"):  # a change on this command line: one line
        apply_optimizer_changes(engine.optimizer, {"optimizer.learning_rate": (1e-2, 2e-3)}, {"learning_rate": 2e-3})
    assert float(engine.optimizer.learning_rate) == pytest.approx(2e-3)
    assert caplog.text.count("optimizer.learning_rate") == 1
