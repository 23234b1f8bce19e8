"""Network.from_keras: a model cut at layer names trains exactly like the whole model in a GradientTape loop."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from sections import Engine, Network

STEPS = 2
BATCH = 4


def xent(outputs, batch):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(batch["label"], outputs))


def image_batch(shape=(32, 32, 3), classes=10, seed=0):
    rng = np.random.default_rng(seed)
    return {"image": tf.constant(rng.normal(size=(BATCH, *shape)), tf.float32),
            "label": tf.constant(rng.integers(0, classes, BATCH), tf.int32)}


def twins(build):
    """Two models with identical variables (weights, batch-norm statistics and seed-generator states)."""
    keras.utils.set_random_seed(1)
    ref = build()
    keras.utils.set_random_seed(2)
    model = build()
    inner = lambda m: [v.path.split("/", 1)[-1] for v in m.variables]  # paths below the model's own name
    assert inner(ref) == inner(model)
    for a, b in zip(ref.variables, model.variables):
        b.assign(a)
    return ref, model


@pytest.fixture(autouse=True)
def no_graph_rewrites():
    """Grappler off while these tests run: its fusions round differently from eager execution (measured
    on ResNet50V2 at batch 4: second-step losses 1.3e-4 apart, compiled vs eager, same model), and
    with it off the eager reference loop below needs no tracing, the slowest part of these tests."""
    saved = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": True})
    yield
    tf.config.optimizer.set_experimental_options({"disable_meta_optimizer": False, **saved})


def tape_train(model, loss, batches, optimizer, inputs=("image",)):
    """The plain whole-model GradientTape loop the sectioned step must equal."""
    losses = []
    for batch in batches:
        x = batch[inputs[0]] if len(inputs) == 1 else [batch[k] for k in inputs]
        with tf.GradientTape() as tape:
            value = loss(model(x, training=True), batch)
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(value))
    return losses


def assert_same_model(ref, model, start, rtol=1e-5, atol=1e-6):
    """Every variable equal to float32 rounding (relative norm), and the steps really moved them.

    ``atol`` (on the norm) is for variables whose true gradient is zero (conv biases before batch norm):
    theirs is rounding noise, and so is their value after the step.
    """
    moved, worst = 0, (0.0, "")
    for v, w, a0 in zip(ref.variables, model.variables, start):
        a, b = np.asarray(v.numpy(), "float64"), np.asarray(w.numpy(), "float64")
        err = np.linalg.norm(a - b) / (np.linalg.norm(a) + atol / rtol)
        worst = max(worst, (err, v.path))
        moved += not np.array_equal(a, a0)
    assert worst[0] <= rtol, f"largest relative difference {worst[0]:.3g} in {worst[1]}"
    assert moved >= len(start) // 2, f"only {moved} of {len(start)} variables moved"


def optimizer():
    # SGD with momentum, not Adam: pre-batch-norm conv biases have a true gradient of 0, so theirs is
    # rounding noise that Adam's first step would scale up to a learning-rate-sized move.
    return keras.optimizers.SGD(0.01, momentum=0.9)


def check_exact(build, sections, loss=xent, batch=None, inputs=("image",), fields=None, keep=(),
                **engine_args):
    batch = batch if batch is not None else image_batch()
    ref, model = twins(build)
    start = [np.asarray(v.numpy(), "float64") for v in ref.variables]
    ref_losses = tape_train(ref, loss, [batch] * STEPS, optimizer(), inputs)

    net = Network.from_keras(model, loss, inputs=inputs[0], fields=fields, keep=keep)
    engine = Engine(net, optimizer(), sections=sections, **engine_args)
    losses = [engine.train_step(batch)["loss"] for _ in range(STEPS)]

    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_same_model(ref, model, start)
    return engine


def application(name, shape=(32, 32, 3)):
    return lambda: getattr(keras.applications, name)(weights=None, input_shape=shape, classes=10)


# ---------------------------------------------------------------- keras.applications

# Fast cases cut early (tracing dominates their time, and a late cut traces most of the model twice);
# each crosses a residual or concatenation input over a cut (a two-tensor border). Kept boundaries
# of these models have one-tensor borders, so ``keep`` adds such a cut.
APPS = [
    # 16 s: slow (MobileNetV2 below keeps a residual add across a cut in the fast run)
    pytest.param("ResNet50V2", ["conv2_block2_1_relu", "conv2_block3_out"], ("conv2_block2_1_relu",),
                 id="resnet50v2-names", marks=pytest.mark.slow),
    pytest.param("MobileNetV2", ["block_2_depthwise", "block_3_expand"], ("block_2_depthwise",),
                 id="mobilenetv2-names", marks=pytest.mark.slow),  # 9 s; tests/test_exact_every_cut.py cuts it in-block
    # 27 s on 2 cores: slow (a concatenation across a cut stays in the fast run through the small models below)
    pytest.param("DenseNet121", ["conv2_block2_1_conv", "pool1"][::-1], ("conv2_block2_1_conv",),
                 id="densenet121-names", marks=pytest.mark.slow),
    pytest.param("ResNet50V2", ["conv3_block1_out", "conv4_block1_out", "conv5_block2_1_relu"],
                 ("conv5_block2_1_relu",), id="resnet50v2-late-names", marks=pytest.mark.slow),
    pytest.param("ResNet50V2", 3, (), id="resnet50v2-int", marks=pytest.mark.slow),
    pytest.param("MobileNetV2", 4, (), id="mobilenetv2-int", marks=pytest.mark.slow),
    pytest.param("DenseNet121", 3, (), id="densenet121-int", marks=pytest.mark.slow),
    pytest.param("DenseNet121", ["pool2_pool", "pool3_pool", "pool4_pool"], (), id="densenet121-late-names",
                 marks=pytest.mark.slow),
    pytest.param("ResNet50V2", "auto", (), id="resnet50v2-auto", marks=pytest.mark.slow),
    pytest.param("MobileNetV2", "auto", (), id="mobilenetv2-auto", marks=pytest.mark.slow),
    pytest.param("DenseNet121", "auto", (), id="densenet121-auto", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,sections,keep", APPS)
def test_application_sectioned_step_equals_whole_model_step(name, sections, keep):
    extra = {"memory_budget": "8GiB"} if sections == "auto" else {}
    # Keras's own gradients: these float32 models amplify rounding (docs/RESULTS.md "How exactness is judged"), and lean
    # gradients round differently (2e-4 in MobileNetV2's second loss); lean on these models is checked in float64
    # (tests/test_exact_every_cut.py).
    engine = check_exact(application(name), sections, keep=keep, lean=False, **extra)
    if isinstance(sections, int):
        assert len(engine.sections) == sections
    if isinstance(sections, list):
        # A cut "at" a layer ends a section with that layer; the next section starts after it.
        assert [s.block_names[-1] for s in engine.sections[:-1]] == sections
        if keep:
            assert max(len(s.input_specs) for s in engine.sections[1:]) == 2


# ---------------------------------------------------------------- models of our own


def skip_everywhere():
    """A skip connection from the stem crosses every cut after it; batch norm and dropout inside."""
    L = keras.layers
    x = keras.Input((8, 8, 3))
    stem = L.Conv2D(8, 3, padding="same", name="stem")(x)
    h = stem
    for i in range(3):
        h = L.Conv2D(8, 3, padding="same", name=f"conv_{i}")(h)
        h = L.BatchNormalization(name=f"bn_{i}")(h)
        h = L.Activation("relu", name=f"relu_{i}")(h)
        h = L.Dropout(0.3, name=f"drop_{i}")(h)
    h = L.Concatenate(name="concat")([h, stem])
    h = L.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, L.Dense(10, activation="softmax", name="predictions")(h), name="skip_everywhere")


@pytest.mark.parametrize("sections", [["conv_0", "bn_1", "drop_2"], 4, "auto"], ids=str)
def test_skip_connection_crossing_every_cut(sections):
    # The budget counts what the process already holds (the planner's dry step measures the device): after the
    # slow keras.applications cases about 1 GiB stays resident in the test process.
    extra = {}
    if sections == "auto":
        extra["memory_budget"] = tf.config.experimental.get_memory_info("CPU:0")["current"] + 2**30
    engine = check_exact(skip_everywhere, sections, batch=image_batch((8, 8, 3)), **extra)
    for s in engine.sections[1:]:
        names = s.block_names
        if names[0] not in ("concat", "pool", "predictions"):
            assert len(s.input_specs) == 2, (names, s.input_specs)  # the running tensor and the stem's


def two_inputs():
    """An image and a feature vector: the vector joins late, and the last block reads it again."""
    L = keras.layers
    image, meta = keras.Input((8, 8, 3), name="image"), keras.Input((4,), name="meta")
    h = L.Conv2D(8, 3, name="conv")(image)
    h = L.BatchNormalization(name="bn")(h)
    h = L.GlobalAveragePooling2D(name="pool")(L.Activation("relu", name="relu")(h))
    m = L.Dense(8, activation="relu", name="meta_dense")(meta)
    h = L.Concatenate(name="join")([h, m])
    h = L.Dropout(0.2, name="drop")(L.Dense(16, activation="relu", name="hidden")(h))
    h = L.Concatenate(name="join_raw")([h, meta])
    return keras.Model([image, meta], L.Dense(10, activation="softmax", name="predictions")(h))


def test_two_input_model_reads_its_second_input_from_a_batch_field():
    batch = image_batch((8, 8, 3))
    batch["features"] = tf.constant(np.random.default_rng(3).normal(size=(BATCH, 4)), tf.float32)
    engine = check_exact(two_inputs, ["bn", "join", "drop"], batch=batch, inputs=("image", "features"),
                         fields=["features"])
    fields = [b.fields for b in engine.network.blocks]
    assert ("features",) in fields and fields[0] == ()


def multi_output():
    """A class head off the middle of the model and a regression head at its end, returned as a dict."""
    L = keras.layers
    x = keras.Input((8, 8, 3))
    h = L.Conv2D(8, 3, activation="relu", name="conv_0")(x)
    mid = L.GlobalAveragePooling2D(name="mid_pool")(h)
    classes = L.Dense(10, activation="softmax", name="classes")(mid)
    h = L.Conv2D(8, 3, name="conv_1")(h)
    h = L.Dropout(0.5, name="drop")(L.BatchNormalization(name="bn")(h))
    size = L.Dense(1, name="size")(L.Flatten(name="flat")(h))
    return keras.Model(x, {"classes": classes, "size": size})


def two_heads(outputs, batch):
    return xent(outputs["classes"], batch) + tf.reduce_mean(tf.square(outputs["size"][:, 0] - 1.0))


def test_multi_output_model_gives_the_loss_its_output_structure():
    engine = check_exact(multi_output, ["conv_0", "bn"], loss=two_heads, batch=image_batch((8, 8, 3)))
    # The class head runs in the first section, and its output crosses both cuts to the loss.
    assert [len(s.input_specs) for s in engine.sections[1:]] == [2, 2]


def test_sequential_model():
    L = keras.layers
    build = lambda: keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(8, 3, name="conv"),
                                      L.BatchNormalization(name="bn"), L.ReLU(name="relu"),
                                      L.Dropout(0.3, name="drop"), L.Flatten(name="flat"),
                                      L.Dense(10, activation="softmax", name="predictions")])
    check_exact(build, ["bn", "drop"], batch=image_batch((8, 8, 3)))


def test_trained_weights_are_the_models_own_and_save(tmp_path):
    model = skip_everywhere()
    net = Network.from_keras(model, xent)
    assert {id(v) for v in net.variables} == {id(v) for v in model.variables}
    Engine(net, optimizer(), sections=3).train_step(image_batch((8, 8, 3)))
    model.save(tmp_path / "m.keras")
    loaded = keras.saving.load_model(tmp_path / "m.keras")
    for a, b in zip(model.weights, loaded.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def masked():
    """Embedding(mask_zero=True): the GRU and the pooling read the mask, which crosses every cut before them."""
    L = keras.layers
    x = keras.Input((6,), dtype="int32", name="tokens")
    h = L.Embedding(10, 8, mask_zero=True, name="emb")(x)
    h = L.Dense(8, activation="relu", name="dense")(h)
    h = L.LayerNormalization(name="norm")(h)
    h = L.Dropout(0.2, name="drop")(h)
    h = L.GRU(8, return_sequences=True, name="gru")(h)
    h = L.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, L.Dense(3, activation="softmax", name="predictions")(h), name="masked")


def token_batch():
    tokens = np.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 0, 0, 0], [5, 3, 0, 0, 0, 0], [8, 9, 7, 9, 3, 0]])
    return {"tokens": tf.constant(tokens, tf.int32), "label": tf.constant([0, 1, 2, 1], tf.int32)}

@pytest.mark.slow  # ~5 s; test_masking_layer_mask_crosses_cuts stays

def test_masking_layers_see_the_same_mask_across_cuts():
    batch = token_batch()
    model = masked()
    # The mask matters here: without it the GRU and the pooling read the padding.
    h = model.get_layer("drop")(model.get_layer("norm")(model.get_layer("dense")(model.get_layer("emb")(
        batch["tokens"]))))
    unmasked = model.get_layer("predictions")(model.get_layer("pool")(model.get_layer("gru")(tf.identity(h))))
    assert not np.allclose(unmasked.numpy(), model(batch["tokens"]).numpy(), atol=1e-4)

    net = Network.from_keras(model, xent, inputs="tokens")
    assert net.cut_points == ["emb", "dense", "norm", "drop", "gru", "pool"]  # the mask op is not a cut
    for sections in (["emb", "gru"], 3):
        engine = check_exact(masked, sections, batch=batch, inputs=("tokens",))
        for s in engine.sections[1:]:  # every border before the pooling carries the boolean mask too
            expected = ["float32"] if s.block_names[0] == "predictions" else ["bool", "float32"]
            assert sorted(spec.dtype.name for spec in tf.nest.flatten(s.input_specs)) == expected, s


def masking_layer():
    """keras.layers.Masking: its mask is two ops (not_equal, then any) that run beside the dense layers."""
    L = keras.layers
    x = keras.Input((5, 4), name="series")
    h = L.Masking(0.0, name="masking")(x)
    h = L.Dense(8, activation="relu", name="dense_0")(h)
    h = L.Dense(8, activation="tanh", name="dense_1")(h)
    h = L.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(x, L.Dense(3, activation="softmax", name="predictions")(h), name="masking_layer")


def test_masking_layer_mask_crosses_cuts():
    series = np.random.default_rng(4).normal(size=(BATCH, 5, 4))
    series[1, 3:] = series[2, 1:] = 0.0
    batch = {"series": tf.constant(series, tf.float32), "label": tf.constant([0, 1, 2, 1], tf.int32)}
    engine = check_exact(masking_layer, ["masking", "dense_0", "dense_1"], batch=batch, inputs=("series",))
    assert [sorted(spec.dtype.name for spec in tf.nest.flatten(s.input_specs)) for s in engine.sections[1:]] == [
        ["bool", "float32"]] * 3


# ---------------------------------------------------------------- bad input


def residual():
    L = keras.layers
    x = keras.Input((8, 8, 3))
    h = L.Conv2D(8, 3, padding="same", name="stem")(x)
    a = L.Conv2D(8, 3, padding="same", name="branch_a")(h)
    a = L.Conv2D(8, 3, padding="same", name="branch_b")(a)
    s = L.Conv2D(8, 1, name="shortcut")(h)
    h = L.Add(name="add")([a, s])
    h = L.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(x, L.Dense(10, activation="softmax", name="predictions")(h), name="residual")


def test_cut_points_of_a_residual_block():
    net = Network.from_keras(residual(), xent)
    assert list(net.boundaries) == ["stem", "add", "pool"]


def test_unknown_layer_name_lists_the_allowed_cuts():
    net = Network.from_keras(residual(), xent)
    with pytest.raises(ValueError, match=r"'ad'.*no layer of that name.*did you mean 'add'.*\['stem', 'add', "
                                         r"'pool'\]"):
        Engine(net, optimizer(), sections=["ad"])


def test_a_long_list_of_allowed_cuts_is_shortened_and_says_where_to_read_it_all():
    net = Network.from_keras(skip_everywhere(), xent)
    names = list(net.boundaries)
    assert len(names) == 15
    with pytest.raises(ValueError) as err:
        net.boundary_starts(["nope"])
    shown = ", ".join(repr(n) for n in names[:5]) + ", ..., " + ", ".join(repr(n) for n in names[-5:])
    assert f"Allowed cut layers (15; net.boundaries lists them all): [{shown}]." in str(err.value)
    hinted = Network.from_keras(skip_everywhere(), xent, names_hint="see --help")
    with pytest.raises(ValueError, match=r"\(15; see --help\)"):
        hinted.boundary_starts(["nope"])


def test_cut_inside_a_branch_names_the_nearest_allowed_layers():
    net = Network.from_keras(residual(), xent)
    with pytest.raises(ValueError, match=r"'branch_a'.*cannot be cut.*inside a branch: layer 'shortcut' runs "
                                         r"beside it.*nearest allowed: 'stem' and 'add'"):
        Engine(net, optimizer(), sections=["branch_a"])


def test_merged_cut_names_the_nearest_kept_ones_and_keep_restores_it():
    net = Network.from_keras(skip_everywhere(), xent, max_blocks=3)
    assert len(net.blocks) == 3
    merged = next(n for n in net.cut_points if n not in net.boundaries)
    with pytest.raises(ValueError, match=rf"'{merged}'.*merged.*nearest allowed.*keep=\['{merged}'\]"):
        net.boundary_starts([merged])
    kept = Network.from_keras(skip_everywhere(), xent, max_blocks=3, keep=[merged])
    assert merged in kept.boundaries and len(kept.blocks) == 3


def test_keep_must_name_a_cut_point():
    with pytest.raises(ValueError, match=r"keep=\['branch_b'\].*inside a branch.*cut points: \['stem', 'add', "
                                         r"'pool'\]"):
        Network.from_keras(residual(), xent, keep=["branch_b"])


def test_unbuilt_model():
    with pytest.raises(ValueError, match="is not built.*keras.Input"):
        Network.from_keras(keras.Sequential([keras.layers.Dense(3)]), xent)


def test_subclassed_model_points_to_writing_blocks_by_hand():
    class Mine(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x):
            return self.dense(x)

    model = Mine()
    model(tf.zeros((1, 2)))
    with pytest.raises(ValueError, match=r"subclassed model.*write the blocks by hand.*\"Your own model\""):
        Network.from_keras(model, xent)


def test_wrong_number_of_fields():
    with pytest.raises(ValueError, match=r"fields=\[\]: .* 1 input\(s\) after the first \(\['meta'\]\)"):
        Network.from_keras(two_inputs(), xent, fields=[])


def test_from_keras_is_a_method_of_network_itself():
    """``Network.from_keras`` is defined on the class (a classmethod importing its module when called), not set
    there by another module's import."""
    import inspect

    from sections.network import keras_network, network

    assert isinstance(inspect.getattr_static(network.Network, "from_keras"), classmethod)
    assert "from_keras" not in vars(keras_network.KerasNetwork)
    net = network.Network.from_keras(residual(), xent)
    assert isinstance(net, keras_network.KerasNetwork) and net.boundaries


def test_cut_points_beyond_max_blocks_are_kept_where_the_bytes_are():
    """Twelve wide layers then twelve narrow ones, one cut point after each, at most 7 blocks: the kept cuts fall
    where activations and weights are: five of six among the wide layers, the sixth where they end (its border is
    the narrow layer's output); spread by layer count, three were."""
    L = keras.layers
    x = keras.Input((512,), name="x")
    h = x
    for i in range(12):
        h = L.Dense(512, name=f"wide_{i}")(h)
    for i in range(12):
        h = L.Dense(4, name=f"narrow_{i}")(h)
    model = keras.Model(x, L.Dense(3, name="out")(h))
    net = Network.from_keras(model, xent, inputs="x", max_blocks=7)
    assert len(net.blocks) == 7
    kept = list(net.boundaries)
    assert sum(name.startswith("wide") for name in kept) == 5 and "narrow_0" in kept, kept
