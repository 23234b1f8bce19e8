"""How close SectionedModel.fit's weights come to plain model.fit's (docs/FIT.md, "The result").

A small convolutional net (two convolutions, each followed by batch norm, a residual add, dropout off) trained by
plain `fit` and by `SectionedModel(sections=3).fit` from the same start, on the same batches. Printed per variant:
the relative L2 distance between the two updates (all float variables as one vector, over the size of plain
fit's update), the same less the convolutions' biases and the batch norms' moving means (the biases' true
gradient is zero: batch norm subtracts them; the moving means follow them), and the largest relative difference
between the two loss histories.

    python docs/bench/fit/rounding.py            # each variant in this process, a few seconds each on a CPU

Variants: the convolutions with a bias (Keras's default) or without (`use_bias=False`, usual before batch norm);
lean gradients on (the default) or off; Adam or SGD with momentum.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from sections import SectionedModel  # noqa: E402


def net(use_bias: bool) -> keras.Model:
    inp = keras.Input((8, 8, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=use_bias, name="stem")(inp)
    h = keras.layers.BatchNormalization(name="stem_bn")(h)
    h = keras.layers.ReLU(name="stem_out")(h)
    r = keras.layers.Conv2D(8, 3, padding="same", use_bias=use_bias, name="res_conv")(h)
    r = keras.layers.BatchNormalization(name="res_bn")(r)
    h = keras.layers.ReLU(name="res_out")(keras.layers.Add(name="res_add")([h, r]))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inp, keras.layers.Dense(4, activation="softmax", name="head")(h))


def flat(model, but_zero_gradient: bool = False) -> np.ndarray:
    """All float variables as one vector; ``but_zero_gradient``: less the convolutions' biases (batch norm
    subtracts them: their true gradient is zero) and the batch norms' moving means (which follow those biases)."""
    return np.concatenate([v.numpy().ravel() for v in model.variables if "float" in str(v.dtype) and not (
        but_zero_gradient and (v.path.endswith("/bias") and "head" not in v.path or v.path.endswith("moving_mean")))])


def measure(use_bias: bool, lean, optimizer: str) -> tuple[float, float, float]:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 8, 8, 3)).astype("float32"), rng.integers(0, 4, 32)

    def opt():
        return keras.optimizers.Adam(1e-3) if optimizer == "adam" else keras.optimizers.SGD(0.05, momentum=0.9)

    keras.utils.set_random_seed(7)
    plain = net(use_bias)
    start = flat(plain)
    plain_start = net(use_bias)  # the start, kept (same seed)
    plain_start.set_weights(plain.get_weights())
    plain.compile(opt(), "sparse_categorical_crossentropy")
    ref = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    keras.utils.set_random_seed(7)
    model = net(use_bias)
    assert np.array_equal(flat(model), start)
    wrapped = SectionedModel(model, sections=3, lean=lean)
    wrapped.compile(opt(), "sparse_categorical_crossentropy")
    got = wrapped.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    a, b = flat(plain), flat(model)
    update = float(np.linalg.norm(b - a) / np.linalg.norm(a - start))
    a, b = flat(plain, True), flat(model, True)
    rest = float(np.linalg.norm(b - a) / np.linalg.norm(a - flat(plain_start, True)))
    loss = float(np.max(np.abs(np.array(got) - np.array(ref)) / np.abs(np.array(ref))))
    return update, rest, loss


if __name__ == "__main__":
    print(f"keras {keras.__version__}; 8 steps of batch 8 (2 epochs of 32 examples); 3 sections")
    print(f"{'convolution':<16}{'lean':<7}{'optimizer':<10}{'update rel. L2':>16}{'less biases':>13}"
          f"{'loss rel.':>11}")
    for use_bias in (True, False):
        for lean in (True, False):
            for optimizer in ("adam", "sgd"):
                update, rest, loss = measure(use_bias, lean, optimizer)
                print(f"{'bias' if use_bias else 'use_bias=False':<16}{str(lean):<7}{optimizer:<10}"
                      f"{update:>16.2g}{rest:>13.2g}{loss:>11.2g}", flush=True)
