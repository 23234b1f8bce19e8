"""What lean gradients keep, on a chain of 8 conv + batch norm + ReLU units (one tf.function, forward and backward).

Each activation is 16 MiB (128x32x32x32 float32). Keras keeps, per unit, the convolution's output (the batch
norm's input) and the ReLU's output (the next convolution's input); lean batch norm alone keeps the same tensors
(only its backward's temporaries shrink); re-making the convolution's output in the backward drops it; under
``lean="recompute"`` the next convolution also re-makes its input (the ReLU's output) from the previous one's.

    PYTHONPATH=. python docs/bench/lean/chain.py
"""
import sections.allocator

sections.allocator.configure()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from sections.backend import lean as _lean  # noqa: E402
from sections.backend.memory import MemoryMeter  # noqa: E402

MiB = 2**20


def chain_peak(lean, remake: bool, x, meter) -> list[float]:
    _lean.REMAKE_PRODUCERS = remake
    keras.utils.set_random_seed(0)
    layers = []
    for _ in range(8):
        layers += [keras.layers.Conv2D(32, 3, padding="same", use_bias=False), keras.layers.BatchNormalization(),
                   keras.layers.ReLU()]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            with _lean.lean_scope(lean):
                h = x
                for layer in layers:
                    h = layer(h, training=True) if isinstance(layer, keras.layers.BatchNormalization) else layer(h)
            loss = tf.reduce_sum(h)
        return tape.gradient(loss, [x] + [v for layer in layers for v in layer.trainable_variables])

    step(x)
    peaks = []
    for _ in range(3):
        meter.reset()
        step(x)[0].numpy()
        peaks.append(max(meter.peaks().values()) / MiB)
    _lean.REMAKE_PRODUCERS = True
    return peaks


def main():
    meter = MemoryMeter()
    x = tf.random.normal([128, 32, 32, 32])
    print(f"one activation: {x.numpy().nbytes / MiB:.0f} MiB; peak of forward + backward, 3 runs:")
    for name, lean, remake in [("Keras's gradients", False, True), ("lean batch norm, keeps its input", True, False),
                               ("lean batch norm, re-makes the conv output", True, True),
                               ("lean='recompute': the convolutions re-make their inputs too", "recompute", True)]:
        print(f"  {name}: {[round(p) for p in chain_peak(lean, remake, x, meter)]} MiB")


if __name__ == "__main__":
    main()
