"""Kernels known to compute a wrong gradient on some shape, and the layers of a network that meet them.

oneDNN's 1x1 convolution with a stride (``jit_1x1`` backward-weights, its "reduce to unit stride" path) writes past
its workspace when the input has fewer channels than its channel block (8 with AVX2, 16 with AVX-512):
uxlfoundation/oneDNN#6035, open. TensorFlow's ``Conv2DBackpropFilter`` runs it where oneDNN is on, so the filter
gradient of such a ``Conv2D`` is wrong, and differs from run to run (TensorFlow 2.21 on AVX2, 4 input channels:
at 14x14 and 28x28 every one of 200 runs off, relative error up to 5.5; at 16x16 one run in 200; 8, 15 and 16
channels and stride 1 exact; TensorFlow's own kernels exact: ``docs/bench/exactness/onednn_pointwise.py``). A
plain Keras loop computes the same wrong gradient as the engine: nothing the engine can check against. ``Conv1D``,
``Conv3D``, ``DepthwiseConv2D`` and ``Conv2DTranspose`` of the same shape gave one answer in 50 runs.
"""

from __future__ import annotations

import keras

from . import keras_internals as internals
from . import tf_internals

ONEDNN_CHANNEL_BLOCK = 16  # AVX-512's; AVX2's 8 (a layer between the two is named on every CPU)
ISSUE = "uxlfoundation/oneDNN#6035"


def _every_layer(items):
    """Keras layers with the layers inside them, and what holds layers without being one (a model's segment)."""
    for item in items:
        if isinstance(item, keras.layers.Layer):
            yield from internals.flatten_layers(item)
        elif hasattr(item, "layers"):
            yield from _every_layer(item.layers)


def strided_pointwise_convs(layers) -> list[str]:
    """Paths of the built ``Conv2D`` layers among ``layers`` (nested ones too) with a 1x1 kernel, a stride over 1
    and fewer than ``ONEDNN_CHANNEL_BLOCK`` input channels per group."""
    found = []
    for layer in _every_layer(layers):
        kernel = getattr(layer, "kernel", None)
        if not isinstance(layer, keras.layers.Conv2D) or isinstance(layer, keras.layers.Conv2DTranspose) \
                or kernel is None:
            continue
        shape = tuple(kernel.shape)
        if shape[:2] == (1, 1) and max(layer.strides) > 1 and shape[2] < ONEDNN_CHANNEL_BLOCK:
            path = getattr(kernel, "path", "")  # the variable's path names the layer where its name repeats
            found.append(path.rsplit("/", 1)[0] if "/" in path else layer.name)
    return list(dict.fromkeys(found))


def wrong_gradient_warning(layers, onednn: bool | None = None) -> str | None:
    """One line where oneDNN is on (``onednn``; None: this process's) and a layer meets its wrong 1x1 strided
    filter gradient; else None."""
    onednn = tf_internals.onednn_enabled() if onednn is None else onednn
    if not onednn:
        return None
    names = strided_pointwise_convs(layers)
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"oneDNN computes a wrong filter gradient for a 1x1 convolution with a stride and fewer than "
            f"{ONEDNN_CHANNEL_BLOCK} input channels ({ISSUE}), here {shown}: training with it (sectioned or not) is "
            f"not exact; set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow loads (TensorFlow's own kernels are exact), "
            f"or give those layers {ONEDNN_CHANNEL_BLOCK} or more input channels")
