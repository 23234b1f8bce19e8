"""Layers that meet a kernel known to compute a wrong gradient are named, and every engine says so once at build."""

from __future__ import annotations

import logging
import os

import keras
import numpy as np
import pytest

from sections import Engine, Network
from sections.backend import kernel_faults, tf_internals
from sections.backend.kernel_faults import ISSUE, strided_pointwise_convs, wrong_gradient_warning


def _built(layer, channels):
    layer.build((None, 14, 14, channels))
    return layer


@pytest.mark.parametrize("layer, channels, named", [
    (lambda: keras.layers.Conv2D(8, 1, strides=2, name="c"), 4, True),
    (lambda: keras.layers.Conv2D(8, 1, strides=(2, 1), name="c"), 15, True),
    (lambda: keras.layers.Conv2D(8, 1, strides=2, name="c"), 16, False),  # a whole channel block
    (lambda: keras.layers.Conv2D(8, 3, strides=2, name="c"), 4, False),   # not 1x1
    (lambda: keras.layers.Conv2D(8, 1, name="c"), 4, False),              # stride 1
    (lambda: keras.layers.Conv2DTranspose(8, 1, strides=2, name="c"), 4, False),
    (lambda: keras.layers.DepthwiseConv2D(1, strides=2, name="c"), 4, False)])
def test_strided_pointwise_convs_are_named(layer, channels, named):
    assert strided_pointwise_convs([_built(layer(), channels)]) == (["c"] if named else [])


def test_nested_layers_are_found_and_the_line_names_them_and_the_way_out():
    inp = keras.Input((14, 14, 4))
    inner = keras.Model(inp, keras.layers.Conv2D(8, 1, strides=2, name="projection")(inp), name="block")
    outer_in = keras.Input((14, 14, 4))
    model = keras.Model(outer_in, inner(outer_in))
    assert strided_pointwise_convs([model]) == ["projection"]
    line = wrong_gradient_warning([model], onednn=True)
    assert ISSUE in line and "projection" in line and "TF_ENABLE_ONEDNN_OPTS=0" in line
    assert wrong_gradient_warning([model], onednn=False) is None
    assert wrong_gradient_warning([_built(keras.layers.Conv2D(8, 1, strides=2), 16)], onednn=True) is None


def test_onednn_enabled_reads_what_the_process_runs():
    setting = os.environ.get("TF_ENABLE_ONEDNN_OPTS")  # unset (not x86): TensorFlow's choice by CPU
    expected = {"0": False, "1": True}.get(setting, tf_internals.onednn_enabled())
    assert tf_internals.onednn_enabled() is expected and isinstance(expected, bool)


def _network():
    inp = keras.Input((14, 14, 4), name="image")
    h = keras.layers.Conv2D(8, 1, strides=2, name="projection")(inp)
    out = keras.layers.Dense(3, name="logits")(keras.layers.GlobalAveragePooling2D(name="pool")(h))
    xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Network.from_keras(keras.Model(inp, out), loss=lambda logits, batch: xent(batch["label"], logits))


@pytest.mark.parametrize("onednn", [True, False])
def test_an_engine_build_warns_once_where_onednn_runs(onednn, monkeypatch, caplog):
    monkeypatch.setattr(kernel_faults.tf_internals, "onednn_enabled", lambda: onednn)
    batch = {"image": np.zeros((2, 14, 14, 4), "float32"), "label": np.zeros((2,), "int32")}
    net = _network()
    engines = [Engine(net, keras.optimizers.SGD(0.1), sections=1) for _ in range(2)]  # batch=max builds many
    with caplog.at_level(logging.WARNING, logger="sections"):
        for engine in engines:
            engine.build(batch)
    said = [r.getMessage() for r in caplog.records if ISSUE in r.getMessage()]
    assert len(said) == (1 if onednn else 0) and (not said or "projection" in said[0])
    assert [e.kernel_faults for e in engines] == (said * 2 if onednn else [None, None])


def test_the_runners_exactness_line_names_the_fault_only_where_the_step_differs():
    from types import SimpleNamespace

    from runner.run.train import _fault_note

    engine = SimpleNamespace(kernel_faults="oneDNN computes a wrong filter gradient ... here projection")
    assert _fault_note(engine, exact=False) == f"; a known kernel fault can explain it: {engine.kernel_faults}"
    assert _fault_note(engine, exact=True) == ""
    assert _fault_note(SimpleNamespace(kernel_faults=None), exact=False) == ""
