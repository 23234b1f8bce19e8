"""Model zoo: every model builds, cuts at its group boundaries, and trains sectioned exactly like whole."""

from __future__ import annotations

import os
import pathlib

import keras
import numpy as np
import pytest
import tensorflow as tf
from omegaconf import OmegaConf

import models
from models import data
from engine_nets import reference_train
from models.attention import BernoulliAttention, Classifier, bernoulli_gate
from models.resnet import ConvBNReLU, PoolDense, PreActBlock, PreActHead, PreActTail
from models.seq2seq import Decoder, Encoder
from sections import Engine

CONF = pathlib.Path(__file__).resolve().parents[1] / "conf"

TINY = {
    # 16 channels into each strided 1x1 projection: with fewer, oneDNN computes its filter gradient wrongly
    # (sections.backend.kernel_faults), for the plain reference as for the engine
    "resnet": dict(widths=[16, 16, 16], depths=[2, 2, 2], dropout=0.1),
    "mlp": dict(hidden=[16, 8]),
    "attention": dict(filters=[4, 8], hidden=8),
    "seq2seq": dict(embed_dim=8, units=16),
}
GROUP_CUTS = {
    "resnet": ["scale0", "scale1", "scale2", "final_pool"],
    "mlp": ["dense_1", "logits"],
    "attention": ["attention", "classifier"],
    "seq2seq": ["decoder"],
}


@pytest.fixture(scope="module")
def digits():
    return data.digits()


@pytest.fixture(scope="module")
def reversal():
    return data.sequences(source_buckets=[3, 6], target_buckets=[2, 5])


def _source(name, digits, reversal):
    return reversal if name == "seq2seq" else digits


def _build(name, source, seed=0, **overrides):
    return getattr(models, f"build_{name}")(**source.model_args, **{**TINY[name], **overrides}, seed=seed)


def _batches(source, n, batch_size=8):
    it = iter(source.train_batches(batch_size, seed=3))
    return [next(it) for _ in range(n)]


def _groups(net):
    return list(dict.fromkeys(b.group for b in net.blocks))


def _assert_same_variables(a, b, rtol=1e-4, atol=1e-5):
    assert [v.shape for v in a.variables] == [v.shape for v in b.variables]
    for va, vb in zip(a.variables, b.variables):
        np.testing.assert_allclose(np.asarray(va.numpy(), "float64"), np.asarray(vb.numpy(), "float64"),
                                   rtol=rtol, atol=atol, err_msg=va.path)


@pytest.mark.parametrize("name", list(TINY))
def test_same_seed_builds_identical_weights(name, digits, reversal):
    source = _source(name, digits, reversal)
    batch = _batches(source, 1)[0]
    a, b, c = _build(name, source), _build(name, source), _build(name, source, seed=1)
    for net in (a, b, c):
        net.build(batch)
    _assert_same_variables(a, b, rtol=0, atol=0)
    assert any(not np.array_equal(va.numpy(), vc.numpy()) for va, vc in zip(a.trainable_variables, c.trainable_variables))


@pytest.mark.parametrize("name", list(TINY))
def test_group_boundaries(name, digits, reversal):
    net = _build(name, _source(name, digits, reversal))
    assert _groups(net)[1:] == GROUP_CUTS[name]
    assert all(len(b.layer.trainable_variables) == 0 for b in net.blocks)  # built lazily, by data


@pytest.mark.parametrize("name", list(TINY))
def test_sectioned_steps_equal_whole_graph_steps(name, digits, reversal):
    """Cut at every group boundary, recompute policy, replay checked: each of 2 steps, taken from the same weights
    (and seed state), equals a plain tape loop's step, element by element. Each step starts where the reference's
    last ended, not where the engine's did: two free-running trajectories of the tiny ResNet separate after a step
    that agreed to 1.6e-5 of its update (its batch-norm betas' gradients nearly cancel, and ReLU kinks move), and
    Adam turned that into 1.1% of its update in some runs. Plain SGD, so the weights compare the gradients (Adam's
    first step is each gradient's sign); Adam over several steps is tests/test_engine_equivalence.py's."""
    source = _source(name, digits, reversal)
    batches = _batches(source, 2)
    sectioned, whole = _build(name, source), _build(name, source)
    whole.build(batches[0])
    engine = Engine(sectioned, keras.optimizers.SGD(0.1), sections=GROUP_CUTS[name], policy="recompute", check=True)
    for k, batch in enumerate(batches):
        if k:  # the reference's weights, batch-norm statistics and seed state, into the engine's own variables
            for ours, theirs in zip(sectioned.variables, whole.variables):
                ours.assign(theirs.numpy())
        loss = engine.train_step(batch)["loss"]
        reference = reference_train(whole, [batch], keras.optimizers.SGD(0.1))
        np.testing.assert_allclose(loss, reference[0], rtol=1e-4, atol=1e-5)
        _assert_same_variables(sectioned, whole)
    assert len(engine.sections) == len(GROUP_CUTS[name]) + 1


def test_split_resnet_cut_inside_residual_blocks_trains_like_the_whole_resnet(digits):
    """``split_blocks=True``: sections start at the second convolution of residual blocks (a two-tensor border);
    2 steps equal a plain tape loop over the unsplit ResNet of the same seed (same layers and initial weights).
    Plain SGD, element by element: Adam turns rounding noise in near-zero gradients into whole steps (3 of 2304
    elements of a kernel 4.4e-5 apart after two Adam steps)."""
    batches = _batches(digits, 2)
    split, whole = _build("resnet", digits, split_blocks=True), _build("resnet", digits)
    whole.build(batches[0])
    cuts = ["scale0/block_1/conv2", "scale1/block_0/conv2", "scale2"]
    engine = Engine(split, keras.optimizers.SGD(0.1), sections=cuts, check=True)
    losses = [engine.train_step(b)["loss"] for b in batches]
    reference = reference_train(whole, batches, keras.optimizers.SGD(0.1))
    np.testing.assert_allclose(losses, reference, rtol=1e-4, atol=1e-5)
    named = lambda net: [v for v in net.variables if "seed_generator" not in v.path]  # numbered process-wide
    ours = {v.path.replace("_conv2/conv2", "/conv2"): v for v in named(split)}
    theirs = {v.path: v for v in named(whole)}
    assert sorted(ours) == sorted(theirs) and len(split.blocks) == 2 * len(whole.blocks) - 2
    for path, v in theirs.items():
        np.testing.assert_allclose(ours[path].numpy(), v.numpy(), rtol=1e-4, atol=1e-5, err_msg=path)


def test_resnet_blocks_and_notebook_sections(digits):
    net = models.build_resnet(**digits.model_args)
    assert net.block_names == (["initial_conv"] + [f"scale0/block_{j}" for j in range(3)]
                               + [f"scale1/block_{j}" for j in range(3)] + [f"scale2/block_{j}" for j in range(5)]
                               + ["final_pool"])
    engine = Engine(net, keras.optimizers.Adam(1e-4), sections=["scale1", "scale2", "final_pool"])
    engine.build(_batches(digits, 1, batch_size=4)[0])
    rows = engine.partition_rows()
    assert [r["blocks"] for r in rows] == ["initial_conv .. scale0/block_2", "scale1/block_0 .. scale1/block_2",
                                           "scale2/block_0 .. scale2/block_4", "final_pool"]
    assert [r["input_border"] for r in rows] == ["4x28x28x1", "4x28x28x16", "4x14x14x32", "4x7x7x64"]


def test_resnet_projection_only_where_shape_changes(digits):
    net = models.build_resnet(**digits.model_args, dropout=0.1)
    net.build(_batches(digits, 1)[0])
    projected = [b.name for b in net.blocks if getattr(b.layer, "projection", None) is not None]
    assert projected == ["scale1/block_0", "scale2/block_0"]


@pytest.mark.parametrize("builder, kwargs, match", [
    (models.build_resnet, dict(widths=[16, 32], depths=[3]), "one entry per scale"),
    (models.build_resnet, dict(depths=[3, 0, 5]), r"depths\[1\]=0"),
    (models.build_resnet, dict(dropout=1.5), "dropout=1.5"),
    (models.build_resnet, dict(num_classes=1), "num_classes=1"),
    (models.build_resnet, dict(input_shape=(28, 28)), "height, width, channels"),
    (models.build_resnet, dict(vocab_size=13), "needs image data"),
    (models.build_mlp, dict(activation="softplus"), "activation='softplus'"),
    (models.build_mlp, dict(hidden=[]), "hidden=.*non-empty"),
    (models.build_attention, dict(filters="32"), "filters='32'"),
    (models.build_seq2seq, dict(), "vocab_size.*data=sequences"),
    (models.build_seq2seq, dict(vocab_size=13, cell="rnn"), "cell='rnn'"),
    (models.build_seq2seq, dict(vocab_size=13, num_classes=10), "needs sequence data"),
])
def test_bad_arguments_name_the_value(builder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        builder(**kwargs)


@pytest.mark.parametrize("layer", [
    ConvBNReLU(8, seed=3), PreActBlock(8, stride=2, dropout=0.2, seed=4), PoolDense(10, seed=5),
    PreActHead(8, stride=2, dropout=0.2, seed=4), PreActTail(8, seed=4),
    BernoulliAttention(seed=6), Classifier(10, 16, seed=9), Encoder(13, 8, 16, "lstm", seed=7), Decoder(13, 8, 16, "gru", seed=8),
])
def test_layer_config_round_trip(layer):
    clone = type(layer).from_config(layer.get_config())
    assert clone.get_config() == layer.get_config()


def test_bernoulli_gate_gradient_is_straight_through():
    features = tf.constant(np.random.default_rng(0).normal(size=(2, 3, 3, 4)), tf.float32)
    probs = tf.fill([2, 3, 3, 1], 0.5)
    noise = tf.constant(np.random.default_rng(1).uniform(size=(2, 3, 3, 1)), tf.float32)
    upstream = tf.constant(np.random.default_rng(2).normal(size=(2, 3, 3, 4)), tf.float32)
    with tf.GradientTape() as tape:
        tape.watch([features, probs])
        out = bernoulli_gate(features, probs, noise)
    d_features, d_probs = tape.gradient(out, [features, probs], output_gradients=upstream)
    sample = tf.cast(noise < probs, tf.float32)
    np.testing.assert_allclose(out, features * sample)
    np.testing.assert_allclose(d_features, upstream * sample)
    np.testing.assert_allclose(d_probs, tf.reduce_sum(upstream * features, -1, keepdims=True), rtol=1e-6)


def test_attention_sample_replays_from_seed_state_and_inference_uses_expectation():
    layer = BernoulliAttention(seed=1)
    x = tf.ones([2, 4, 4, 3])
    layer.build(x.shape)
    state = [(v, tf.identity(v.value)) for v in layer.non_trainable_variables]
    first = layer(x, training=True)
    with keras.StatelessScope(state_mapping=state):
        replay = layer(x, training=True)
    second = layer(x, training=True)
    np.testing.assert_array_equal(first, replay)
    assert not np.array_equal(first, second)
    assert set(np.unique(first.numpy())) <= {0.0, 1.0}
    np.testing.assert_allclose(layer(x, training=False), tf.sigmoid(layer.score(x)) * x)


def test_seq2seq_lstm_border_is_a_state_tuple(reversal):
    net = models.build_seq2seq(**reversal.model_args, embed_dim=8, units=16, cell="lstm")
    batch = _batches(reversal, 1)[0]
    state = net.blocks[0](batch["source"], batch, False)
    assert isinstance(state, tuple) and [s.shape.as_list() for s in state] == [[8, 16], [8, 16]]
    assert net.forward(batch, training=False).shape == (*batch["target_out"].shape, reversal.vocab_size)


def test_seq2seq_encoder_ignores_padding(reversal):
    net = models.build_seq2seq(**reversal.model_args, embed_dim=8, units=16)
    source = tf.constant([[5, 6, 7, 0, 0]])
    short = net.blocks[0](source[:, :3], {}, False)
    padded = net.blocks[0](source, {}, False)
    np.testing.assert_allclose(short, padded, rtol=1e-5, atol=1e-6)


def _seq2seq_bucket_batches(source_buckets, target_buckets):
    src = data.sequences(source_buckets=source_buckets, target_buckets=target_buckets)
    return src, list(src.eval_batches(4).take(len(source_buckets) * len(target_buckets)))

@pytest.mark.slow  # ~10 s; test_engine_traces_seq2seq_sections_once_per_bucket stays

def test_seq2seq_sections_trace_once_per_bucket_not_per_pair():
    """Compiled separately, the encoder traces per source length and the decoder per target length:
    2 + 3 graphs for 6 bucket pairs, where one compiled whole step traces 6."""
    src, batches = _seq2seq_bucket_batches([3, 5], [2, 4, 6])
    net = models.build_seq2seq(**src.model_args, embed_dim=8, units=16)
    encoder, decoder = net.blocks
    net.build(batches[0])

    @tf.function
    def encoder_backward(source, upstream):
        with tf.GradientTape() as tape:
            state = encoder(source, {}, True)
        return tape.gradient(state, encoder.layer.trainable_variables, output_gradients=upstream)

    @tf.function
    def decoder_fused(state, target_in, target_out):
        with tf.GradientTape() as tape:
            tape.watch(state)
            loss = net.loss(decoder(state, {"target_in": target_in}, True), {"target_out": target_out})
        return tape.gradient(loss, [state, *decoder.layer.trainable_variables])

    @tf.function
    def whole(batch):
        with tf.GradientTape() as tape:
            loss = net.loss(net.forward(batch, training=True), batch)
        return tape.gradient(loss, net.trainable_variables)

    encoder_forward = tf.function(lambda source: encoder(source, {}, True))
    for b in batches:
        state = encoder_forward(b["source"])
        d_state, *_ = decoder_fused(state, b["target_in"], b["target_out"])
        encoder_backward(b["source"], d_state)
        whole(b)
    sectioned = sum(f.experimental_get_tracing_count() for f in (encoder_forward, encoder_backward, decoder_fused))
    assert (encoder_forward.experimental_get_tracing_count(), encoder_backward.experimental_get_tracing_count(),
            decoder_fused.experimental_get_tracing_count()) == (2, 2, 3)
    assert sectioned == 2 * 2 + 3
    assert whole.experimental_get_tracing_count() == 6

@pytest.mark.slow  # ~4 s

@pytest.mark.parametrize("apply", ["at_end", "in_backward"])
def test_engine_traces_seq2seq_sections_once_per_bucket(apply):
    """Sections trace once per bucket of the fields they read; the update (sparse embedding gradients) once, at the
    end or per section. ``apply`` is explicit: with "auto" the count depends on what the process's other tests
    left (the update ran at the end in the full suite and per section alone)."""
    src, batches = _seq2seq_bucket_batches([3, 5], [2, 4, 6])
    net = models.build_seq2seq(**src.model_args, embed_dim=8, units=16)
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections=["decoder"], apply=apply)
    for b in batches:
        engine.train_step(b)
    counts = engine.trace_counts()
    assert (counts["section_0/first"], counts["section_0/rerun_backward"], counts["section_1/fused"]) == (2, 2, 3)
    applies = {k: v for k, v in counts.items() if k.startswith("apply")}
    assert applies == ({"apply": 1} if apply == "at_end" else
                       {"apply": 0, "apply/section_0": 1, "apply/section_1": 1}), applies


@pytest.mark.parametrize("name", list(TINY))
def test_model_yaml_instantiates_and_default_sections_resolve(name, digits, reversal):
    from hydra.utils import instantiate

    cfg = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    default_sections = cfg.pop("default_sections")
    net = instantiate(OmegaConf.merge(cfg, TINY[name]), **_source(name, digits, reversal).model_args)
    cut_names = {n for b in net.blocks for n in (b.name, b.group)}
    assert set(default_sections) <= cut_names
    assert net.metrics.keys() == {"accuracy"}


@pytest.mark.slow  # ~5 s
def test_compare_with_whole_handles_sparse_embedding_gradients():
    from sections import compare_with_whole

    src, batches = _seq2seq_bucket_batches([3], [4])
    net = models.build_seq2seq(**src.model_args, embed_dim=8, units=16)
    engine = Engine(net, keras.optimizers.Adam(1e-3), sections=["decoder"])
    report = compare_with_whole(engine, batches[0])
    assert report["exact"], report
