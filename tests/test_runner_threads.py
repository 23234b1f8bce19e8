"""train.inter_op_threads: set before TensorFlow's runtime starts; a second value in one process is one line."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    from runner.errors import ConfigError
    from runner.platform.threads import set_inter_op_threads
    import tensorflow as tf

    set_inter_op_threads(1)
    tf.reduce_sum(tf.ones([4]))  # the runtime starts here
    assert tf.config.threading.get_inter_op_parallelism_threads() == 1
    set_inter_op_threads(1)      # a sweep's next job with the same value
    set_inter_op_threads(None)   # null: leave it
    try:
        set_inter_op_threads(2)
    except ConfigError as err:
        print("ERROR", err)
""")

@pytest.mark.slow  # ~6 s

def test_threads_are_set_once_and_a_different_value_later_names_the_way_out():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [l for l in proc.stdout.splitlines() if l.startswith("ERROR")]
    assert line == ["ERROR train.inter_op_threads=2: TensorFlow already started in this process with 1 inter-op "
                    "thread(s), and a process sets it once: give every job of a sweep the same value, or run each "
                    "job in its own process (hydra/launcher=joblib or submitit_local)"]


AUTO = textwrap.dedent("""
    from runner.platform.threads import resolve_inter_op_threads, set_inter_op_threads
    import tensorflow as tf

    assert resolve_inter_op_threads("auto", "sections.Engine") == 1
    assert resolve_inter_op_threads("auto", "sections.RecomputeGrad") is None
    assert resolve_inter_op_threads("auto", "sections.WholeGraph") is None
    assert resolve_inter_op_threads(3, "sections.RecomputeGrad") == 3
    print("BASELINE", set_inter_op_threads("auto", "sections.RecomputeGrad"))  # TensorFlow's default: 0
    tf.reduce_sum(tf.ones([4]))  # the runtime starts here
    print("ENGINE", set_inter_op_threads("auto", "sections.Engine"))  # too late for 1: keeps the default, no error
""")


@pytest.mark.slow  # ~6 s
def test_auto_threads_run_baselines_as_users_do_and_never_fail_a_sweep():
    proc = subprocess.run([sys.executable, "-c", AUTO], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [l for l in proc.stdout.splitlines() if l.startswith(("BASELINE", "ENGINE"))]
    assert lines == ["BASELINE 0", "ENGINE 0"]
