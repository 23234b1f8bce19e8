"""The peak-vs-time frontier from ``frontier.py``'s raw tables: one marker style per file, one point per job that
ran (peak / whole against time / whole, each against the whole-graph step measured in the same sweep).

    python docs/bench/targets/plot.py docs/bench/targets/frontier_resnet_2048.png \\
        "before (one thread)=docs/bench/targets/resnet_2048_interop1.txt" \\
        "fused batch norm=docs/bench/targets/resnet_2048_fused.txt"
"""
import sys
from pathlib import Path


def points(path: Path) -> list[tuple[str, float, float]]:
    """``(job, peak / whole, time / whole)`` for every table row of a job that ran (not the whole baselines)."""
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 10 or not cells[0] or cells[0] == "job" or cells[0].startswith("---"):
            continue
        try:
            peak, time = float(cells[5]), float(cells[9])
        except ValueError:
            continue
        if not cells[0].startswith("whole"):
            rows.append((cells[0], peak, time))
    return rows


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, *specs = sys.argv[1:]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([1.0], [1.0], marker="s", color="black", label="whole")
    for spec, marker in zip(specs, "ovD^x+*"):
        label, path = spec.split("=", 1)
        rows = points(Path(path))
        ax.scatter([p for _, p, _ in rows], [t for _, _, t in rows], marker=marker, label=label)
        for job, p, t in rows:
            ax.annotate(job.replace(" lean ", " "), (p, t), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("peak / whole's peak")
    ax.set_ylabel("step time / whole's")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
