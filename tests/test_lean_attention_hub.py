"""Lean attention on keras-hub's attention layers (Gemma's grouped-query attention, GPT-2 inside SectionedModel's
fit): apart from tests/test_lean_attention.py, which must import without keras-hub (the slow check on the lowest
supported Keras runs it; keras-hub 0.32 needs a newer Keras)."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras
import keras_hub  # in the test extra: a missing keras-hub fails these tests, never skips them

from sections.backend import attention as lean_attention_module
from sections.backend.lean import lean_scope


def _vector(tensors) -> np.ndarray:
    return np.concatenate([np.asarray(t, np.float64).ravel() for t in tensors])


@pytest.mark.parametrize("dtype,tolerance,kv_heads", [
    # float32 only: keras-hub 0.32's Gemma does not run in float64 (its attention output comes back float32)
    pytest.param("float32", 3e-6, 1, id="multi-query-float32"),
    pytest.param("float32", 3e-6, 2, id="grouped-float32"),
    pytest.param("float32", 3e-6, 4, id="multi-head-float32", marks=pytest.mark.slow),  # ~3 s; MHA is above
])
def test_keras_hub_gemma_attention_runs_lean_and_equals_its_own(monkeypatch, float32_after, dtype, tolerance,
                                                                kv_heads):
    """A tiny GemmaBackbone (grouped-query attention, a padded sequence, attention dropout 0.2): the lean step's
    output and every gradient equal keras-hub's own, its seeds copied in."""
    monkeypatch.setattr(lean_attention_module, "QUERY_BLOCK", 7)
    keras.config.set_floatx(dtype)

    def backbone():
        return keras_hub.models.GemmaBackbone(vocabulary_size=50, num_layers=2, num_query_heads=4,
                                              num_key_value_heads=kv_heads, hidden_dim=32, intermediate_dim=64,
                                              head_dim=8, dropout=0.2, dtype=dtype)

    reference, lean = backbone(), backbone()
    for a, b in zip(reference.variables, lean.variables):  # weights and seed generator states
        b.assign(a)
    tokens = tf.constant(np.random.RandomState(0).randint(0, 50, size=(2, 20)), tf.int32)
    padding = tf.constant([[1] * 20, [1] * 15 + [0] * 5], tf.int32)

    def step(model, on):
        @tf.function
        def run():
            with tf.GradientTape() as tape:
                with lean_scope(on):
                    y = model({"token_ids": tokens, "padding_mask": padding}, training=True)
                loss = tf.reduce_sum(y * y)
            return y, tape.gradient(loss, model.trainable_variables)
        return run()

    before = lean_attention_module.attention_traces()["backward"]
    y_ref, g_ref = step(reference, False)
    y, g = step(lean, True)
    assert y.dtype == y_ref.dtype == tf.as_dtype(dtype)
    assert lean_attention_module.attention_traces()["backward"] == before + 2  # both decoder blocks
    assert np.max(np.abs(y.numpy() - y_ref.numpy())) <= tolerance * np.max(np.abs(y_ref.numpy()))
    ref, got = (_vector([tf.convert_to_tensor(t) for t in grads]) for grads in (g_ref, g))
    assert np.linalg.norm(got - ref) <= tolerance * np.linalg.norm(ref)


def test_sectioned_fit_of_a_keras_hub_gpt2_with_dropout_equals_plain_fit(float32_after):
    """A dict-input GPT-2 backbone with a dense LM head and dropout 0.1 (attention dropout included), cut between
    its transformer layers: two steps of ``SectionedModel.fit`` (lean attention on) equal plain ``fit`` of a
    twin model over the whole update. Dropout masks come from the same seeds: Keras's, replayed exactly."""
    from sections import SectionedModel

    def model():
        backbone = keras_hub.models.GPT2Backbone(vocabulary_size=64, num_layers=2, num_heads=2, hidden_dim=32,
                                                 intermediate_dim=64, max_sequence_length=40, dropout=0.1)
        return keras.Model(backbone.input, keras.layers.Dense(64, name="lm")(backbone.output))

    plain, twin = model(), model()
    for a, b in zip(plain.variables, twin.variables):  # weights and seed generator states
        b.assign(a)
    start = _vector([v.numpy() for v in plain.trainable_variables])
    rng = np.random.RandomState(0)
    x = {"token_ids": rng.randint(0, 64, (8, 40)).astype("int32"), "padding_mask": np.ones((8, 40), "int32")}
    x["padding_mask"][1, 30:] = 0
    y = rng.randint(0, 64, (8, 40))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain.compile(keras.optimizers.SGD(0.5), loss)
    wrapped = SectionedModel(twin, sections=["transformer_layer_0", "transformer_layer_1"])
    wrapped.compile(keras.optimizers.SGD(0.5), loss)
    before = lean_attention_module.attention_traces()["backward"]
    plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    wrapped.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    assert lean_attention_module.attention_traces()["backward"] > before
    ref = _vector([v.numpy() for v in plain.trainable_variables])
    got = _vector([v.numpy() for v in twin.trainable_variables])
    assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref - start)
