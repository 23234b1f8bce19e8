"""Lean attention (``sections.backend.attention``): Keras's ``MultiHeadAttention`` step, dropout included, with no
``batch x heads x n x n`` tensor in the forward or the backward; the runner's ``gpt`` too.

References are fresh Keras layers run outside the lean scope, with the lean layer's weights and seed copied in.
keras-hub's attention: tests/test_lean_attention_hub.py (this file imports no keras-hub, so the slow check on the
lowest supported Keras runs it).
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

from sections.backend import attention as lean_attention_module
from sections.backend.lean import lean_scope

B, T, D, N = 2, 48, 16, 4


def _vector(tensors) -> np.ndarray:
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


def _mha(rate, dtype, seed=7):
    layer = keras.layers.MultiHeadAttention(N, D // N, dropout=rate, seed=seed, dtype=dtype)
    x = tf.zeros([B, T, D], dtype or "float32")
    layer(x, x)
    return layer


def _step(layer, x, lean, mask, causal, jit=False):
    @tf.function(jit_compile=jit)
    def run(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with lean_scope(lean):
                y = layer(x, x, attention_mask=mask, use_causal_mask=causal, training=True)
            loss = tf.reduce_sum(y * y)
        return y, tape.gradient(loss, [x, *layer.trainable_variables])

    return run(x)


def _padding_mask():
    # the second sequence's last 10 positions are padding: their rows are fully masked
    valid = np.ones([B, T], bool)
    valid[1, T - 10:] = False
    return tf.constant(valid[:, None, :] & valid[:, :, None])


def _causal_tensor_mask():
    # a causal mask given as a tensor (as keras-hub's decoders pass it), every sequence's last 5 keys padding:
    # each block's products stop at its last attended key, and the last block's rows past it are fully masked
    valid = np.ones([B, T], bool)
    valid[:, T - 5:] = False
    return tf.constant(np.tril(np.ones([T, T], bool))[None] & valid[:, None, :])


def _cases():
    """float32: every masking with and without dropout; float64: both of Keras's paths (the rest slow, for time)."""
    for dtype, tolerance in (("float32", 3e-6), ("float64", 1e-12)):
        for masking in ("causal", "causal-tensor", "padding", "none"):
            for rate in (0.0, 0.2):
                fast = dtype == "float32" or (masking, rate) in (("causal", 0.2), ("padding", 0.0),
                                                                 ("causal-tensor", 0.2))
                yield pytest.param(dtype, tolerance, rate, masking, marks=() if fast else pytest.mark.slow,
                                   id=f"{masking}-{'dropout' if rate else 'no-dropout'}-{dtype}")


@pytest.mark.parametrize("dtype,tolerance,rate,masking", list(_cases()))
def test_a_step_equals_keras_multi_head_attention(monkeypatch, float32_after, dtype, tolerance, rate, masking):
    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 13)  # 4 blocks, the last one short
    keras.config.set_floatx(dtype)
    x = tf.random.stateless_normal([B, T, D], seed=[1, 2], dtype=dtype)
    mask = {"padding": _padding_mask(), "causal-tensor": _causal_tensor_mask()}.get(masking)
    reference, lean = _mha(rate, dtype), _mha(rate, dtype)
    for a, b in zip(reference.weights, lean.weights):
        b.assign(a)
    before = lean_attention_module.attention_traces()
    y_ref, g_ref = _step(reference, x, False, mask, masking == "causal")
    y, g = _step(lean, x, True, mask, masking == "causal")
    after = lean_attention_module.attention_traces()
    assert after["forward"] == before["forward"] + 1 and after["backward"] == before["backward"] + 1
    assert np.max(np.abs(y.numpy() - y_ref.numpy())) <= tolerance * np.max(np.abs(y_ref.numpy()))
    ref, got = _vector(g_ref), _vector(g)
    assert np.linalg.norm(got - ref) <= tolerance * np.linalg.norm(ref)
    if rate:  # the seed generators advanced alike: the next step draws the same masks too
        assert np.array_equal(reference._dropout_layer.seed_generator.state.numpy(),
                              lean._dropout_layer.seed_generator.state.numpy())


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_block_masks_are_slices_of_the_mask_keras_dropout_draws_for_the_whole_tensor(dtype):
    seed = tf.constant([5, 9], tf.int32)
    shape = [2, 3, 10, 7]
    whole = tf.nn.experimental.stateless_dropout(tf.ones(shape, dtype), 0.3, seed=seed)
    blocks = [lean_attention_module._keep(0.3, seed, tf.constant([2, 10, 3, 4]), 7, t0, min(10, t0 + 4), tf.as_dtype(dtype))
              for t0 in range(0, 10, 4)]
    kept = tf.concat(blocks, axis=2)
    assert np.array_equal(kept.numpy(), whole.numpy() != 0)
    scaled = tf.cast(kept, dtype) * tf.constant(1 / 0.7, dtype)
    assert np.array_equal(scaled.numpy(), whole.numpy())


@pytest.mark.parametrize("keys", [7, 8, 13, 2048])
def test_the_keep_mask_kept_for_the_backward_is_one_bit_a_weight_and_unpacks_to_itself(keys):
    kept = tf.random.stateless_uniform([2, 3, 5, keys], seed=[1, keys]) >= 0.3
    packed = lean_attention_module._pack(kept)
    assert packed.dtype == tf.uint8 and packed.shape == [2, 3, 5, -(-keys // 8)]
    assert np.array_equal(lean_attention_module._unpack(packed, keys).numpy(), kept.numpy())


def _shapes(graph_def) -> set:
    """Every op output shape in a GraphDef and its function library (forward and backward functions)."""
    shapes = set()
    nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
    for node in nodes:
        for shape in node.attr["_output_shapes"].list.shape:
            shapes.add(tuple(d.size for d in shape.dim))
    return shapes


@pytest.mark.parametrize("lean", [False, True], ids=["keras", "lean"])
def test_no_batch_heads_n_by_n_tensor_in_the_step(monkeypatch, lean):
    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 16)
    layer = _mha(0.1, "float32")
    x = tf.random.stateless_normal([B, T, D], seed=[3, 4])

    @tf.function
    def run(x):
        with tf.GradientTape() as tape:
            with lean_scope(lean):
                y = layer(x, x, use_causal_mask=True, training=True)
        return tape.gradient(tf.reduce_sum(y * y), layer.trainable_variables)

    graph = run.get_concrete_function(x).graph.as_graph_def(add_shapes=True)
    whole = (B, N, T, T) in _shapes(graph)
    assert whole is not lean  # Keras's own step holds the whole scores; the lean one at most a block's
    if lean:
        assert (B, N, 16, T) in _shapes(graph)


def test_attention_scores_asked_for_run_keras_own():
    layer = _mha(0.0, "float32")
    x = tf.random.stateless_normal([B, T, D], seed=[3, 4])

    @tf.function
    def run(x):
        with lean_scope(True):
            return layer(x, x, return_attention_scores=True, training=True)

    before = lean_attention_module.attention_traces()["forward"]
    out, scores = run(x)
    assert scores.shape == (B, N, T, T)
    assert lean_attention_module.attention_traces()["forward"] == before


def test_the_runner_gpt_attention_runs_lean_and_equals_its_own(monkeypatch):
    from models.gpt import CausalSelfAttention

    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 10)
    layers = [CausalSelfAttention(D, N, dropout=0.1, seed=3) for _ in range(2)]
    x = tf.random.stateless_normal([B, T, D], seed=[5, 6])
    for layer in layers:
        layer(x)
    for a, b in zip(layers[0].weights, layers[1].weights):
        b.assign(a)

    def step(layer, lean):
        @tf.function
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                with lean_scope(lean):
                    y = layer(x, training=True)
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, [x, *layer.trainable_variables])
        return run(x)

    before = lean_attention_module.attention_traces()["backward"]
    y_ref, g_ref = step(layers[0], False)
    y, g = step(layers[1], True)
    assert lean_attention_module.attention_traces()["backward"] == before + 1
    assert np.max(np.abs(y.numpy() - y_ref.numpy())) <= 3e-6 * np.max(np.abs(y_ref.numpy()))
    ref, got = _vector(g_ref), _vector(g)
    assert np.linalg.norm(got - ref) <= 3e-6 * np.linalg.norm(ref)


@pytest.mark.parametrize("policy,tolerance", [("mixed_float16", 2e-3), ("mixed_bfloat16", 1.6e-2)])
def test_under_mixed_precision_a_step_equals_keras_within_half_precision_rounding(monkeypatch, float32_after, policy,
                                                                                   tolerance):
    """Tolerance: two units of the half type's rounding (float16 2^-10, bfloat16 2^-7) over the whole gradient."""
    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 13)
    keras.config.set_dtype_policy(policy)
    x = tf.random.stateless_normal([B, T, D], seed=[1, 2])
    reference, lean = _mha(0.2, None), _mha(0.2, None)
    for a, b in zip(reference.weights, lean.weights):
        b.assign(a)
    y_ref, g_ref = _step(reference, x, False, None, True)
    y, g = _step(lean, x, True, None, True)
    assert y.dtype == y_ref.dtype == tf.as_dtype(policy.split("_")[1])
    ref, got = _vector(g_ref), _vector(g)
    assert np.linalg.norm(got - ref) <= tolerance * np.linalg.norm(ref)


def test_a_blocks_products_stop_at_the_last_key_any_of_its_rows_attends_to():
    mask = _causal_tensor_mask()[:, tf.newaxis]  # [B, 1, T, T]
    explicit = lean_attention_module.SimpleNamespace(style="explicit", causal=False, has_mask=True, static=False)
    reach = [int(lean_attention_module._reach(explicit, mask[:, :, t0:t1], t1, T))
             for t0, t1 in lean_attention_module._blocks(T, 13)]
    assert reach == [13, 26, 39, T - 5]  # the last block: rows 39..47 attend to keys up to 42 only
    fused = lean_attention_module.SimpleNamespace(style="fused", causal=False, has_mask=True, static=False)
    assert lean_attention_module._reach(fused, mask[:, :, :13], 13, T) is None  # a fully masked row reads every key
    causal = lean_attention_module.SimpleNamespace(style="fused", causal=True, has_mask=False, static=False)
    assert [lean_attention_module._reach(causal, None, t1, T) for t1 in (13, T)] == [13, None]


@pytest.mark.parametrize("masking", ["causal-tensor", pytest.param("causal", marks=pytest.mark.slow)])  # ~6 s each
def test_under_xla_a_step_with_dropout_equals_keras_and_a_masks_blocks_read_every_key(monkeypatch, masking):
    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 13)
    x = tf.random.stateless_normal([B, T, D], seed=[1, 2])
    mask = _causal_tensor_mask()
    for masking, causal in [(mask, False)] if masking == "causal-tensor" else [(None, True)]:
        reference, lean = _mha(0.2, None), _mha(0.2, None)
        for a, b in zip(reference.weights, lean.weights):
            b.assign(a)
        before = lean_attention_module.attention_traces()
        y_ref, g_ref = _step(reference, x, False, masking, causal, jit=True)  # XLA's own Philox stream
        y, g = _step(lean, x, True, masking, causal, jit=True)  # draws sized when traced: XLA compiles them
        assert lean_attention_module.attention_traces()["backward"] == before["backward"] + 1
        ref, got = _vector(g_ref), _vector(g)
        assert np.linalg.norm(got - ref) <= 3e-6 * np.linalg.norm(ref)
        assert np.max(np.abs(y.numpy() - y_ref.numpy())) <= 3e-6 * np.max(np.abs(y_ref.numpy()))
    q, k, v = (tf.random.stateless_normal([B, T, N, D // N], seed=[i, 3]) for i in range(3))

    def lean_attention():
        return lean_attention_module.attention(q, k, v, scale=0.5, mask=mask, style="explicit", block=13)

    eager = lean_attention()  # its blocks stop at their reach
    compiled = tf.function(lean_attention, jit_compile=True)()  # every key: shapes known when compiled
    assert np.max(np.abs(compiled.numpy() - eager.numpy())) <= 3e-6 * np.max(np.abs(eager.numpy()))
