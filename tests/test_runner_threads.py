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
