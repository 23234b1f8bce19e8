"""The largest batch each strategy trains on a device of fixed memory, and its speed there (issue 36's targets).

Each job is one `python -m runner ... batch=max` process on an emulated device (TF_CPU_BFC_MEM_LIMIT_IN_MB: the
CPU allocator with a hard limit, as a GPU has): `engine=whole`, `engine=recompute_grad` (4
sections) and `sections=auto`, each with no budget (the device's memory less headroom). Reads each run's
metrics.json: the batch batch=max chose, its trials, examples per second over the run's steps, the step peak.
Writes `results.json`, a markdown table and a plot of device memory against the largest batch.

    PYTHONPATH=. python docs/bench/device/largest_batch.py --model resnet --devices 1024,2048 --out outputs/bench/device
    PYTHONPATH=. python docs/bench/device/largest_batch.py --model ResNet50 --devices 1024,2048 --out outputs/bench/device50
    PYTHONPATH=. python docs/bench/device/largest_batch.py --combine a/results.json b/results.json --out docs/bench/device
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = {
    # the notebook's ResNet on 28x28x1 images (the partialflow notebook's MNIST shape)
    "resnet": ["model=resnet", "data=synthetic", "data.image_shape=[28,28,1]", "data.train_size=16384"],
    "ResNet50": ["model=keras_app", "model.name=ResNet50", "model.input_shape=[96,96,3]", "data=synthetic",
                 "data.image_shape=[96,96,3]", "data.train_size=2048", "optimizer=sgd"],
}
# tf.recompute_grad around each of 4 sections (keras.applications models default to one section: no checkpoint)
ENGINES = {"whole": ["engine=whole"], "recompute_grad": ["engine=recompute_grad", "sections=4"],
           "auto": ["sections=auto"]}
COMMON = ["batch=max", "train.verify_exact=false", "train.eval_every=0", "train.save_model=false",
          "train.checkpoint_every=0", "train.progress=log"]


def run(model: str, device: int, engine: str, steps: int, out: Path) -> dict:
    folder = out / f"{model}_{device}MiB_{engine}"
    env = {**os.environ, "TF_CPU_BFC_MEM_LIMIT_IN_MB": str(device), "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("TF_ENABLE_ONEDNN_OPTS", None)
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "runner", *MODELS[model], *ENGINES[engine], *COMMON,
                           f"train.steps={steps}", f"hydra.run.dir={folder}"], env=env, capture_output=True,
                          text=True)
    row = {"model": model, "device_MiB": device, "engine": engine, "exit": proc.returncode,
           "wall_seconds": round(time.perf_counter() - began, 1)}
    if proc.returncode != 0:
        row["error"] = next((line for line in proc.stderr.splitlines() if line.startswith("error:")),
                            proc.stderr[-400:])
        return row
    m = json.loads((folder / "metrics.json").read_text())
    row.update(batch=m["batch"], examples_per_second=m["examples_per_second"],
               step_peak_MiB=round(m["step_peak_bytes"] / 2**20, 1), sections=m["num_sections"],
               trials=[(t["batch"], t["fits"]) for t in m.get("batch_max_trials", [])])
    return row


def table(rows: list) -> str:
    lines = ["| model | device | engine | largest batch | vs whole | examples/s | step peak | sections | search |",
             "|---|---|---|---|---|---|---|---|---|"]
    whole = {(r["model"], r["device_MiB"]): r.get("batch") for r in rows if r["engine"] == "whole"}
    for r in rows:
        if "batch" not in r:
            lines.append(f"| {r['model']} | {r['device_MiB']} MiB | {r['engine']} | failed: {r.get('error')} |"
                         " | | | | |")
            continue
        base = whole.get((r["model"], r["device_MiB"]))
        ratio = f"{r['batch'] / base:.2f}x" if base else "-"
        lines.append(f"| {r['model']} | {r['device_MiB']} MiB | {r['engine']} | {r['batch']} | {ratio} | "
                     f"{r['examples_per_second']:.0f} | {r['step_peak_MiB']} MiB | {r['sections']} | "
                     f"{len(r['trials'])} trials, {r['wall_seconds']:.0f} s |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for engine in ENGINES:
        points = sorted((r["device_MiB"], r["batch"]) for r in rows if r["engine"] == engine and "batch" in r)
        if points:
            ax.plot(*zip(*points), marker="o", label=engine)
    ax.set_xlabel("device memory (MiB, emulated)")
    ax.set_ylabel("largest batch that trains")
    ax.set_title(f"{rows[0]['model']}: largest trainable batch")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="resnet")
    parser.add_argument("--devices", default="1024,2048", help="device sizes in MiB, comma-separated")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("outputs/bench/device"))
    parser.add_argument("--combine", nargs="+", type=Path, help="results.json files: one table and plot of them all")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.combine:
        rows = [row for path in args.combine for row in json.loads(path.read_text())]
        plot(rows, args.out / f"largest_batch_{rows[0]['model']}.png")
        print(table(rows))
        return
    rows = []
    for device in [int(d) for d in args.devices.split(",")]:
        for engine in args.engines.split(","):
            rows.append(run(args.model, device, engine, args.steps, args.out))
            print(json.dumps(rows[-1]), flush=True)
            (args.out / "results.json").write_text(json.dumps(rows, indent=1))
    (args.out / "table.md").write_text(table(rows) + "\n")
    plot(rows, args.out / f"largest_batch_{args.model}.png")
    print(table(rows))


if __name__ == "__main__":
    main()
