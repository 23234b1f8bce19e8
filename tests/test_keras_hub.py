"""model=keras_hub: keras-hub backbones (random weights) with a task head, cut between transformer layers."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import keras
import numpy as np

import pytest
import tensorflow as tf

from models.keras_hub import backbone_names, build_keras_hub, default_task
from sections import Engine

import keras_hub  # noqa: E402 - in the test extra: the fast suite must test it, not skip it

ROOT = Path(__file__).resolve().parents[1]
CONF = str(ROOT / "conf")
VOCAB, SEQ, BATCH = 50, 16, 4
TEXT_ARGS = {"num_layers": 2, "num_heads": 2, "hidden_dim": 32, "intermediate_dim": 64, "dropout": 0.0}
VIT_ARGS = {"patch_size": 4, "num_layers": 2, "num_heads": 2, "hidden_dim": 32, "mlp_dim": 64, "dropout_rate": 0.0,
            "attention_dropout": 0.0}


def token_batch(labels=None, seed=0):
    rng = np.random.default_rng(seed)
    windows = rng.integers(1, VOCAB, (BATCH, SEQ + 1)).astype("int32")
    if labels is None:
        return {"tokens": tf.constant(windows[:, :-1]), "targets": tf.constant(windows[:, 1:])}
    return {"tokens": tf.constant(windows[:, :-1]), "label": tf.constant(rng.integers(0, 3, labels), tf.int32)}


def image_batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.normal(size=(BATCH, 8, 8, 1)), tf.float32),
            "label": tf.constant(rng.integers(0, 10, BATCH), tf.int32)}


GPT2 = dict(name="GPT2Backbone", args=TEXT_ARGS, vocab_size=VOCAB, seq_len=SEQ)
BERT = dict(name="BertBackbone", args=TEXT_ARGS, vocab_size=VOCAB, seq_len=SEQ, num_classes=3, labels="sequence")
VIT = dict(name="ViTBackbone", args=VIT_ARGS, num_classes=10, input_shape=(8, 8, 1))


# ---------------------------------------------------------------- exact against a plain GradientTape step


def twins(kwargs):
    """Two networks of the same backbone and head with identical variables (seed-generator states included)."""
    keras.backend.clear_session()  # auto-named ops (BERT's get_item) are named from a fresh count, as in the runner
    keras.utils.set_random_seed(1)
    ref = build_keras_hub(**kwargs)
    keras.backend.clear_session()
    keras.utils.set_random_seed(2)
    net = build_keras_hub(**kwargs)
    a, b = ref.source_model.variables, net.source_model.variables
    assert [v.shape for v in a] == [v.shape for v in b]
    for v, w in zip(a, b):
        w.assign(v)
    return ref, net


def flat(variables):
    return np.concatenate([np.asarray(v.numpy(), "float64").ravel() for v in variables])


@pytest.mark.parametrize("kwargs,sections,batch", [
    (GPT2, ["transformer_layer_0", "transformer_layer_1"], token_batch()),
    (BERT, ["transformer_layer_0", "get_item"], token_batch(labels=BATCH)),
    (VIT, ["transformer_block_1"], image_batch()),
    pytest.param({**GPT2, "args": {**TEXT_ARGS, "dropout": 0.1}}, ["transformer_layer_0", "transformer_layer_1"],
                 token_batch(), marks=pytest.mark.slow),  # 5 s; dropout masks replayed in the re-run (8e-8 measured)
], ids=["gpt2-decoder", "bert-encoder", "vit", "gpt2-dropout"])
def test_a_sectioned_step_equals_a_plain_tape_step(kwargs, sections, batch):
    ref, net = twins(kwargs)
    model = ref.source_model
    start = flat(model.variables)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = ref.loss(model(batch[ref.inputs], training=True), batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
    engine = Engine(net, keras.optimizers.SGD(0.1, momentum=0.9), sections=sections)
    for _ in range(2):
        engine.train_step(batch)
    assert [s.block_names[-1] for s in engine.sections[:-1]] == sections
    w_ref, w_sect = flat(model.variables), flat(net.source_model.variables)
    moved = np.linalg.norm(w_ref - start)
    assert moved > 0
    assert np.linalg.norm(w_sect - w_ref) / moved < 1e-4


# ---------------------------------------------------------------- the flat model, heads and cut names


@pytest.mark.parametrize("kwargs,cuts", [
    (GPT2, ["transformer_layer_0", "transformer_layer_1", "layer_norm"]),
    (BERT, ["transformer_layer_0", "transformer_layer_1", "get_item", "pooled_dense"]),
    (VIT, ["vit_patching_and_embedding", "dropout", "transformer_block_1", "transformer_block_2", "ln", "pool"]),
], ids=["gpt2", "bert", "vit"])
def test_cut_points_are_between_transformer_layers_and_the_flat_model_is_the_backbone(kwargs, cuts):
    keras.backend.clear_session()  # auto-named ops (BERT's get_item) are named from a fresh count, as in the runner
    keras.utils.set_random_seed(0)
    net = build_keras_hub(**kwargs)
    assert net.cut_points == cuts
    model, backbone = net.source_model, net.backbone
    if "input_shape" in kwargs:
        x = image_batch()["image"]
        want = model.get_layer("classifier")(model.get_layer("pool")(backbone(x)))
    else:
        x = token_batch()["tokens"]
        feeds = {"token_ids": x, "padding_mask": tf.ones_like(x)}
        if "segment_ids" in [t.name for t in backbone.inputs]:
            feeds["segment_ids"] = tf.zeros_like(x)
        out = backbone(feeds)
        head = model.get_layer("lm_head" if kwargs["name"] == "GPT2Backbone" else "classifier")
        want = head(out["pooled_output"] if isinstance(out, dict) else out)
    np.testing.assert_array_equal(model(x).numpy(), want.numpy())


def test_default_task_by_backbone_kind():
    assert default_task(keras_hub.models.GPT2Backbone) == "causal_lm"
    assert default_task(keras_hub.models.GemmaBackbone) == "causal_lm"
    assert default_task(keras_hub.models.BertBackbone) == "sequence_classification"
    assert default_task(keras_hub.models.ViTBackbone) == "image_classification"
    assert {"GPT2Backbone", "BertBackbone", "ViTBackbone"} <= set(backbone_names())


def test_causal_lm_loss_leaves_out_padding():
    keras.utils.set_random_seed(0)
    net = build_keras_hub(**GPT2, pad_id=0, unit="token")
    batch = token_batch()
    tokens, targets = batch["tokens"].numpy(), batch["targets"].numpy()
    tokens[:, 10:], targets[:, 9:] = 0, 0  # right padding: the last real target is at position 8
    logits = net.source_model(tokens)
    ce = tf.nn.sparse_softmax_cross_entropy_with_logits(targets[:, :9], logits[:, :9]).numpy()
    loss = net.loss(logits, {"tokens": tokens, "targets": targets})
    np.testing.assert_allclose(float(loss), ce.mean(), rtol=1e-6)
    assert set(net.metrics) == {"bits_per_token", "accuracy"}
    # the padding mask reaches the attention: a padded position's output ignores what the padding holds
    other = tokens.copy()
    other[:, 12:] = 7
    masked = build_keras_hub(**GPT2, pad_id=7, unit="token")
    assert masked.source_model.get_layer("padding_mask_of_tokens")(other).numpy()[:, 12:].sum() == 0


def test_token_classification_and_decoder_sequence_classification():
    keras.utils.set_random_seed(0)
    net = build_keras_hub(**{**BERT, "labels": "token"}, task="token_classification")
    assert net.source_model.output.shape[1:] == (None, 3)
    batch = {"tokens": token_batch()["tokens"], "label": tf.zeros((BATCH, SEQ), tf.int32)}
    np.testing.assert_allclose(float(net.loss(net.source_model(batch["tokens"]), batch)), np.log(3), rtol=0.2)
    gpt = build_keras_hub(**{**GPT2, "num_classes": 3, "labels": "sequence"}, task="sequence_classification", pad_id=0)
    pool = gpt.source_model.get_layer("pool")
    x = tf.constant([[[1.0], [2.0], [3.0]], [[4.0], [5.0], [6.0]]])
    assert pool(x, tf.constant([[5, 5, 0], [5, 5, 5]])).numpy().ravel().tolist() == [2.0, 6.0]  # last real token


# ---------------------------------------------------------------- one-line errors


@pytest.mark.parametrize("kwargs,message", [
    ({**GPT2, "name": "GPT2Backbon"}, "model.name='GPT2Backbon' is not a keras-hub backbone class; did you mean "
                                      "GPT2Backbone"),
    ({**GPT2, "args": {"num_layers": 2}}, "model.args: GPT2Backbone needs num_heads, hidden_dim, intermediate_dim: "
                                         "give model.args={num_heads: ..., hidden_dim: ..., intermediate_dim: ...}"),
    ({**GPT2, "args": {**TEXT_ARGS, "layers": 2}}, "model.args: GPT2Backbone takes no layers; its arguments: "),
    ({**GPT2, "args": {**TEXT_ARGS, "vocabulary_size": 20}}, "model.args.vocabulary_size=20: the data has 50 token "
                                                            "ids (0..49); GPT2Backbone needs vocabulary_size >= 50."),
    ({**GPT2, "args": {**TEXT_ARGS, "max_sequence_length": 8}}, "model.args.max_sequence_length=8: the data's "
                                                               "windows are 16 tokens long"),
    ({**GPT2, "task": "translation"}, "model.task='translation': allowed: causal_lm, sequence_classification, "
                                      "token_classification, image_classification"),
    ({**GPT2, "task": "sequence_classification"}, "task=sequence_classification needs sequence labels; the data has "
                                                  "next-token targets, no labels: set model.task=causal_lm"),
    ({**VIT, "name": "GPT2Backbone", "args": TEXT_ARGS}, "task=causal_lm needs token data (data=text, data=tokens); "
                                                         "got image data"),
    ({**GPT2, "name": "ViTBackbone", "args": VIT_ARGS}, "task=image_classification needs image data; got token data"),
    ({**VIT, "args": {**VIT_ARGS, "image_shape": [16, 16, 1]}}, "model.args.image_shape=[16, 16, 1]: the data's "
                                                               "images are [8, 8, 1]"),
    ({**GPT2, "preset": "gpt2_base_en"}, "model.preset='gpt2_base_en': not an existing local folder; give a folder "
                                         "written by backbone.save_to_preset(dir) (presets are never downloaded)."),
    ({**GPT2, "targets": "float"}, "only class labels and tokens are supported"),
], ids=["name", "missing-args", "unknown-arg", "vocab", "seq-len", "task", "task-data", "text-on-images",
        "vision-on-text", "image-shape", "preset", "targets"])
def test_bad_input_is_one_line_naming_the_value(kwargs, message):
    with pytest.raises(ValueError) as err:
        build_keras_hub(**kwargs)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_missing_keras_hub_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # import keras_hub raises ImportError
    with pytest.raises(ValueError, match=r"^model=keras_hub needs the keras-hub package, which is not installed: "
                                         r"pip install -e '\.\[hub\]'"):
        build_keras_hub(**GPT2)


def test_a_local_preset_brings_its_weights(tmp_path):
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=VOCAB, max_sequence_length=SEQ, **TEXT_ARGS)
    backbone.save_to_preset(str(tmp_path / "tiny"))
    net = build_keras_hub(name=None, preset=str(tmp_path / "tiny"), vocab_size=VOCAB, seq_len=SEQ)
    table = net.source_model.get_layer("token_embedding").embeddings
    np.testing.assert_array_equal(table.numpy(), backbone.token_embedding.embeddings.numpy())
    with pytest.raises(ValueError, match="the data has 60 token ids"):
        build_keras_hub(name="GPT2Backbone", preset=str(tmp_path / "tiny"), vocab_size=60, seq_len=SEQ)


# ---------------------------------------------------------------- the runner


def composed(*overrides):
    from hydra import compose, initialize_config_dir

    from runner.config.schema import register

    register()
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", return_hydra_config=True, overrides=list(overrides))


HUB = ["model=keras_hub", "model.args={num_layers: 2, num_heads: 2, hidden_dim: 32, intermediate_dim: 64, dropout: 0.0}",
       "data=text", "data.seq_len=16", "data.max_chars=20000", "data.eval_chars=64", "batch=4", "train=smoke",
       "train.steps=2"]


def run_in_process(tmp_path, *overrides):
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from runner.app import run

    cfg = composed(*overrides)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg.hydra
    run(cfg, tmp_path)
    return json.loads((tmp_path / "metrics.json").read_text())


@pytest.mark.parametrize("sections", [pytest.param("2", marks=pytest.mark.slow),  # 5-7 s; names cut the same model
                                      "[transformer_layer_0,transformer_layer_1]"], ids=["int", "names"])
def test_the_runner_trains_a_gpt2_causal_lm_on_text(sections, tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    # exactness against plain steps: test_a_sectioned_step_equals_a_plain_tape_step (the runner's check costs 2 s)
    metrics = run_in_process(tmp_path, *HUB, f"data.path={tmp_path / 'text.txt'}", "train.verify_exact=false",
                             "train.eval_every=0", f"sections={sections}")
    assert metrics["step"] == 2 and metrics["metric"] == "bits_per_char" and np.isfinite(metrics["bits_per_char"])
    assert len(metrics["forward_runs_per_section"]) == (2 if sections == "2" else 3)
    model = keras.models.load_model(tmp_path / "model.keras")
    assert model.get_layer("transformer_layer_1") is not None


@pytest.mark.slow  # 7-12 s; the ViT head steps exactly in test_a_sectioned_step_equals_a_plain_tape_step
def test_the_runner_trains_a_vit_image_classifier(tmp_path):
    metrics = run_in_process(tmp_path, "model=keras_hub", "model.name=ViTBackbone",
                             "model.args={patch_size: 4, num_layers: 2, num_heads: 2, hidden_dim: 32, mlp_dim: 64}",
                             "data=synthetic", "data.image_shape=[8,8,1]", "data.train_size=32", "data.test_size=8",
                             "batch=4", "train=smoke", "train.steps=2", "sections=[transformer_block_1]")
    assert metrics["step"] == 2 and metrics["exact"] is True and metrics["metric"] == "accuracy"


def test_help_lists_the_cut_names(tmp_path, monkeypatch):
    from runner.help import cut_names_section

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    composed()  # the runner's structured configs registered, as the runner's --help has them
    section = cut_names_section([*HUB, "--help"], CONF)
    lines = section.splitlines()
    # the model's name takes Keras's process-wide counter (gpt2_backbone_1 after another GPT-2 in this process)
    assert re.fullmatch(r"== Cut names of gpt2_backbone(_\d+)? \(GPT2Backbone\) \(sections=\[name, \.\.\.\] ends a "
                        r"section with that layer\) ==", lines[0]), section
    assert lines[1:3] == ["3 allowed (sections=<int> and sections=auto choose among them too):",
                          "  transformer_layer_0, transformer_layer_1, layer_norm"], section


def test_the_runner_names_a_wrong_cut_and_a_wrong_vocabulary_in_one_line():
    from runner.errors import ConfigError
    from runner.run.build import instantiate, make_engine, make_network

    cfg = composed(*HUB)
    data = instantiate(cfg.data, "data")
    network = make_network(cfg, data)
    with pytest.raises(ConfigError) as err:  # the engine's own check, worded for the config
        make_engine(cfg, data, network, ["transformer_layer_7"], None, 2)
    assert "'transformer_layer_7'" in str(err.value) and "transformer_layer_0" in str(err.value)
    cfg = composed(*HUB, "+model.args.vocabulary_size=10")
    with pytest.raises(ConfigError) as err:
        make_network(cfg, data)
    text = str(err.value)
    assert "model.args.vocabulary_size=10: the data has" in text and "\n" not in text, text


# ---------------------------------------------------------------- data=tokens


def token_file(tmp_path, labels=None):
    rng = np.random.default_rng(0)
    x = rng.integers(1, 40, (20, SEQ + 1)).astype("int32")
    x[::2, 12:] = 0  # right padding
    if labels is None:
        np.save(tmp_path / "ids.npy", x)
        return tmp_path / "ids.npy"
    y = rng.integers(0, 3, 20) if labels == "sequence" else rng.integers(0, 4, x.shape)
    np.savez(tmp_path / "ids.npz", x=x, y=y)
    return tmp_path / "ids.npz"


def test_token_arrays_are_next_token_windows_or_labelled_rows(tmp_path):
    from models.data import tokens

    lm = tokens(str(token_file(tmp_path)), pad_id=0)
    assert lm.model_args == {"vocab_size": 40, "seq_len": SEQ, "pad_id": 0, "unit": "token"}
    batch = next(iter(lm.train_batches(4, seed=0)))
    np.testing.assert_array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    assert sum(len(b["tokens"]) for b in lm.eval_batches(4)) == lm.test_size == 2
    labelled = tokens(str(token_file(tmp_path, "token")), y_key="y")
    assert labelled.model_args["labels"] == "token" and labelled.model_args["num_classes"] == 4
    batch = next(iter(labelled.train_batches(4)))
    assert batch["tokens"].shape == batch["label"].shape == (4, SEQ + 1)


@pytest.mark.parametrize("kwargs,message", [
    ({"vocab_size": 30}, "data.vocab_size=30: the largest token id in data.path is 39; give a vocab_size > 39"),
    ({"pad_id": 40}, "data.pad_id=40: must be a token id in 0..39, or null (no padding)."),
    ({"y_key": "y"}, "data.y_key='y': labels come from an .npz"),
    ({"test_fraction": 0.01}, "data.test_fraction=0.01: holds out 0 of 20 rows"),
])
def test_bad_token_data_is_one_line(tmp_path, kwargs, message):
    from models.data import tokens

    with pytest.raises(ValueError) as err:
        tokens(str(token_file(tmp_path)), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_model_is_sized_by_the_token_data(tmp_path):
    from models.data import tokens

    data = tokens(str(token_file(tmp_path, "sequence")), y_key="y", pad_id=0)
    net = build_keras_hub("BertBackbone", TEXT_ARGS, **data.model_args)
    assert net.backbone.vocabulary_size == 40 and net.backbone.max_sequence_length == SEQ + 1
    assert net.source_model.output.shape[-1] == 3 and set(net.metrics) == {"accuracy"}
    with pytest.raises(ValueError, match=r"^keras_hub GPT2Backbone task=causal_lm needs next-token targets; the data "
                                         r"has sequence labels: set model\.task=sequence_classification"):
        build_keras_hub("GPT2Backbone", TEXT_ARGS, **data.model_args)


@pytest.mark.slow  # ~7 s; the BERT head steps exactly in test_a_sectioned_step_equals_a_plain_tape_step
def test_the_runner_trains_a_bert_classifier_on_token_arrays(tmp_path):
    path = token_file(tmp_path, "sequence")
    metrics = run_in_process(tmp_path, "model=keras_hub", "model.name=BertBackbone", f"model.args={HUB[1][11:]}",
                             "data=tokens", f"data.path={path}", "data.y_key=y", "data.pad_id=0", "data.test_fraction=0.2",
                             "batch=4", "train=smoke", "train.steps=2", "sections=[transformer_layer_0]")
    assert metrics["step"] == 2 and metrics["exact"] is True and metrics["metric"] == "accuracy"


def test_a_sweep_on_token_arrays_minimizes_bits_and_maximizes_accuracy():
    from omegaconf import OmegaConf

    from runner.config.direction import metric_direction

    for y_key, direction in ((None, "minimize"), ("y", "maximize")):
        root = OmegaConf.create({"data": {"_target_": "models.data.tokens", "y_key": y_key}})
        assert metric_direction(_root_=root) == direction


# ---------------------------------------------------------------- every cut, every policy (issue 38, item 4)
GEMMA = dict(name="GemmaBackbone", args={"num_layers": 2, "num_query_heads": 4, "num_key_value_heads": 2,
                                         "hidden_dim": 32, "intermediate_dim": 64, "head_dim": 8, "dropout": 0.0},
             vocab_size=VOCAB, seq_len=SEQ)
BACKBONES = {"gpt2": (GPT2, token_batch), "bert": (BERT, lambda: token_batch(labels=BATCH)),
             "gemma": (GEMMA, token_batch), "vit": (VIT, image_batch)}
LAYER_NAMES = re.compile(r"transformer_(layer|block)_\d+|decoder_block_\d+")


def _tape_gradient(net, batch) -> np.ndarray:
    model = net.source_model
    with tf.GradientTape() as tape:
        loss = net.loss(model(batch[net.inputs], training=True), batch)
    return _dense(tape.gradient(loss, model.trainable_variables))


def _dense(grads) -> np.ndarray:
    return np.concatenate([np.asarray(tf.convert_to_tensor(g).numpy(), "float64").ravel() for g in grads])


def _rounding_sensitivity(net, batch, want) -> float:
    """The relative change of the plain step's gradient when every weight moves by one unit of float32 rounding
    (a random sign each), as the exactness report measures it."""
    variables = net.source_model.trainable_variables
    saved = [v.numpy() for v in variables]
    rng = np.random.default_rng(0)
    for v, value in zip(variables, saved):
        v.assign(value * (1 + 2.0**-23 * rng.choice([-1.0, 1.0], size=value.shape)).astype(value.dtype))
    moved = _tape_gradient(net, batch)
    for v, value in zip(variables, saved):
        v.assign(value)
    return float(np.linalg.norm(moved - want) / np.linalg.norm(want))


def _every_cut_every_policy():
    cases = []
    for kind, (kwargs, _) in BACKBONES.items():
        keras.backend.clear_session()
        cuts = [c for c in build_keras_hub(**kwargs).cut_points if LAYER_NAMES.fullmatch(c)]
        cases += [pytest.param(kind, cut, policy, id=f"{kind}-{cut}-{policy}")
                  for cut in cuts for policy in ("recompute", "store", "recreate")]
    return cases


@pytest.mark.slow  # 24 cases, about 1-2 s each
@pytest.mark.parametrize("kind,cut,policy", _every_cut_every_policy())
def test_every_cut_between_transformer_layers_and_every_policy_equals_a_plain_tape_step(kind, cut, policy):
    """Each backbone cut after each of its transformer layers, each policy: the engine's gradient equals a plain
    GradientTape step's on a twin model (its own layers, its weights copied) within 3x that step's own rounding
    sensitivity (float32), over the whole gradient as one vector."""
    kwargs, make = BACKBONES[kind]
    batch = make()
    ref, net = twins(kwargs)
    want = _tape_gradient(ref, batch)
    sensitivity = _rounding_sensitivity(ref, batch, want)
    engine = Engine(net, keras.optimizers.SGD(0.1), sections=[cut], policy=policy)
    _, grads = engine.gradients(batch)
    assert [s.block_names[-1] for s in engine.sections[:-1]] == [cut]
    by_variable = {id(v): g if g is not None else tf.zeros_like(v) for g, v in zip(grads, net.trainable_variables)}
    got = _dense([by_variable[id(v)] for v in net.source_model.trainable_variables])
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert sensitivity > 0 and error <= 3 * sensitivity, (error, sensitivity)
