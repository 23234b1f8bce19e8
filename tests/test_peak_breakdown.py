"""What held a step's peak (`runner.record.peak`): the allocator trace replayed, against the allocator statistics."""

from __future__ import annotations

import re

import keras
import pytest

from engine_nets import conv_stack, make_batch
from runner.record import peak
from runner.run.hooks import Profiler
from sections import Engine


def _alloc(addr, nbytes, in_use, op, shape="[1]", allocator="bfc", requested=None):
    return ("MemoryAllocation", {"addr": addr, "allocation_bytes": nbytes, "bytes_allocated": in_use, "tf_op": op,
                                 "requested_bytes": nbytes if requested is None else requested,
                                 "shape": shape, "region_type": "output", "allocator_name": allocator})


def _free(addr, in_use, allocator="bfc"):
    return ("MemoryDeallocation", {"addr": addr, "bytes_allocated": in_use, "allocator_name": allocator})


def test_the_peak_is_the_largest_bytes_in_use_and_what_was_live_then():
    events = [
        _alloc(1, 10, 110, "block_1/conv/Conv2D"),  # 100 bytes were in use before the trace began
        _alloc(2, 20, 130, "block_2/conv/Conv2D", "[2,3]", requested=12),  # an unsplit chunk
        _alloc(3, 7, 7, "other/Op", allocator="small"),  # a second allocator with a lower peak
        _free(1, 120),
        _alloc(4, 5, 125, "block_3/dense/MatMul"),
    ]
    found = peak.breakdown(events, statistics=140)
    assert (found.allocator, found.peak, found.before) == ("bfc", 130, 100)
    assert [(h.place, h.nbytes, h.count) for h in found.held] == [("block/conv/Conv2D", 30, 2)]
    assert found.held[0].shapes == {"[1]", "[2,3]"}
    assert found.slack() == 8 and "beyond what their tensors asked for" in found.table()
    assert "more than the trace shows" in found.table() and "130 bytes" in found.table()
    assert peak.breakdown([]) is None


def test_a_profiled_engine_step_names_the_activations_that_held_its_peak(tmp_path):
    """Tensors of 4 MiB (above the 256 KiB under which oneDNN's allocator keeps allocations out of the trace): the
    trace's peak is the allocator statistics' step peak, and conv outputs at the batch's shape are among what held
    it (beside kernel scratch: Eigen's filter gradient takes a 32 MiB temporary here)."""
    batch = make_batch(n=64, size=32, classes=10)
    engine = Engine(conv_stack(depth=4, filters=16), keras.optimizers.SGD(0.1), sections=2)
    engine.build(batch)
    engine.train_step(batch)
    hook = Profiler([2, 2], tmp_path)
    hook.on_step_begin(2)
    stats = engine.train_step(batch)
    hook.on_step_end(2, stats, 0.0)
    text = (tmp_path / "peak_breakdown.md").read_text()
    traced = int(re.search(r"\((\d+) bytes", text).group(1))
    assert traced == stats["step_peak_bytes"], text
    assert "more than the trace shows" not in text
    found = peak.read(tmp_path / "plugins" / "profile")
    activations = sum(h.count for h in found.held if "[64,32,32,16]" in h.shapes and "conv" in h.place)
    assert activations >= 2, text
    assert engine.meter.available and stats["step_peak_bytes"] > 0  # statistics on: a real comparison


def test_an_unreadable_profile_is_one_warning_not_an_error(tmp_path, caplog):
    """The breakdown is a diagnostic written as the profile stops, also when a run fails: it must not raise."""
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    (folder / "host.xplane.pb").write_bytes(b"not a profile")
    hook = Profiler([1, 1], tmp_path)
    with caplog.at_level("WARNING", logger="runner"):
        hook._write_breakdown()
    assert "could not be read" in caplog.text and not (tmp_path / "peak_breakdown.md").exists()


# ---------------------------------------------------------------------------------------------- out of memory
class RunsOut:
    """An engine whose first `runs_out` steps run out of memory; counts its steps."""

    plan = None

    def __init__(self, runs_out: int = 2):
        self.runs_out, self.steps = runs_out, 0

    def train_step(self, batch, replan=True):
        from sections import OutOfMemory

        self.replans = getattr(self, "replans", []) + [replan]
        self.steps += 1
        if self.steps <= self.runs_out:
            raise OutOfMemory("out of memory on a test device", None, 4096, "[1024] float", 0)
        return {"loss": 0.0, "step_peak_bytes": None}


def stop_line(engine, on_oom) -> str:
    """The one line an out-of-memory stop of `engine`'s first step ends with (the OutOfMemoryStop's message)."""
    from runner.errors import OutOfMemoryStop
    from runner.run.hooks import Hooks
    from runner.run.train import _loop

    with pytest.raises(OutOfMemoryStop) as stopped:
        _loop(engine, iter(()), Hooks([]), 0, 3, first={"x": 1}, on_oom=on_oom)
    text = str(stopped.value)
    assert text.startswith("step 1: out of memory on a test device") and "\n" not in text
    return text


def test_a_failing_profiler_leaves_the_out_of_memory_stop_saying_why_there_is_no_breakdown(tmp_path, monkeypatch):
    import tensorflow as tf

    from runner.run.oom import OomBreakdown

    def busy(logdir, options=None):
        raise tf.errors.UnavailableError(None, None, "Another profiler is running.")

    monkeypatch.setattr(tf.profiler.experimental, "start", busy)
    engine = RunsOut()
    text = stop_line(engine, OomBreakdown(engine, tmp_path))
    assert text.endswith("nothing of step 1 was saved; no peak breakdown: UnavailableError: Another profiler is "
                         "running."), text
    assert engine.steps == 1 and not (tmp_path / "peak_breakdown.md").exists()


def test_a_re_run_that_fits_or_traces_nothing_writes_no_breakdown(tmp_path, monkeypatch):
    from runner.record import peak
    from runner.run.oom import OomBreakdown

    engine = RunsOut(runs_out=1)
    assert stop_line(engine, OomBreakdown(engine, tmp_path)).endswith(
        "; no peak breakdown: its re-run under the profiler did not run out of memory")
    assert engine.steps == 2 and (tmp_path / "oom_profile").is_dir()  # profiled, apart from plugins/profile
    monkeypatch.setattr(peak, "read", lambda folder, statistics=None: None)
    engine = RunsOut()
    assert stop_line(engine, OomBreakdown(engine, tmp_path)).endswith(
        "; no peak breakdown: the profile traced no allocation")
    assert not (tmp_path / "peak_breakdown.md").exists()


def test_no_re_run_when_switched_off_across_workers_or_while_a_profile_traces_the_step(tmp_path):
    from runner.run.oom import OomBreakdown

    engine = RunsOut()
    assert stop_line(engine, OomBreakdown(engine, tmp_path, enabled=False)).endswith(
        "nothing of step 1 was saved")
    assert stop_line(engine, OomBreakdown(engine, tmp_path, workers=2)).endswith(
        "; no peak breakdown: not re-run on one of 2 workers (the others would wait on it)")

    class Profiling:
        active, stopped_at = True, None

        def stop_at(self, step):
            self.stopped_at = step
            return tmp_path / "peak_breakdown.md"

    engine, profiling = RunsOut(), Profiling()
    text = stop_line(engine, OomBreakdown(engine, tmp_path, profiler=profiling))
    assert text.endswith(f"; what held memory: {tmp_path / 'peak_breakdown.md'}") and profiling.stopped_at == 1
    assert engine.steps == 1  # the running profile traced the failed step: no re-run


def test_the_re_run_asks_the_engine_not_to_re_plan(tmp_path):
    """With ``sections=auto`` the engine re-plans a step that runs out of memory (dry steps): the diagnostic
    re-run asks for the step as compiled (``replan=False``), so the trace's peak is that step's, not a dry
    step's."""
    from runner.run.oom import OomBreakdown

    engine = RunsOut()
    text = stop_line(engine, OomBreakdown(engine, tmp_path))
    assert engine.replans == [True, False], engine.replans
    assert "did not run out of memory" not in text and "Error" not in text, text  # its OutOfMemory was the re-run's
