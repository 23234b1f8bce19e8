"""Does streaming PNG files slow training down, and does memory stay bounded by the pipeline?

    PYTHONPATH=. python docs/bench/data/input_pipeline.py speed  --images 1024 --size 32 --batch 256 --steps 12
    PYTHONPATH=. python docs/bench/data/input_pipeline.py memory --gib 4 --size 224 --batch 256 [FOLDER]

speed: the project's ResNet (models.build_resnet, whole-graph engine) trains on a folder of PNGs through
data=image_folder and on the same images held in memory (ImageSource, what data=mnist/digits use), steps
alternating between the two so both see the same machine load; prints the median step times and their ratio.

memory: writes a folder of PNGs whose decoded size totals --gib GiB (smooth images compress to small files; a
child process writes them), then trains one epoch on it with `python -m runner data=image_folder model=mlp` at
--batch and prints that training process's peak resident memory (ru_maxrss of the child).
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GiB = 2**30


def write_folder(root: Path, count: int, size: int, classes: int = 10, smooth: bool = False) -> Path:
    import tensorflow as tf

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, size, dtype=np.float32)
    for i in range(count):
        folder = root / f"class_{i % classes}"
        folder.mkdir(parents=True, exist_ok=True)
        if smooth:  # compresses well: a 4 GiB decoded folder stays small on disk
            a, b = rng.uniform(0, 1, 2)
            image = (a * ramp[:, None, None] + b * ramp[None, :, None]) / (a + b + 1e-6)
            image = np.broadcast_to(image, (size, size, 3)).astype(np.uint8)
        else:
            image = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        tf.io.write_file(str(folder / f"{i:06d}.png"), tf.io.encode_png(image))
    return root


def speed(args) -> None:
    import keras
    import tensorflow as tf

    from models import build_resnet
    from models.data import ImageSource, image_folder
    from sections import WholeGraph

    with tempfile.TemporaryDirectory() as tmp:
        root = write_folder(Path(tmp) / "pngs", args.images, args.size)
        files = image_folder(str(root), validation_split=0.05)
        # The very same decoded images (train split, same labels), in memory.
        paths = files._train_paths.numpy()
        images = np.stack([tf.io.decode_png(tf.io.read_file(p), channels=3).numpy() for p in paths])
        labels = files._train_labels.numpy()
        memory = ImageSource("memory", (images, labels), (images[:8], labels[:8]), scale=1 / 255)
        engines, streams = {}, {}
        for name, source in (("files", files), ("memory", memory)):
            keras.utils.set_random_seed(0)
            net = build_resnet(num_classes=10, input_shape=(args.size, args.size, 3))
            engines[name] = WholeGraph(net, keras.optimizers.Adam(1e-3))
            streams[name] = iter(source.train_batches(args.batch, 0))
            engines[name].train_step(next(streams[name]))  # trace, build
        times = {"files": [], "memory": []}
        for _ in range(args.steps):
            for name in ("files", "memory"):
                began = time.perf_counter()
                engines[name].train_step(next(streams[name]))  # the batch wait is part of the step
                times[name].append(time.perf_counter() - began)
        f, m = statistics.median(times["files"]), statistics.median(times["memory"])
        print(f"cores {os.cpu_count()}, resnet, batch {args.batch}, {args.size}x{args.size}x3 PNGs, "
              f"{args.steps} alternating steps each")
        print(f"median step: files {f:.3f} s, memory {m:.3f} s, ratio files/memory {f / m:.3f}")


def memory(args) -> None:
    count = int(np.ceil(args.gib * GiB / (args.size * args.size * 3)))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.folder) if args.folder else Path(tmp) / "pngs"
        began = time.perf_counter()
        if not root.is_dir():  # the PNGs are written by a child process, so its memory is not counted here
            subprocess.run([sys.executable, __file__, "write", str(root), "--size", str(args.size), "--images",
                            str(count)], check=True)
        disk = sum(p.stat().st_size for p in root.rglob("*.png"))
        count = sum(1 for _ in root.rglob("*.png"))
        print(f"{count} PNGs of {args.size}x{args.size}x3: decoded {count * args.size ** 2 * 3 / GiB:.2f} GiB, "
              f"{disk / 2**20:.0f} MiB on disk (ready in {time.perf_counter() - began:.0f} s)")
        steps = int(count * 0.99) // args.batch + 1  # one epoch and a bit
        command = [sys.executable, "-m", "runner", "data=image_folder", f"data.path={root}",
                   "data.validation_split=0.01", "model=mlp", "model.hidden=[32]", f"batch={args.batch}",
                   f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.verify_exact=false",
                   "train.progress=log", "train.log_every=20", f"hydra.run.dir={Path(tmp) / 'run'}"]
        began = time.perf_counter()
        subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[3])
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
        print(f"python -m runner data=image_folder model=mlp batch {args.batch}: {steps} steps (one epoch) in "
              f"{time.perf_counter() - began:.0f} s; peak RSS of the training process {peak:.2f} GiB")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("speed", "memory", "write"))
    ap.add_argument("folder", nargs="?", help="memory: an existing folder of PNGs to train on; write: where to write")
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--gib", type=float, default=4.0)
    args = ap.parse_args()
    if args.mode == "memory" and args.size == 32:
        args.size = 224
    if args.mode == "write":
        write_folder(Path(args.folder), args.images, args.size, smooth=True)
    else:
        speed(args) if args.mode == "speed" else memory(args)


if __name__ == "__main__":
    main()
