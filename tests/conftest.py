import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from sections.allocator import configure  # noqa: E402

configure()  # the project's own CPU allocator setting (memory statistics on every CPU), as the runner's

# TensorFlow's start-up lines (absl's banner, oneDNN, "failed call to cuInit" without a GPU) ignore
# TF_CPP_MIN_LOG_LEVEL; an xdist worker printed them after the summary. Imported as the runner does: captured at the
# file descriptor, shown only at the level TF_CPP_MIN_LOG_LEVEL allows (subprocesses inherit it: 2, errors only).
from runner.platform.quiet import load_tensorflow  # noqa: E402

load_tensorflow()


def _two_logical_cpus() -> None:
    """Split the CPU into 2 logical devices before TensorFlow initializes them, so MirroredStrategy tests
    (tests/test_engine_distribute.py) have 2 replicas in this process; single-device code runs on CPU:0. One
    inter-op thread, as the runner sets by default."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        # The runner's default for the sectioned engine (train.inter_op_threads=auto: 1), so runner jobs run here too.
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:  # already initialized (a test process that imported TensorFlow earlier)
        pass


_two_logical_cpus()


# Cases moved to the slow set to keep the default run under 6 minutes on 2 CPU cores (each took 3-10 s there on
# 2026-11-23; the fast set keeps a sibling of each: another parameter, policy or model of the same test).
SLOW_CASES = {
    # Fourteenth session, 2026-11-28 (the fast suite read 6:37 quiet with 912 tests): each keeps a sibling in the fast
    # set, named after it.
    "tests/test_exact_every_cut.py::test_resnet50_cuts_inside_residual_blocks_in_every_stage":
        "28 s; test_mobilenetv2_cuts_inside_residual_blocks_in_every_stage_with_every_policy stays",
    "tests/test_memory_stats.py::test_runner_measures_memory_with_onednn_off": "10 s; the describe() tests stay",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.gpu_memory=2GiB]":
        "8.5 s (TensorFlow starts to find no GPU); the other bad keys stay",
    "tests/test_models.py::test_split_resnet_cut_inside_residual_blocks_trains_like_the_whole_resnet":
        "7 s; test_sectioned_steps_equal_whole_graph_steps[resnet] stays",
    "tests/test_lean_attention_hub.py::test_sectioned_fit_of_a_keras_hub_gpt2_with_dropout_equals_plain_fit":
        "7 s; the Gemma lean-attention cases and test_keras_hub's gpt2-decoder step stay",
    "tests/test_memory_stats.py::test_without_statistics_nothing_reads_zero_and_nothing_plans": "10 s",
    "tests/test_models.py::test_sectioned_steps_equal_whole_graph_steps[seq2seq]": "7 s",
    "tests/test_runner_faults.py::test_nan_weights_under_a_finite_loss_stop_the_run_naming_step_and_variable": "6 s",
    "tests/test_runner_faults.py::test_a_batch_larger_than_memory_is_refused_before_allocation": "3 s",
    "tests/test_gpt.py::test_sectioned_steps_equal_a_plain_tape_loop": "6 s",
    "tests/test_engine_v2.py::test_multi_level_schedules_equal_the_plain_loop[store+recreate]": "6 s",
    "tests/test_engine_v2.py::test_multi_level_schedules_equal_the_plain_loop[nested]": "5 s",
    "tests/test_sectioned_model.py::test_fit_equals_plain_fit[names-store]": "4 s",
    "tests/test_sectioned_model.py::test_terminate_on_nan_stops_at_the_same_batch": "4 s",
    "tests/test_sectioned_model.py::test_multi_input_multi_output_loss_dict_and_loss_weights": "4 s",
    "tests/test_sectioned_model.py::test_sample_weight_and_class_weight[sample_weight]": "3 s",
    "tests/test_precision.py::test_sectioned_steps_equal_a_plain_loop_at_the_same_precision[mixed_float16-1048576.0]":
        "6 s",
    "tests/test_precision.py::test_sectioned_steps_equal_a_plain_loop_at_the_same_precision[mixed_float16-32768.0]":
        "4 s",
    "tests/test_engine_runs.py::test_numpy_batches_train_like_tensor_batches": "5 s",
    "tests/test_engine_distribute.py::test_sectioned_step_under_a_strategy_equals_a_whole_graph_step_under_it"
    "[recompute-lean]": "5 s",
    "tests/test_engine_distribute.py::test_sectioned_step_under_a_strategy_equals_a_whole_graph_step_under_it"
    "[recreate]": "5 s",
    "tests/test_runner_precision.py::test_resume_cannot_turn_loss_scaling_on_or_off": "3 s",
    "tests/test_runner_config.py::test_run_function_trains_in_process": "4 s",
    "tests/test_from_keras.py::test_skip_connection_crossing_every_cut[auto]": "3 s",
    "tests/test_engine_equivalence.py::test_sectioned_step_equals_whole_graph_step[5-recompute]": "3 s",
}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.nodeid in SLOW_CASES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def float32_after():
    """Restore float32 and the dtype policy after a test that switches them (float64, mixed precision)."""
    import keras

    policy = keras.config.dtype_policy()
    yield
    keras.config.set_floatx("float32")
    keras.config.set_dtype_policy(policy)


@pytest.fixture(autouse=True)
def _op_determinism_restored():
    """A runner job run in process (train.deterministic=true, the default) turns TensorFlow's op determinism on
    process-wide; later tests in the worker (an unseeded random op, say) must not inherit it."""
    from tensorflow.python.framework import config  # is_op_determinism_enabled has no public name

    before = config.is_op_determinism_enabled()
    yield
    if config.is_op_determinism_enabled() != before:
        from runner.run.build import set_determinism

        set_determinism(before)
