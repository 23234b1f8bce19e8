"""The step's readings as one typed record, and the names it is written under (``sections.telemetry``)."""

import keras
import numpy as np
import pytest

from sections import Engine, telemetry
from engine_nets import conv_stack, make_batch


def test_a_step_returns_a_reading_that_reads_as_a_dict_too():
    engine = Engine(conv_stack(depth=4), keras.optimizers.SGD(0.1), sections=2)
    reading = engine.train_step(make_batch(n=16, size=8, classes=10))
    assert isinstance(reading, telemetry.StepReading)
    assert reading["loss"] == reading.loss and np.isfinite(reading.loss)
    assert dict(reading).keys() == {"loss", "forward_runs", "peak_bytes", "step_peak_bytes", "device_peak_bytes"}
    assert reading.forward_runs == [2, 1]
    with pytest.raises(KeyError):
        reading["nope"]


def test_scalars_name_every_section_and_leave_what_was_not_measured_as_none():
    reading = telemetry.StepReading(loss=0.5, forward_runs=[2, 1], peak_bytes=[2**20, None], step_peak_bytes=3 * 2**20,
                                    device_peak_bytes={"CPU:0": 3 * 2**20})
    assert reading.scalars() == {"loss/train": 0.5, "memory_MiB/step_peak": 3.0, "memory_MiB/section_0": 1.0,
                                 "memory_MiB/section_1": None, "forward_runs/section_0": 2,
                                 "forward_runs/section_1": 1}
    two = telemetry.StepReading(0.5, [1], [None], 2**20, {"GPU:0": 2**20, "GPU:1": None})
    assert two.scalars()["memory_MiB/step_peak/GPU_0"] == 1.0 and two.scalars()["memory_MiB/step_peak/GPU_1"] is None


def test_memory_figures_over_a_run():
    steps = [telemetry.StepReading(1.0, [2, 1], [5, 7], 9, {}), telemetry.StepReading(1.0, [2, 1], [6, None], 8, {}),
             telemetry.StepReading(1.0, [2, 1], [4, 3], 6, {})]
    assert telemetry.memory_figures(steps) == {"step_peak_bytes": 9, "median_step_peak_bytes": 7.0,
                                               "peak_bytes_per_section": [6, 7], "forward_runs_per_section": [2, 1]}
    assert telemetry.memory_figures([])["step_peak_bytes"] is None
