"""Sum a tf.profiler trace's TensorFlow op time by op type (host CPU threads), largest first.

    python docs/bench/transformer/op_times.py PROFILE_DIR [--top 25]

Reads the newest ``*.xplane.pb`` under PROFILE_DIR (as written by ``bench_transformer.py --profile``). An op's
time is the sum of its events' durations over every executor thread (so on 2 cores the total can exceed the wall
time); the op type is the part after the last ``:`` of the event's name (``name:Type``), else the name.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os


def op_times(folder: str) -> tuple[collections.Counter, collections.Counter, float]:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = max(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    seconds, counts = collections.Counter(), collections.Counter()
    first, last = None, None
    for plane in space.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name:  # executor bookkeeping, Python frames: not an op
                    continue
                kind = name.rsplit(":", 1)[1]
                seconds[kind] += event.duration_ps * 1e-12
                counts[kind] += 1
                start = line.timestamp_ns * 1e-9 + event.offset_ps * 1e-12
                first = start if first is None else min(first, start)
                last = start + event.duration_ps * 1e-12 if last is None else max(last, start + event.duration_ps * 1e-12)
    return seconds, counts, (last - first) if first is not None else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    seconds, counts, span = op_times(args.folder)
    total = sum(seconds.values())
    print(f"ops: {total:.3f} s summed over threads, span {span:.3f} s")
    for kind, s in seconds.most_common(args.top):
        print(f"  {kind:40s} {s:8.3f} s  {100 * s / total:5.1f}%  x{counts[kind]}")


if __name__ == "__main__":
    main()
