"""SectionedModel: model.fit with the engine's step equals plain model.fit of an identically built model.

Every reference is a fresh model built from the same seed and trained by Keras's own ``fit``; the comparison
is over the whole update (all variables as one vector, relative L2 distance), and the training must move them.
"""

import csv
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import SectionedModel
from sections.schedule.planner import NoPlanFits
from engine_nets import float_vector, onednn_bfloat16_apart, update_error

BATCH = 8
SGD = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731


def conv_net(classes=4, reg=True, dropout=0.3, size=8):
    """Batch norm, dropout, a residual add, and L2 weight regularization in the first and last sections."""
    l2 = keras.regularizers.L2(1e-3) if reg else None
    inp = keras.Input((size, size, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", kernel_regularizer=l2, name="stem")(inp)
    h = keras.layers.BatchNormalization(name="stem_bn")(h)
    h = keras.layers.ReLU(name="stem_out")(h)
    r = keras.layers.Conv2D(8, 3, padding="same", name="res_conv")(h)
    r = keras.layers.BatchNormalization(name="res_bn")(r)
    h = keras.layers.ReLU(name="res_out")(keras.layers.Add(name="res_add")([h, r]))
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    if dropout:
        h = keras.layers.Dropout(dropout, name="drop")(h)
    out = keras.layers.Dense(classes, activation="softmax" if classes > 1 else None, kernel_regularizer=l2,
                             name="head")(h)
    return keras.Model(inp, out, name="conv_net")


def two_heads():
    """Two inputs (the second joins after the first section) and two outputs."""
    inp = keras.Input((6,), name="features")
    side = keras.Input((2,), name="side")
    h = keras.layers.Dense(16, activation="relu", name="d1")(inp)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.Dense(16, activation="tanh", name="d2")(h)
    h = keras.layers.Concatenate(name="join")([h, side])
    h = keras.layers.Dropout(0.2, name="drop")(h)
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model([inp, side], {"cls": cls, "reg": reg}, name="two_heads")


def built(factory, seed=7):
    keras.utils.set_random_seed(seed)
    return factory()


def images(n=32, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 8, 8, 3)).astype("float32"), rng.integers(0, classes, n)


flat = float_vector


def assert_same_update(ref, got, start, rtol=1e-5):
    """The whole update equal to float32 rounding; integer state (seed generators) equal exactly."""
    for v, w in zip(ref.variables, got.variables):
        if "float" not in str(v.dtype):
            np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)
    a, b = flat(ref), flat(got)
    moved = np.linalg.norm(a - start)
    assert moved > 1e-3 * np.linalg.norm(start), "training did not move the weights"
    err = update_error(b, a, start)
    assert err <= rtol, f"relative L2 distance over the whole update {err:.3g} > {rtol}"


def assert_same_history(ref, got, rtol=1e-5):
    plain = {k: v for k, v in got.history.items() if k != "step_peak_MiB"}
    assert set(plain) == set(ref.history), (sorted(plain), sorted(ref.history))
    for key, values in ref.history.items():
        np.testing.assert_allclose(plain[key], values, rtol=rtol, atol=1e-7, err_msg=key)


def fit_both(factory, compile_args, fit_args, sections=3, **wrap_args):
    """Plain fit and SectionedModel.fit of two models built alike; (plain model, history), (wrapped model's
    user model, history, wrapper), and the start weights."""
    plain = built(factory)
    start = flat(plain)
    plain.compile(**compile_args())
    ref = plain.fit(**fit_args(), verbose=0)

    model = built(factory)
    assert np.array_equal(flat(model), start)
    wrapped = SectionedModel(model, sections=sections, **wrap_args)
    wrapped.compile(**compile_args())
    got = wrapped.fit(**fit_args(), verbose=0)
    return plain, ref, model, got, wrapped, start


def xent_args(metrics=("accuracy",)):
    return lambda: dict(optimizer=SGD(), loss="sparse_categorical_crossentropy", metrics=list(metrics))


# ---------------------------------------------------------------- exactness

@pytest.mark.parametrize("sections,policy", [
    (3, "recompute"), (["res_out"], "store"),
    pytest.param("auto", "recompute", marks=pytest.mark.slow),  # 5 s on 2 idle cores: the planner's probe
], ids=["3-recompute", "names-store", "auto"])
def test_fit_equals_plain_fit(sections, policy):
    x, y = images()
    vx, vy = images(16, seed=1)
    extra = dict(memory_budget="1GiB") if sections == "auto" else {}
    plain, ref, model, got, wrapped, start = fit_both(
        conv_net, xent_args(), lambda: dict(x=x, y=y, batch_size=BATCH, epochs=2, shuffle=False,
                                            validation_data=(vx, vy)),
        sections=sections, policy=policy, **extra)
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)
    assert "val_loss" in got.history
    # Under oneDNN this model's allocations are all below the allocator's resolution: no peak, not a 0.
    assert len(got.history.get("step_peak_MiB", [])) == (2 if wrapped.engine.memory_measured else 0)
    assert int(wrapped.optimizer.iterations.numpy()) == 8
    stats = wrapped.section_stats
    assert len(stats["forward_runs"]) == len(wrapped.engine.sections) and stats["forward_runs"][-1] == 1
    if len(wrapped.engine.sections) > 1 and policy == "recompute":
        assert stats["forward_runs"][0] == 2  # really re-ran: not a whole-graph step
    np.testing.assert_allclose(wrapped.evaluate(vx, vy, verbose=0), plain.evaluate(vx, vy, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(wrapped.predict(vx, verbose=0), plain.predict(vx, verbose=0), rtol=1e-5, atol=1e-6)


def test_multi_input_multi_output_loss_dict_and_loss_weights():
    rng = np.random.default_rng(0)
    x = {"features": rng.normal(size=(32, 6)).astype("float32"), "side": rng.normal(size=(32, 2)).astype("float32")}
    y = {"cls": rng.integers(0, 3, 32), "reg": rng.normal(size=(32, 1)).astype("float32")}
    compile_args = lambda: dict(  # noqa: E731
        optimizer=keras.optimizers.Adam(1e-2), loss={"cls": "sparse_categorical_crossentropy", "reg": "mse"},
        loss_weights={"cls": 1.0, "reg": 0.5}, metrics={"cls": ["accuracy"], "reg": ["mae"]})
    plain, ref, model, got, _, start = fit_both(
        two_heads, compile_args, lambda: dict(x=x, y=y, batch_size=BATCH, epochs=2, shuffle=False),
        sections=["d2"])
    assert {"cls_loss", "reg_loss", "cls_accuracy", "reg_mae"} <= set(got.history)
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)


@pytest.mark.parametrize("weighting", ["sample_weight", pytest.param("class_weight", marks=pytest.mark.slow)])
def test_sample_weight_and_class_weight(weighting):
    x, y = images()
    weights = dict(sample_weight=np.linspace(0.2, 2.0, len(y)).astype("float32"),
                   class_weight={0: 0.5, 1: 2.0, 2: 1.0, 3: 3.0})
    plain, ref, model, got, _, start = fit_both(
        conv_net, xent_args(), lambda: dict(x=x, y=y, batch_size=BATCH, shuffle=False,
                                            **{weighting: weights[weighting]}), sections=2)
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)


@pytest.mark.parametrize("source", ["tf.data", pytest.param("generator", marks=pytest.mark.slow)])
def test_dataset_and_generator_inputs(source):
    x, y = images()

    def data():
        if source == "tf.data":
            return dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH))
        def gen():
            while True:
                for i in range(0, len(x), BATCH):
                    yield x[i:i + BATCH], y[i:i + BATCH]
        return dict(x=gen(), steps_per_epoch=len(x) // BATCH)

    plain, ref, model, got, _, start = fit_both(conv_net, xent_args(), lambda: dict(**data(), epochs=2),
                                                sections=2)
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)


@pytest.mark.parametrize("policy,jit", [
    pytest.param("float32", True, marks=pytest.mark.slow),  # XLA compiles every section: 18 s on 2 busy cores
    pytest.param("mixed_float16", False, marks=pytest.mark.slow),  # float16 has no fast CPU kernels
    ("mixed_bfloat16", False),
], ids=["jit_compile", "mixed_float16", "mixed_bfloat16"])
def test_jit_compile_and_mixed_precision(policy, jit, request):
    """compile(jit_compile=True) compiles the sections with XLA (the reference is plain fit under XLA: XLA
    draws its own dropout bits); a mixed policy's LossScaleOptimizer scales the sections' loss."""
    request.applymarker(onednn_bfloat16_apart(policy))
    x, y = images()
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        compile_args = lambda: dict(**xent_args()(), jit_compile=jit)  # noqa: E731
        # Keras's own gradients are the reference at 1e-5, so the half-precision cases run Keras's gradients: a
        # lean batch-norm gradient rounds differently in half precision (float16: 1.8e-5 of the update here;
        # bfloat16 with oneDNN off: one element of 432 a bfloat16 ulp off, 2.2e-4 of the update after SGD).
        # test_lean.py checks lean in both half precisions, layer by layer.
        plain, ref, model, got, wrapped, start = fit_both(
            conv_net, compile_args, lambda: dict(x=x, y=y, batch_size=BATCH, epochs=1, shuffle=False),
            lean=policy == "float32")
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    assert wrapped.engine.jit_compile is jit
    assert (type(wrapped.optimizer).__name__ == "LossScaleOptimizer") is (policy == "mixed_float16")
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)


@pytest.mark.slow
@pytest.mark.parametrize("name,sections,batch", [("ResNet50", 4, 8),
                                                  ("MobileNetV2", ["block_3_expand", "block_6_expand"], 16)])
def test_keras_applications_fit_equals_plain_fit(name, sections, batch):
    """keras.applications models: batch norm everywhere, residual adds across cuts, SGD with momentum.

    MobileNetV2 runs one step of 16: at 32 px its second step of 8 amplifies rounding past any comparison at 1e-4.
    Measured: plain fit from weights moved by one float32 rounding unit lands 0.24 of the update away from plain
    fit in two steps of 8 (the sections' fit 1.9e-3), 3.6e-5 in one step of 16 (the sections' fit 2e-8)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, 16)
    factory = lambda: getattr(keras.applications, name)(weights=None, input_shape=(32, 32, 3), classes=10)  # noqa: E731
    compile_args = lambda: dict(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),  # noqa: E731
                                loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    fit_args = lambda: dict(x=x, y=y, batch_size=batch, epochs=1, shuffle=False)  # noqa: E731
    # Keras's own gradients are the reference: these models amplify rounding, and lean batch norm rounds its
    # closed-form gradient differently (0.6e-3 to 2.6e-3 of the update here); tests/test_exact_every_cut.py checks
    # lean on keras.applications models in float64.
    plain, ref, model, got, _, start = fit_both(factory, compile_args, fit_args, sections=sections, lean=False)
    assert_same_history(ref, got, rtol=1e-4)
    assert_same_update(plain, model, start, rtol=1e-4)


# ---------------------------------------------------------------- callbacks

def test_model_checkpoint_file_is_the_users_model(tmp_path):
    x, y = images()
    model = built(conv_net)
    wrapped = SectionedModel(model, sections=2)
    wrapped.compile(**xent_args()())
    path = str(tmp_path / "best.keras")
    wrapped.fit(x, y, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                callbacks=[keras.callbacks.ModelCheckpoint(path)])
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model) and loaded.name == "conv_net"
    np.testing.assert_array_equal(flat(loaded), flat(model))
    # The optimizer state came along: plain Keras resumes training from it.
    assert int(loaded.optimizer.iterations.numpy()) == 8
    np.testing.assert_allclose(loaded.predict(x[:8], verbose=0), model.predict(x[:8], verbose=0), rtol=1e-6)


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


def interrupted_then_resumed(factory, wrap, backup_dir, fit_args):
    """A fit stopped by an error after epoch 2 (BackupAndRestore saved it), then a fresh process's fit."""
    first = built(factory)
    first = SectionedModel(first, sections=2) if wrap else first
    first.compile(**xent_args()())
    with pytest.raises(RuntimeError, match="interrupted"):
        first.fit(**fit_args, callbacks=[keras.callbacks.BackupAndRestore(backup_dir), _Interrupt()])
    model = built(factory)  # a new process builds the model afresh
    resumed = SectionedModel(model, sections=2) if wrap else model
    resumed.compile(**xent_args()())
    history = resumed.fit(**fit_args, callbacks=[keras.callbacks.BackupAndRestore(backup_dir)])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    return model, history


def test_backup_and_restore_resume_equals_uninterrupted(tmp_path):
    x, y = images()
    fit_args = dict(x=x, y=y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    no_dropout = lambda: conv_net(dropout=0)  # noqa: E731
    plain = built(no_dropout)
    start = flat(plain)
    plain.compile(**xent_args()())
    ref = plain.fit(**fit_args)
    model, got = interrupted_then_resumed(no_dropout, True, str(tmp_path / "a"), fit_args)
    np.testing.assert_allclose(got.history["loss"], ref.history["loss"][2:], rtol=1e-5)
    assert_same_update(plain, model, start)


@pytest.mark.slow
def test_backup_and_restore_with_dropout_resumes_as_keras_does(tmp_path):
    """Keras's weights files leave out seed-generator states, so after a resume dropout draws other masks
    than the uninterrupted run: plain Keras's own resume is the reference."""
    x, y = images()
    fit_args = dict(x=x, y=y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    plain, ref = interrupted_then_resumed(conv_net, False, str(tmp_path / "plain"), fit_args)
    model, got = interrupted_then_resumed(conv_net, True, str(tmp_path / "sectioned"), fit_args)
    assert_same_history(ref, got)
    assert_same_update(plain, model, flat(built(conv_net)))


@pytest.mark.slow  # ~6 s: two fits with every standard callback
def test_standard_callbacks_act_alike(tmp_path):
    """EarlyStopping, ReduceLROnPlateau and CSVLogger see the same logs and act at the same epochs."""
    x, y = images()
    vx, vy = images(16, seed=1)

    def callbacks(tag):
        return [keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=10.0),
                keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
                keras.callbacks.CSVLogger(str(tmp_path / f"{tag}.csv"))]

    plain = built(conv_net)
    start = flat(plain)
    plain.compile(**xent_args()())
    ref = plain.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0, validation_data=(vx, vy),
                    callbacks=callbacks("plain"))
    model = built(conv_net)
    wrapped = SectionedModel(model, sections=2)
    wrapped.compile(**xent_args()())
    got = wrapped.fit(x, y, batch_size=BATCH, epochs=6, shuffle=False, verbose=0, validation_data=(vx, vy),
                      callbacks=callbacks("sectioned"))
    assert len(ref.history["loss"]) == 2  # early stopping acted (and identically, below)
    assert_same_history(ref, got)
    assert float(model.optimizer.learning_rate) == float(plain.optimizer.learning_rate) == np.float32(0.025)
    assert_same_update(plain, model, start)
    rows = list(csv.DictReader(open(tmp_path / "sectioned.csv")))
    assert len(rows) == 2 and ("step_peak_MiB" in rows[0]) is wrapped.engine.memory_measured and "val_loss" in rows[0]


def test_terminate_on_nan_stops_at_the_same_batch():
    x, y = images()
    y = y.astype("float32")
    y[BATCH:2 * BATCH] = np.nan  # the second batch's loss is NaN

    def run(wrap):
        model = built(lambda: conv_net(classes=1))
        m = SectionedModel(model, sections=2) if wrap else model
        m.compile(optimizer=SGD(), loss="mse")
        history = m.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
        return history, int(m.optimizer.iterations.numpy())

    (ref, ref_steps), (got, steps) = run(False), run(True)
    assert ref_steps == steps == 2
    assert len(ref.history["loss"]) == len(got.history["loss"]) == 1 and np.isnan(got.history["loss"][0])


def test_tensorboard_gets_section_memory_beside_keras_scalars(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16, 16, 3)).astype("float32")  # activations above the CPU allocator's counting size
    y = rng.integers(0, 4, 64)
    wrapped = SectionedModel(built(lambda: conv_net(size=16)), sections=3)
    wrapped.compile(**xent_args()())
    wrapped.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[keras.callbacks.TensorBoard(str(tmp_path))])
    tags = {}
    for path in (tmp_path / "train").glob("events.out.tfevents.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                tags.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    assert "epoch_loss" in tags  # Keras's own scalars, in the same folder
    for k in range(3):
        assert len(tags[f"memory_MiB/section_{k}"]) == 2
        assert len(tags[f"forward_runs/section_{k}"]) == 2
    assert tags["forward_runs/section_0"] == [2.0, 2.0] and tags["forward_runs/section_2"] == [1.0, 1.0]
    assert len(tags["memory_MiB/step_peak"]) == 2
    if wrapped.engine.meter.available:
        assert min(tags["memory_MiB/step_peak"]) > 0


# ---------------------------------------------------------------- tf.distribute

@pytest.mark.slow  # plain fit's tracing under the strategy: 8 s alone, 30 s on 2 busy cores
def test_mirrored_strategy_equals_plain_fit_under_it():
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if len(cpus) < 2:
        pytest.skip("needs 2 logical CPU devices (tests/conftest.py)")
    strategy = tf.distribute.MirroredStrategy(cpus[:2], cross_device_ops=tf.distribute.ReductionToOneDevice())
    x, y = images()
    runs = []
    for wrap in (False, True):
        with strategy.scope():
            model = built(conv_net)
            m = SectionedModel(model, sections=2) if wrap else model
            m.compile(**xent_args()())
        start = flat(model)
        runs.append((m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0), model))
    (ref, plain), (got, model) = runs
    assert_same_history(ref, got)
    assert_same_update(plain, model, start)


# ---------------------------------------------------------------- bad input

class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_bad_input_one_line_each():
    with pytest.raises(ValueError, match="subclassed model.*functional API or keras.Sequential"):
        SectionedModel(_Subclassed())
    with pytest.raises(ValueError, match="is not built.*keras.Input"):
        SectionedModel(keras.Sequential([keras.layers.Dense(2)]))
    model = built(conv_net)
    with pytest.raises(ValueError, match=r"Unknown section boundary 'res_ot'.*did you mean 'res_out'.*Allowed"):
        SectionedModel(model, sections=["res_ot"])
    # sections="auto" with no budget plans to the device's memory (less headroom); a fraction reads it too
    assert "the device's memory" in SectionedModel(model, sections="auto").engine.budget_source
    assert SectionedModel(model, sections="auto", memory_budget=0.5).engine.budget_source.startswith("0.5 of")
    wrapped = SectionedModel(model, sections=2)
    with pytest.raises(ValueError, match=r"compile\(loss=None\).*give loss="):
        wrapped.compile(optimizer="sgd")
    with pytest.raises(ValueError, match="steps_per_execution=4.*use 1"):
        wrapped.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    with pytest.raises(ValueError, match="activity_regularizer"):
        inp = keras.Input((3,))
        SectionedModel(keras.Model(inp, keras.layers.Dense(2, activity_regularizer="l2")(
            keras.layers.Dense(4)(inp))))


# ---------------------------------------------------------------- saving, wrapping twice, what it refuses

def mlp():
    inp = keras.Input((6,), name="features")
    h = keras.layers.Dense(8, activation="relu", name="d1")(inp)
    h = keras.layers.Dense(8, activation="relu", name="d2")(h)
    return keras.Model(inp, keras.layers.Dense(3, activation="softmax", name="head")(h), name="mlp")


def rows(n=32, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.integers(0, 3, n)


def test_saved_file_keeps_compiled_metrics_as_plain_keras_does(tmp_path):
    """The ModelCheckpoint file loads compiled as plain Keras's own file does: the same compile config (metrics
    included), so evaluate returns the same names (and values: the same training)."""
    x, y = rows()
    compile_args = lambda: dict(optimizer=SGD(), loss="sparse_categorical_crossentropy",  # noqa: E731
                                metrics=["accuracy"], weighted_metrics=["accuracy"])
    plain = built(mlp)
    plain.compile(**compile_args())
    plain.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False)
    plain.save(tmp_path / "plain.keras")
    wrapped = SectionedModel(built(mlp), sections=2)
    wrapped.compile(**compile_args())
    wrapped.fit(x, y, batch_size=BATCH, verbose=0, shuffle=False,
                callbacks=[keras.callbacks.ModelCheckpoint(str(tmp_path / "sectioned.keras"))])
    ref, got = (keras.models.load_model(tmp_path / f"{f}.keras") for f in ("plain", "sectioned"))
    configs = [m.get_compile_config() for m in (ref, got)]
    for config in configs:
        config["optimizer"]["config"].pop("name")  # sgd, sgd_1: Keras numbers the optimizers it names
    assert configs[1] == configs[0] and configs[1]["metrics"] == ["accuracy"]
    ref_logs, got_logs = (m.evaluate(x, y, verbose=0, return_dict=True) for m in (ref, got))
    assert sorted(got_logs) == sorted(ref_logs) == ["accuracy", "loss", "weighted_accuracy"]
    for key, value in ref_logs.items():
        np.testing.assert_allclose(got_logs[key], value, rtol=1e-5, err_msg=key)


def test_a_model_wrapped_twice_saves_each_wrappers_own_optimizer(tmp_path):
    model = built(mlp)
    x, y = rows()
    first = SectionedModel(model, sections=2)
    first.compile(keras.optimizers.SGD(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
    first.fit(x, y, batch_size=BATCH, verbose=0)
    second = SectionedModel(model, sections=["d1"])  # compiles the same model with its own optimizer
    second.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy")
    first.save(tmp_path / "first.keras")
    second.save(tmp_path / "second.keras")
    first.save(tmp_path / "first_again.keras")
    for name, cls, steps, metrics in [("first", "SGD", 4, ["accuracy"]), ("second", "Adam", 0, None),
                                      ("first_again", "SGD", 4, ["accuracy"])]:
        loaded = keras.models.load_model(tmp_path / f"{name}.keras")
        assert type(loaded.optimizer).__name__ == cls and int(loaded.optimizer.iterations.numpy()) == steps, name
        assert loaded.get_compile_config()["metrics"] == metrics, name
        np.testing.assert_array_equal(flat(loaded), flat(model))  # the weights both trained
    with pytest.raises(ValueError, match="'sectioned_mlp' is already a SectionedModel.*wrap the model it trains"):
        SectionedModel(first)


class _Penalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(1e-2 * keras.ops.sum(h ** 2))
        return h


class _Scale(keras.layers.Layer):
    """A layer of the user's own, with a regularized weight and no add_loss: accepted."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(shape[-1],), initializer="ones", regularizer="l2")

    def call(self, h):
        return h * self.scale


def test_a_layer_calling_add_loss_is_refused_at_wrap():
    def model_with(layer):
        inp = keras.Input((6,))
        h = layer(keras.layers.Dense(8, name="d1")(inp))
        return keras.Model(inp, keras.layers.Dense(3, name="head")(keras.layers.Dense(8, name="d2")(h)),
                           name="penalized")

    with pytest.raises(ValueError, match=r"layer\(s\) \['pen'\] of model 'penalized' call add_loss\(\) in call\(\)"
                                         r".*one more output of the model"):
        SectionedModel(model_with(_Penalty(name="pen")), sections=2)
    SectionedModel(model_with(_Scale(name="scale")), sections=2)  # traced, and nothing found


def test_keras_saving_save_model_of_the_wrapper_names_what_to_save(tmp_path):
    wrapped = SectionedModel(built(mlp), sections=2)
    wrapped.compile("sgd", "sparse_categorical_crossentropy")
    with pytest.raises(NotImplementedError, match=r"SectionedModel 'sectioned_mlp' cannot be serialized itself.*"
                                                  r"save the model it trains, 'mlp', with wrapper.save\(path\) or "
                                                  r"keras.saving.save_model\(wrapper.model, path\)"):
        keras.saving.save_model(wrapped, tmp_path / "wrapper.keras")


def test_numpy_integer_sections():
    x, y = rows()
    wrapped = SectionedModel(built(mlp), sections=np.int64(2))
    wrapped.compile(SGD(), "sparse_categorical_crossentropy")
    wrapped.fit(x, y, batch_size=BATCH, verbose=0)
    assert len(wrapped.engine.sections) == 2 and wrapped.section_stats["forward_runs"] == [2, 1]


def test_a_reading_below_the_allocators_resolution_is_not_a_measured_zero():
    """A tiny model's tensors are all under 256 KiB: oneDNN's CPU allocator counts none of them (reads 0 bytes),
    a BFC allocator (oneDNN off) counts each. Never a 0-byte peak: unmeasured (None, with the reason) or above 0.
    Which allocator a test process ends up with depends on what ran in it before, so both branches are checked
    by what the engine reports, each against the other readings."""
    x, y = rows()
    wrapped = SectionedModel(built(mlp), sections=2)
    wrapped.compile(SGD(), "sparse_categorical_crossentropy")
    history = wrapped.fit(x, y, batch_size=BATCH, verbose=0)
    stats, engine = wrapped.section_stats, wrapped.engine
    assert 0 not in (stats["step_peak_bytes"], *stats["peak_bytes"], *stats["device_peak_bytes"].values())
    assert engine.memory_measured is (stats["step_peak_bytes"] is not None)
    assert ("step_peak_MiB" in history.history) is engine.memory_measured
    if not engine.memory_measured:
        assert "below the resolution of the allocator of CPU:0" in engine.memory_note
    auto = SectionedModel(built(mlp), sections="auto", memory_budget="1MiB")
    auto.compile(SGD(), "sparse_categorical_crossentropy")
    try:
        auto.fit(x, y, batch_size=BATCH, verbose=0)
    except NoPlanFits as err:  # measured above the budget (a BFC allocator grows by whole regions): refused
        assert auto.engine.memory_measured and "memory_budget=1.0 MiB" in str(err)
        return
    if not auto.engine.memory_measured:  # the plan fits on shapes alone, and says it was not measured
        assert auto.section_stats["step_peak_bytes"] is None
        assert "below the resolution of the allocator of CPU:0" in auto.engine.memory_note
    else:  # measured, and within the budget
        assert 0 < auto.section_stats["step_peak_bytes"] <= auto.engine.plan.budget == 2**20
