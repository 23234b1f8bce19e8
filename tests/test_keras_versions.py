"""The supported Keras range: a version check, Keras's own gradient where an internal is missing, and the
exactness core on the lowest supported Keras (slow: fetches that wheel from the package index)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import keras

from sections.backend import keras_internals
from sections.backend.lean import gradient_traces, lean_scope

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_declares_the_supported_range():
    text = (ROOT / "pyproject.toml").read_text()
    for name, (low, high) in keras_internals.SUPPORTED.items():
        assert f'"{name}>={low},<{high}"' in text


def test_versions_outside_the_range_are_said_once():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert keras_internals.check_versions({"keras": "3.15.1", "tensorflow": "2.21.0"}) == []
        outside = keras_internals.check_versions({"keras": "3.17.0", "tensorflow": "2.21.0"})
        keras_internals.check_versions({"keras": "3.17.0", "tensorflow": "2.21.0"})
    assert outside == ["keras 3.17.0 (supported: >=3.10,<3.16)"]
    assert len([w for w in seen if "keras 3.17.0" in str(w.message)]) == 1


def test_a_missing_internal_runs_keras_own_gradient_with_one_warning(monkeypatch):
    """A Keras without ``BatchNormalization._reduction_axes``: the lean batch norm steps aside (no lean gradient
    traced, one warning) and the step equals Keras's own."""
    layer = keras.layers.BatchNormalization()
    x = tf.random.stateless_normal([8, 4], seed=[1, 2])
    layer(x, training=True)

    def lean_traces():
        return gradient_traces()["batch_norm"]

    monkeypatch.setattr(keras_internals, "_warned", set())
    # as batch_norm_axes answers on a Keras without the attribute (Keras's own call has its own way then)
    monkeypatch.setattr(keras_internals, "batch_norm_axes",
                        lambda layer: keras_internals._missing("BatchNormalization._reduction_axes"))

    def grads(lean):
        @tf.function
        def run(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                with lean_scope(lean):
                    y = layer(x, training=True)
                loss = tf.reduce_sum(y * tf.range(1.0, 5.0))  # sum(y * y) of a batch norm's output is constant
            return tape.gradient(loss, x)
        return run(x)

    before = lean_traces()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lean = grads(True)
    assert lean_traces() == before
    monkeypatch.undo()  # the internal back: the same step runs the lean gradient (the check above can fail)
    grads(True)
    assert lean_traces() == before + 1
    assert [str(w.message) for w in seen if "_reduction_axes" in str(w.message)]
    np.testing.assert_allclose(lean.numpy(), grads(False).numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_the_exactness_core_passes_on_the_lowest_supported_keras(tmp_path):
    """``pip install --no-deps --target`` of the lowest supported Keras, put first on the path: the engine's
    exactness, lean gradients, lean attention and SectionedModel tests (keras-hub's need a newer Keras)."""
    low = keras_internals.SUPPORTED["keras"][0]
    target = tmp_path / "keras"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                          "--target", str(target), f"keras=={low}.0"], capture_output=True, text=True, timeout=300)
    if pip.returncode:
        pytest.skip(f"keras=={low}.0 could not be fetched from the package index: {pip.stderr.strip()[-200:]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    version = subprocess.run([sys.executable, "-c", "import keras; print(keras.__version__)"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert version.stdout.strip() == f"{low}.0", version.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                           "tests/test_engine_equivalence.py", "tests/test_lean.py", "tests/test_lean_attention.py",
                           "tests/test_sectioned_model.py", "tests/test_from_keras.py", "-k", "not keras_hub"],
                          env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:]
