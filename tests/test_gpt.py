"""The GPT language model and character-level text: shapes, causality, exact sectioned steps, data, runner.

The slow test is the quality bar: the default config (``experiment=gpt_chars``) against a character
bigram model fitted on the same training split.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from models import build_gpt, data
from models.data.text import UNKNOWN_ID, TextSource
from sections import Engine

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "HYDRA_FULL_ERROR": ""}
TINY = dict(d_model=16, num_layers=2, num_heads=2, seed=0)


def _numbered_lines(n: int) -> str:
    return "".join(f"line {i:05d}: the quick brown fox\n" for i in range(n))


@pytest.fixture(scope="module")
def small_text():
    return TextSource("lines", _numbered_lines(400), seq_len=16, valid_fraction=0.25)


def _tokens(batch=3, time=10, vocab=20, seed=0):
    return tf.constant(np.random.default_rng(seed).integers(0, vocab, size=(batch, time)), tf.int32)


def _forward(net, tokens, training=False):
    h = tokens
    for block in net.blocks:
        h = block.layer(h, training=training)
    return h


# ---------------------------------------------------------------- the model


def test_blocks_are_embed_one_per_layer_and_head():
    net = build_gpt(vocab_size=20, seq_len=12, d_model=16, num_layers=3, num_heads=4)
    assert net.block_names == ["embed", "layer_0", "layer_1", "layer_2", "head"]
    assert net.inputs == "tokens" and set(net.metrics) == {"bits_per_char", "accuracy"}


@pytest.mark.parametrize("tie", [False, True])
def test_logits_shape_shorter_inputs_and_tying(tie):
    net = build_gpt(vocab_size=20, seq_len=12, tie_embeddings=tie, **TINY)
    for time in (12, 5):  # up to seq_len positions
        assert _forward(net, _tokens(time=time)).shape == (3, time, 20)
    head = net.blocks[-1].layer
    embedding = net.blocks[0].layer.token.embeddings
    if tie:
        assert head.logits is None and any(v is embedding for v in head.trainable_variables)
    else:
        assert head.logits.kernel.shape == (16, 20) and all(v is not embedding for v in head.trainable_variables)


def test_changing_a_future_token_leaves_earlier_logits_alone():
    net = build_gpt(vocab_size=20, seq_len=10, **TINY)
    tokens = _tokens(time=10)
    changed = tf.tensor_scatter_nd_update(tokens, [[0, 6], [1, 6], [2, 6]], (tokens[:, 6] + 1) % 20)
    a, b = _forward(net, tokens).numpy(), _forward(net, changed).numpy()
    np.testing.assert_array_equal(a[:, :6], b[:, :6])
    assert np.abs(a[:, 6:] - b[:, 6:]).max(axis=-1).min() > 1e-6  # the change reaches every later position


def test_token_embedding_gradient_is_dense_and_sums_repeats():
    """Repeated tokens' gradients arrive summed in one dense tensor (Keras's Adam squares sparse slices one by one)."""
    net = build_gpt(vocab_size=20, seq_len=6, **TINY)
    tokens = tf.constant([[3, 3, 3, 5, 3, 3]])
    table = net.blocks[0].layer.token
    with tf.GradientTape() as tape:
        h = net.blocks[0].layer(tokens)
        loss = tf.reduce_sum(h * tf.range(1.0, 7.0)[None, :, None])
    grad = tape.gradient(loss, table.embeddings)
    assert isinstance(grad, tf.Tensor) and not isinstance(grad, tf.IndexedSlices)
    np.testing.assert_allclose(grad.numpy()[3], np.full(16, 1 + 2 + 3 + 5 + 6.0))
    np.testing.assert_allclose(grad.numpy()[5], np.full(16, 4.0))
    assert np.count_nonzero(grad.numpy().any(axis=1)) == 2


def test_wrong_data_for_gpt_names_the_mix_up():
    with pytest.raises(ValueError, match="text data"):
        build_gpt(num_classes=10, input_shape=(28, 28, 1))
    with pytest.raises(ValueError, match="vocab_size and seq_len"):
        build_gpt()
    with pytest.raises(ValueError, match="num_heads=3"):
        build_gpt(vocab_size=20, seq_len=8, d_model=16, num_heads=3)


def _reference_steps(net, batches, learning_rate):
    """A plain GradientTape loop over the network's layers, each built by its first call."""
    optimizer = keras.optimizers.Adam(learning_rate)
    variables, losses = None, []
    for batch in batches:
        with tf.GradientTape() as tape:
            logits = _forward(net, batch["tokens"], training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["targets"], logits,
                                                                               from_logits=True))
        if variables is None:
            seen = {}
            for block in net.blocks:
                for v in block.layer.trainable_variables:
                    seen.setdefault(id(v), v)
            variables = list(seen.values())
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        losses.append(float(loss))
    return losses


def test_sectioned_steps_equal_a_plain_tape_loop(small_text):
    """Every block its own section, tied embeddings (one variable used in the first and last section),
    dropout on everywhere, 3 Adam steps; the engine re-runs sections and checks the replay.
    (Untied, default sections: the runner smoke run's exactness report.)"""
    it = iter(small_text.train_batches(4, seed=1))
    batches = [next(it) for _ in range(3)]
    args = dict(**small_text.model_args, d_model=16, num_layers=2, num_heads=2, dropout=0.2, tie_embeddings=True)
    sectioned, reference = build_gpt(**args, seed=5), build_gpt(**args, seed=5)
    engine = Engine(sectioned, keras.optimizers.Adam(3e-3), sections=["layer_0", "layer_1", "head"],
                    policy="recompute", check=True)
    losses = [engine.train_step(b)["loss"] for b in batches]
    expected = _reference_steps(reference, batches, 3e-3)
    assert len(engine.sections) == 4
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-6)
    assert losses[0] != losses[2]  # the weights moved
    trained = {v.path: v for v in sectioned.trainable_variables}
    ref = {v.path: v for v in reference.trainable_variables}
    assert trained.keys() == ref.keys() and "embed/token/embeddings" in trained
    for path, v in trained.items():
        np.testing.assert_allclose(v.numpy(), ref[path].numpy(), rtol=1e-4, atol=1e-6, err_msg=path)
    states = [(a, b) for a, b in zip(sectioned.non_trainable_variables, reference.non_trainable_variables)]
    assert len(states) == 7  # the dropout layers' seed generators: drawn as often in both
    for a, b in states:
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---------------------------------------------------------------- the data


def _take(ds, n):
    return [{k: v.numpy() for k, v in b.items()} for b in ds.take(n)]


def test_batches_are_next_character_windows_same_seed_same_batches(small_text):
    a, b = _take(small_text.train_batches(8, seed=3), 3), _take(small_text.train_batches(8, seed=3), 3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x["tokens"], y["tokens"])
    other = _take(small_text.train_batches(8, seed=4), 1)[0]
    assert not np.array_equal(a[0]["tokens"], other["tokens"])
    x = a[0]
    assert x["tokens"].shape == x["targets"].shape == (8, 16) and x["tokens"].dtype == np.int32
    np.testing.assert_array_equal(x["tokens"][:, 1:], x["targets"][:, :-1])


def test_train_and_validation_are_disjoint_ends_of_the_text(small_text):
    text = _numbered_lines(400)
    train, valid = small_text.decode(small_text.train_ids), small_text.decode(small_text.valid_ids)
    assert train + valid == text and len(valid) == round(len(text) * 0.25)
    last_train_line = int(train.rsplit("line ", 1)[1][:5])
    line_numbers = lambda s: {int(p[:5]) for p in s.split("line ")[1:] if p[:5].isdigit()}  # noqa: E731
    for batch in _take(small_text.train_batches(64, seed=0), 5):
        for row in batch["tokens"]:
            window = small_text.decode(row)
            assert window in train and max(line_numbers(window), default=0) <= last_train_line
    windows = small_text.eval_windows()
    assert all(small_text.decode(w) in valid for w in windows)
    assert min(min(line_numbers(small_text.decode(w)), default=400) for w in windows) >= last_train_line
    evaluated = np.concatenate([b["targets"].ravel() for b in _take(small_text.eval_batches(7), 100)])
    assert len(evaluated) == len(windows) * 16  # one ordered pass


def test_unknown_characters_map_to_the_unknown_id():
    source = TextSource("t", "abcabcabcabcabcabc" + "xyz" * 2, seq_len=4, valid_fraction=0.25)
    assert source.vocab == "abc" and source.vocab_size == 4
    assert UNKNOWN_ID in source.valid_ids and source.decode(source.encode("ab")) == "ab"


def test_training_iterator_resumes_from_a_checkpoint(small_text, tmp_path):
    it = iter(small_text.train_batches(4, seed=2))
    next(it), next(it)
    ckpt = tf.train.Checkpoint(data=it)
    path = ckpt.save(str(tmp_path / "it"))
    expected = next(it)["tokens"].numpy()
    fresh = iter(small_text.train_batches(4, seed=2))
    tf.train.Checkpoint(data=fresh).restore(path)
    np.testing.assert_array_equal(next(fresh)["tokens"].numpy(), expected)


def test_default_corpus_is_the_standard_library_and_deterministic():
    a, b = data.text(max_chars=100_000), data.text(max_chars=100_000)
    assert "standard library" in a.origin and a.model_args == {"vocab_size": a.vocab_size, "seq_len": 128}
    assert len(a.train_ids) + len(a.valid_ids) == 100_000 and a.metric == "bits_per_char"
    np.testing.assert_array_equal(a.train_ids, b.train_ids)
    assert "def " in a.decode(a.train_ids) and "import " in a.decode(a.train_ids)


def test_path_reads_a_file_or_a_folder_skipping_binary_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.md").write_text("goodbye moon\n" * 50)
    (tmp_path / "image.bin").write_bytes(bytes(range(256)))
    folder = data.text(path=str(tmp_path), seq_len=8)
    whole = folder.decode(folder.train_ids) + folder.decode(folder.valid_ids)
    assert len(whole) == 1250 and "hello" in whole and "goodbye" in whole and str(tmp_path) == folder.origin
    single = data.text(path=str(tmp_path / "a.txt"), seq_len=8)
    assert set(single.vocab) == set("hello world\n")


def test_bad_path_raises_one_clear_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02" * 100)
    (tmp_path / "binaries").mkdir()
    (tmp_path / "binaries" / "x.bin").write_bytes(b"\xff\xfe\x00" * 100)
    (tmp_path / "short.txt").write_text("tiny")
    cases = {
        "missing": (FileNotFoundError, "no such file or folder"),
        "empty.txt": (ValueError, "no text in it"),
        "blob.bin": (ValueError, "not a text file"),
        "binaries": (ValueError, "no text in it"),
        "short.txt": (ValueError, "fewer than seq_len"),
    }
    for name, (kind, message) in cases.items():
        with pytest.raises(kind, match=message) as err:
            data.text(path=str(tmp_path / name))
        assert str(tmp_path / name) in str(err.value) or name == "short.txt"


# ---------------------------------------------------------------- the runner


def _runner(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "runner", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)

@pytest.mark.slow  # ~13 s; the GPT engine is tested in process

def test_runner_smoke_run_reports_bits_per_char(tmp_path):
    out = tmp_path / "run"
    proc = _runner("model=gpt", "data=text", "train=smoke", "batch=8", "model.d_model=24", "model.num_layers=2",
                   "data.max_chars=200000", "data.eval_chars=4096", f"hydra.run.dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and metrics["exact"] is True and metrics["metric"] == "bits_per_char"
    assert metrics["bits_per_char"] == pytest.approx(metrics["eval_loss"] / math.log(2), rel=1e-5)
    assert 0 <= metrics["accuracy"] <= 1 and metrics["num_sections"] == 2
    from test_runner import events

    scalars, _ = events(out)
    for tag in ("loss/eval", "bits_per_char/eval", "accuracy/eval"):
        assert [step for step, _ in scalars[tag]] == [2, 4], tag
    np.testing.assert_allclose(scalars["bits_per_char/eval"][-1][1], metrics["bits_per_char"], rtol=1e-5)


def test_runner_reports_a_bad_text_path_as_one_config_error(tmp_path):
    from omegaconf import OmegaConf

    from runner.errors import ConfigError
    from runner.run.build import instantiate

    node = OmegaConf.create({"_target_": "models.data.text", "path": str(tmp_path / "nope.txt")})
    with pytest.raises(ConfigError, match="no such file or folder") as err:
        instantiate(node, "data")
    assert "\n" not in str(err.value) and str(tmp_path / "nope.txt") in str(err.value)


# ---------------------------------------------------------------- the quality bar


def bigram_bits_per_char(source: TextSource) -> float:
    """Bits per character of a character-bigram model (pair counts, add-one smoothing) fitted on the
    training split, on the targets evaluation reads (each predicted from the character before it)."""
    v = source.vocab_size
    counts = np.zeros((v, v))
    np.add.at(counts, (source.train_ids[:-1], source.train_ids[1:]), 1.0)
    probs = (counts + 1.0) / (counts.sum(axis=1, keepdims=True) + v)
    windows = source.eval_windows()
    return float(-np.log2(probs[windows[:, :-1], windows[:, 1:]]).mean())


@pytest.mark.slow
def test_default_gpt_beats_a_character_bigram_by_a_quarter(tmp_path):
    out = tmp_path / "run"
    proc = _runner("experiment=gpt_chars", "train.progress=log", f"hydra.run.dir={out}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    source = instantiate(OmegaConf.load(out / "config.yaml").data)  # the data the run trained on
    bigram = bigram_bits_per_char(source)
    gpt = metrics["bits_per_char"]
    train_seconds = metrics["median_step_seconds"] * metrics["step"]
    print(f"\ngpt: {gpt:.4f} bits/char after {metrics['step']} steps (~{train_seconds:.0f} s of steps); "
          f"character bigram (add-one): {bigram:.4f} bits/char; gpt/bigram = {gpt / bigram:.3f}")
    assert gpt <= 0.75 * bigram


def test_token_rows_are_refused_in_one_line_naming_keras_hub():
    from models.gpt import build_gpt

    with pytest.raises(ValueError, match=r"gpt trains on characters .*data=tokens, pad_id=0.* model=keras_hub"):
        build_gpt(vocab_size=50, seq_len=32, pad_id=0, unit="token")
    build_gpt(vocab_size=50, seq_len=32, d_model=12, num_layers=1, num_heads=2)  # text data: as before
