import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from sections.allocator import configure  # noqa: E402

configure()  # the project's own CPU allocator setting (memory statistics on every CPU), as the runner's


def _two_logical_cpus() -> None:
    """Split the CPU into 2 logical devices before TensorFlow initializes them, so MirroredStrategy tests
    (tests/test_engine_distribute.py) have 2 replicas in this process; single-device code runs on CPU:0."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:  # already initialized (a test process that imported TensorFlow earlier)
        pass


_two_logical_cpus()
