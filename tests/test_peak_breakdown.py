"""What held a step's peak (`runner.record.peak`): the allocator trace replayed, against the allocator statistics."""

from __future__ import annotations

import re

import keras

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
