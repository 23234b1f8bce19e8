import os

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _own_cache_folder() -> None:
    """`train.plan_cache=auto` keeps plans under $XDG_CACHE_HOME: each test process (and the runs it starts) gets
    a folder of its own, removed at its end, so no test reads or leaves plans in the user's cache."""
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="sectionflow-tests-cache-")
    os.environ["XDG_CACHE_HOME"] = folder
    atexit.register(shutil.rmtree, folder, ignore_errors=True)


_own_cache_folder()

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
    # Sixteenth session, 2026-11-28 (the fast suite read 8:43 on 2 busy cores, 994 s of test time; 6:08 and 682 s
    # after these, 862 tests): redundant cases of a promise the fast set keeps in a sibling, named after each; the
    # seconds are the 8:43 run's.
    "tests/test_device.py::test_a_step_out_of_memory_is_replanned_and_its_losses_equal_an_uninterrupted_runs":
        "44 s (out-of-memory waits of the allocator); test_engine_errors.py::test_a_step_asked_not_to_re_plan_raises_"
        "out_of_memory_where_auto_would_re_plan keeps the re-plan on out of memory and its MAX_REPLANS stop (with "
        "the re-plan itself stubbed: a real re-plan's losses against an uninterrupted run's are this test's alone)",
    # one bad value of each check stays (named after each); ~1.7 s apiece, a runner process each
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[optimizer.learning_rate=nan]":
        "optimizer.learning_rate=inf stays (finite)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[optimizer.beta_1=2]":
        "optimizer.learning_rate=inf and =abc stay (an optimizer's numbers)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[optimizer.epsilon=0]":
        "optimizer.learning_rate=inf and =abc stay (an optimizer's numbers)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.seed=-1]":
        "batch=0 stays (an integer's range)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.profile_steps=[3,1]]":
        "train.inter_op_threads=many stays (a train field's value)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[batch=-5]":
        "batch=0 stays",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[batch=abc]":
        "batch=lots stays",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[sections=0]":
        "sections=[a,a] stays (the engine's sections rule)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[engine.memory_budget=150%]":
        "engine.memory_budget=abc stays",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[engine.policy=bad]":
        "engine.policy=stor stays (the same check, with its suggestion)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[engine._target_=bad]":
        "engine.lean=deep stays (an engine field's allowed values)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.progress=x]":
        "train.inter_op_threads=many stays (a train field's allowed values)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.inter_op_threads=0]":
        "train.inter_op_threads=many stays",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[train.gpu_memory=lots]":
        "train.inter_op_threads=many stays (a train field's allowed values)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[optimizer=adamw]":
        "resume with model=resnet stays (cannot change a _target_ on resume)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[batch=7]":
        "resume with model=resnet and +data.extra=1 stay (cannot change a key on resume)",
    "tests/test_runner_config.py::test_bad_input_exits_with_one_line_naming_the_key[resume={tmp}/nope]":
        "resume=/no/such/run stays",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[causal-tensor-dropout-float32]":
        "4 s; causal-tensor-no-dropout-float32 stays, dropout in causal-dropout-float64 and the XLA causal-tensor case",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[padding-dropout-float32]":
        "3 s; padding-no-dropout-float32 stays, dropout in causal-dropout-float64",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[causal-tensor-dropout-float64]":
        "3 s; float64 keeps Keras's both paths in causal-dropout-float64 and padding-no-dropout-float64",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[causal-dropout-float32]":
        "3 s; causal-dropout-float64 stays",
    "tests/test_lean_attention.py::test_under_mixed_precision_a_step_equals_keras_within_half_precision_rounding"
    "[mixed_bfloat16-0.016]":
        "4 s; [mixed_float16-0.002] stays",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[none-dropout-float32]":
        "2 s; [none-no-dropout-float32] stays, dropout in causal-dropout-float64",
    "tests/test_lean_attention.py::test_a_step_equals_keras_multi_head_attention[causal-no-dropout-float32]":
        "2 s; [causal-tensor-no-dropout-float32] and [causal-dropout-float64] stay",
    "tests/test_precision.py::test_gradients_are_unscaled_in_the_engine_and_the_baselines[Engine-mixed_bfloat16]":
        "4 s; [Engine-mixed_float16] stays (bfloat16 has no loss scale to unscale; its steps stay in "
        "test_sectioned_steps_equal_a_plain_loop_at_the_same_precision[mixed_bfloat16-None])",
    "tests/test_precision.py::test_a_keras_model_cut_by_from_keras_passes_the_exactness_report_at_its_precision"
    "[mixed_bfloat16-dtype0]":
        "2 s; [mixed_float16-dtype1] stays",
    "tests/test_engine_equivalence.py::test_compare_with_whole_reports_exactness_and_restores_state[WholeGraph-True]":
        "4 s; [Engine-True] (exact) and [RecomputeGrad-False] (not exact) stay",
    "tests/test_engine_distribute.py::test_sectioned_step_under_a_strategy_equals_a_whole_graph_step_under_it"
    "[recompute]":
        "7-10 s; [remade-inputs] stays (a sectioned step under the strategy, the default recompute policy, lean "
        "inputs re-made) and test_without_per_replica_statistics_...[recompute]",
    "tests/test_engine_equivalence.py::test_sectioned_step_equals_whole_graph_step[2-recompute]":
        "3 s; [1-recompute] and [2-store] stay",
    "tests/test_engine_equivalence.py::test_sectioned_step_equals_whole_graph_step[5-store]":
        "4 s; [5-['store','recompute','store','recompute','store']] stays (every block its own section)",
    "tests/test_engine_equivalence.py::test_sectioned_step_equals_whole_graph_step[['split/b','head']-"
    "['recompute','store','recompute']]":
        "3 s; [['split']-recompute] and [['gate']-...] stay",
    "tests/test_update.py::test_updates_in_the_backward_equal_one_update_after_a_whole_graph_step"
    "[names-adamw-clipnorm]":
        "3 s; [4-adamw-clipnorm] stays",
    "tests/test_update.py::test_updates_in_the_backward_equal_one_update_after_a_whole_graph_step[4-lion]":
        "3 s; [names-lion] stays",
    "tests/test_update.py::test_updates_in_the_backward_equal_one_update_after_a_whole_graph_step[names-adam-schedule]":
        "3 s; [4-adam-schedule] stays",
    "tests/test_update.py::test_updates_in_the_backward_equal_one_update_after_a_whole_graph_step[4-sgd-momentum]":
        "3 s; [names-sgd-momentum] stays",
    "tests/test_precision.py::test_gradients_are_unscaled_in_the_engine_and_the_baselines"
    "[RecomputeGrad-mixed_bfloat16]":
        "2 s; every trainer stays under mixed_float16 (the scaled loss; bfloat16 has none to unscale)",
    "tests/test_precision.py::test_gradients_are_unscaled_in_the_engine_and_the_baselines[WholeGraph-mixed_bfloat16]":
        "2 s; every trainer stays under mixed_float16 (the scaled loss; bfloat16 has none to unscale)",
    "tests/test_engine_distribute.py::test_without_per_replica_statistics_it_equals_one_device_on_the_global_batch"
    "[recompute-synchronized-bn]":
        "3 s; [recreate-synchronized-bn] and [recompute] stay",
    "tests/test_engine_distribute.py::test_without_per_replica_statistics_it_equals_one_device_on_the_global_batch"
    "[recreate]":
        "2 s; [recreate-synchronized-bn] stays",
    "tests/test_lean.py::test_convolutions_re_make_their_inputs_under_recompute[float64-pre]":
        "2 s; [float32-pre] and [float64-post] stay",
    "tests/test_lean.py::test_convolutions_re_make_their_inputs_under_recompute[float32-post]":
        "2 s; [float32-pre] and [float64-post] stay",
    "tests/test_lean.py::test_convolutions_re_make_their_inputs_under_recompute[mixed_float16-post]":
        "2 s; [mixed_float16-pre] and [mixed_bfloat16-post] stay",
    "tests/test_lean.py::test_convolutions_re_make_their_inputs_under_recompute[mixed_bfloat16-pre]":
        "2 s; [mixed_float16-pre] and [mixed_bfloat16-post] stay",
    "tests/test_lean.py::test_batch_norm_after_a_convolution[float64]":
        "1.4 s; [float32] stays",
    "tests/test_lean.py::test_batch_norm_after_a_convolution[mixed_bfloat16]":
        "1.3 s; [mixed_float16] stays",
    "tests/test_lean_attention_hub.py::test_keras_hub_gemma_attention_runs_lean_and_equals_its_own"
    "[multi-query-float32]":
        "8 s; [grouped-float32] stays (the same grouped-query path, 2 key-value heads for 1)",
    "tests/test_engine_one_graph.py::test_one_graph_step_equals_whole_graph_step[1]":
        "4 s; [2] stays",
    "tests/test_engine_one_graph.py::test_one_graph_step_equals_whole_graph_step[5]":
        "3 s; [2] stays",
    "tests/test_engine_one_graph.py::test_one_graph_step_equals_whole_graph_step[['split']]":
        "3 s; [['split/b', 'head']] stays",
    "tests/test_keras_hub.py::test_a_sectioned_step_equals_a_plain_tape_step[bert-encoder]":
        "7 s; [gpt2-decoder] (the same transformer layers, causal) and test_cut_points_..._backbone[bert] stay",
    "tests/test_from_keras.py::test_skip_connection_crossing_every_cut[4]":
        "5 s; [['conv_0', 'bn_1', 'drop_2']] stays (the same cuts by name)",
    "tests/test_verify.py::test_exact_steps_read_exact_with_biases_before_batch_norm[one-section]":
        "2 s; [whole] and [three-sections] stay",
    "tests/test_lean_attention.py::test_under_xla_a_step_with_dropout_equals_keras_and_a_masks_blocks_read_every_key"
    "[causal-tensor]": "13 s; XLA's other cases are slow too; lean attention without XLA stays in "
                       "test_a_step_equals_keras_multi_head_attention",
    "tests/test_keras_hub.py::test_the_runner_trains_a_gpt2_causal_lm_on_text[names]":
        "11 s; test_a_sectioned_step_equals_a_plain_tape_step[gpt2-decoder] keeps GPT-2 in sections, "
        "test_docs_commands parses the documented command, test_runner keeps a run end to end",
}


def stale_slow_cases(collected: list[str], args: list[str]) -> list[str]:
    """``SLOW_CASES`` ids that name no test of a file collected whole (a renamed test or parameter would otherwise
    leave its case in the fast set without a word); files narrowed to some tests (``file::test``) are not judged."""
    narrowed = {arg.split("::")[0] for arg in args if "::" in arg}
    files = {nodeid.split("::")[0] for nodeid in collected} - narrowed
    ids = set(collected)
    return sorted(case for case in SLOW_CASES if case.split("::")[0] in files and case not in ids)


def pytest_collection_modifyitems(config, items):
    import pytest

    stale = stale_slow_cases([item.nodeid for item in items], config.args)
    if stale:
        raise pytest.UsageError("tests/conftest.py SLOW_CASES names tests that do not exist (renamed? update "
                                "the entry): " + ", ".join(stale))
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


def pytest_runtest_teardown(item, nextitem):
    """A full garbage collection after each test file: collected late in a worker, the same garbage took 37-84 s in
    one collection, inside TensorFlow's deallocation of graph operations (BENCHMARKS.md, "Tried and not kept: one
    update per block, one region for the device; the suite's late collections")."""
    if nextitem is None or nextitem.module is not item.module:
        import gc

        gc.collect()
