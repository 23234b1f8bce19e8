"""Lean gradients patch Keras's classes only while a lean scope is open (``sections.backend.lean``): entering the
first open scope installs the routers, leaving the last one puts Keras's own methods back, on any thread; a model
trained after the engine runs no code of this project."""

import sys
import threading
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import Engine
from sections.backend import keras_internals
from sections.backend.lean import LEAN_LAYERS, gradient_traces, lean_scope, patched
from engine_nets import hard_network, make_batch

SECTIONS = str(Path(__file__).resolve().parent.parent / "sections")
KERAS = str(Path(keras.__file__).resolve().parent)

pytestmark = pytest.mark.usefixtures("float32_after")  # tests/conftest.py


def _methods() -> dict:
    """What each patched class itself holds now (``None``: it inherits the method)."""
    out = {cls: cls.__dict__.get("call") for cls in LEAN_LAYERS}
    for _, cls, name in keras_internals.attention_hooks():
        out[(cls, name)] = cls.__dict__.get(name)
    return out


def _keras_own(method) -> bool:
    return method.__code__.co_filename.startswith(KERAS) and not hasattr(method, "__wrapped__")


def test_the_classes_are_keras_s_own_outside_every_scope():
    assert not patched()
    before = _methods()
    with lean_scope(True):
        assert patched()
        assert keras.layers.Dense.call is not before[keras.layers.Dense]
        with lean_scope("recompute"), lean_scope(False):  # nested scopes keep them
            assert patched()
        assert patched()
    assert not patched() and _methods() == before
    assert keras.layers.Dense.call is keras.layers.Dense.__dict__["call"] and _keras_own(keras.layers.Dense.call)
    assert _keras_own(keras.layers.Conv2D.call) and "call" not in keras.layers.Conv2D.__dict__  # inherited again
    assert _keras_own(keras.layers.MultiHeadAttention._compute_attention)


def test_a_plain_scope_patches_nothing():
    with lean_scope(False):
        assert not patched()
        assert _keras_own(keras.layers.Dense.call)


def test_the_last_scope_to_close_on_any_thread_unpatches():
    opened, close = threading.Event(), threading.Event()

    def other():
        with lean_scope(True):
            opened.set()
            close.wait(30)

    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert opened.wait(30)
        with lean_scope(True):
            assert patched()
        assert patched(), "the other thread's scope is still open"
    finally:
        close.set()
        thread.join(30)
    assert not patched() and _keras_own(keras.layers.Dense.call)


def test_an_exception_in_the_scope_unpatches():
    with pytest.raises(RuntimeError):
        with lean_scope(True):
            raise RuntimeError("inside")
    assert not patched()


def _project_calls(step) -> set:
    """The project's functions that ran during ``step()`` (this thread)."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(SECTIONS):
            seen.add(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return seen


def test_after_the_engine_a_plain_model_runs_no_project_code():
    batch = make_batch()
    engine = Engine(hard_network(), keras.optimizers.SGD(0.1), sections=2, lean=True)
    traces = gradient_traces()["batch_norm"]
    engine.train_step(batch)
    assert gradient_traces()["batch_norm"] > traces, "the engine's step ran lean"
    assert not patched()
    loss = engine.train_step(batch)["loss"]  # its traced functions stay lean and run without the patches
    assert np.isfinite(loss) and not patched()

    model = keras.Sequential([keras.Input((8, 8, 2)), keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                              keras.layers.ReLU(), keras.layers.Flatten(), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = batch["image"], batch["label"]

    def eager_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, model(x, training=True),
                                                                               from_logits=True))
        tape.gradient(loss, model.trainable_variables)

    assert _project_calls(eager_step) == set()
    assert _project_calls(lambda: model.train_on_batch(x, y)) == set()  # traced and run
