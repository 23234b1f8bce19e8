"""The two doors to the dependencies' internals (``sections/backend/keras_internals.py``, ``tf_internals.py``)
and the runner's public name for the second (``sections.tf_compat``): each touch point answers as its caller
expects, and where a release lacks what it reads, falls back or says so in one line. (That nothing else reads an
internal is ``tests/test_architecture.py``'s.)"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from sections import tf_compat
from sections.backend import keras_internals, tf_internals


def test_every_touch_point_is_listed_with_its_releases():
    for module in (keras_internals, tf_internals):
        for name in module.__all__:
            fn = getattr(module, name)
            if callable(fn) and name not in ("written_for", "check_versions") and not isinstance(fn, type):
                package, low, high = fn.written_for
                assert tf_internals.TOUCH_POINTS[f"{module.__name__}.{name}"] == (package, low, high)
    assert tf_internals.TENSORFLOW[1:] == keras_internals.SUPPORTED["tensorflow"]


def test_the_runtime_has_started_here():
    tf.constant(1.0) + 1.0  # noqa: B018 - starts the eager context
    assert tf_compat.runtime_started() is True


def test_op_determinism_turns_off_again():
    from tensorflow.python.framework import config  # a test may read an internal to check the door

    tf.config.experimental.enable_op_determinism()
    try:
        assert config.is_op_determinism_enabled()
    finally:
        tf_compat.disable_op_determinism()
    assert not config.is_op_determinism_enabled()


def test_checkpoint_state_written_and_read_back(tmp_path):
    paths = [str(tmp_path / f"ckpt-{i}") for i in (1, 2)]
    assert tf_compat.write_checkpoint_state(str(tmp_path), paths[-1], paths, [1.0, 2.0], last_preserved_timestamp=0.5)
    text = (tmp_path / "checkpoint").read_text()
    assert tf_compat.checkpoint_state_parses(text)
    assert tf.train.get_checkpoint_state(str(tmp_path)).all_model_checkpoint_paths == paths
    assert not tf_compat.checkpoint_state_parses("model_checkpoint_path: ")  # not the proto's text format
    assert not tf_compat.checkpoint_state_parses("no such field: 1")


def test_a_missing_keras_internal_is_one_line():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    with pytest.raises(RuntimeError, match=r"^sectionflow: this Keras \(.*\) has no a compiled Model._loss_tracker; "
                                           r"SectionedModel reports fit's loss through it \(written for keras>="):
        keras_internals.loss_tracker(model)  # not compiled: none yet
    model.compile("sgd", "mse")
    assert keras_internals.loss_tracker(model) is not None
    assert keras_internals.distribute_strategy(model) is None  # made outside any strategy's scope

    class Bare:
        pass

    with pytest.raises(RuntimeError, match=r"has no Bare._nodes_by_depth; from_keras") as err:
        keras_internals.nodes_by_depth(Bare())
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match=r"Model._symbolic_build\(data_batch=...\)"):
        keras_internals.symbolic_build(Bare(), None)
    assert keras_internals.call_context_args(Bare()) == ()


def test_a_missing_tensorflow_internal_is_one_line():
    class Op:
        pass

    with pytest.raises(RuntimeError, match=r"^this TensorFlow \(.*\) has no Operation._gradient_function \(sectionflow "
                                           r"was written for >=2.16,<2.22\); train with lean=False$"):
        tf_internals.set_gradient_function(Op(), None)
