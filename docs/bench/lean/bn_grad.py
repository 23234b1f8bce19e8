"""One batch norm's backward on a 96 MiB activation (2048x32x32x12, training mode): TensorFlow's gradient of
Keras's ops (op by op), the lean closed form in TensorFlow ops, and the fused kernel ``FusedBatchNormGradV3``
the lean gradient runs on CPU (``sections/backend/lean.py``). Time (mean of 10 runs) and peak memory above the
inputs; compare ``TF_ENABLE_ONEDNN_OPTS=1`` and ``=0`` (with ``TF_CPU_ALLOCATOR_USE_BFC=true`` for the peaks).

    TF_CPU_ALLOCATOR_USE_BFC=true PYTHONPATH=. python docs/bench/lean/bn_grad.py
"""
import time

import tensorflow as tf

EPS = 1e-3
MiB = 2**20


def closed(x, dy, mean, var, gamma):
    shape = [1, 1, 1, -1]
    inv_std = tf.math.rsqrt(tf.reshape(var, shape) + EPS)
    count = tf.cast(tf.size(x) // tf.size(mean), tf.float32)
    centered = x - tf.reshape(mean, shape)
    sum_dy = tf.reduce_sum(dy, [0, 1, 2], keepdims=True)
    sum_dy_xhat = tf.reduce_sum(dy * centered, [0, 1, 2], keepdims=True) * inv_std
    a = inv_std * tf.reshape(gamma, shape)
    return dy * a + centered * (-a * inv_std * sum_dy_xhat / count) - a * sum_dy / count


def fused(x, dy, mean, var, gamma):
    return tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=gamma, reserve_space_1=mean, reserve_space_2=var,
        reserve_space_3=tf.zeros([0]), epsilon=EPS, data_format="NHWC", is_training=True)[0]


def op_by_op(x, dy, mean, var, gamma):
    with tf.GradientTape() as tape:
        tape.watch(x)
        m, v = tf.nn.moments(x, [0, 1, 2])
        y = tf.nn.batch_normalization(x, m, v, tf.zeros_like(gamma), gamma, EPS)
    return tape.gradient(y, x, output_gradients=dy)


def main():
    x = tf.random.normal([2048, 32, 32, 12], seed=1)
    dy = tf.random.normal(x.shape, seed=2)
    gamma = tf.random.normal([12], 1.0, 0.3, seed=3)
    mean, var = tf.nn.moments(x, [0, 1, 2])
    reference = tf.function(op_by_op)(x, dy, mean, var, gamma)
    print(f"activation {x.numpy().nbytes / MiB:.0f} MiB")
    for name, f in [("op by op (Keras's ops, TensorFlow's gradient)", op_by_op), ("closed form, TensorFlow ops", closed),
                    ("FusedBatchNormGradV3", fused)]:
        f = tf.function(f)
        dx = f(x, dy, mean, var, gamma)
        error = float(tf.norm(dx - reference) / tf.norm(reference))
        try:
            tf.config.experimental.reset_memory_stats("CPU:0")
            base = tf.config.experimental.get_memory_info("CPU:0")["current"]
            f(x, dy, mean, var, gamma).numpy()
            peak = f"{(tf.config.experimental.get_memory_info('CPU:0')['peak'] - base) / MiB:.0f} MiB"
        except (ValueError, tf.errors.InvalidArgumentError):
            peak = "no allocator statistics"
        start = time.perf_counter()
        for _ in range(10):
            f(x, dy, mean, var, gamma).numpy()
        print(f"  {name}: {(time.perf_counter() - start) / 10 * 1e3:.0f} ms, peak {peak}, "
              f"relative difference from op by op {error:.1e}")


if __name__ == "__main__":
    main()
