"""Compare the runs of a sweep: a markdown table and PNG plots, times and memory as ratios to `whole`.

    python -m runner.report outputs/multirun/<date>/<time> [--out DIR]

Reads every `metrics.json` below the folder; writes `report.md`, `peak_vs_batch.png` and `frontier.png`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

MiB = 2**20


def load_runs(folder: Path) -> list[dict]:
    runs = []
    for path in sorted(folder.rglob("metrics.json")):
        run = json.loads(path.read_text())
        if run.get("strategy") is None or run.get("median_step_seconds") is None:
            continue
        run["folder"] = str(path.parent.relative_to(folder))
        runs.append(run)
    return runs


def label(run: dict) -> str:
    if run["strategy"] == "whole":
        return "whole" + _precision(run)
    policies = sorted(set(run["policies"][:-1])) or ["-"]
    policy = policies[0] if len(policies) == 1 else "mixed"
    planned = " (auto)" if run.get("memory_budget_bytes") else ""
    return f"{run['strategy']} {run['num_sections']}s {policy}{planned}" + _precision(run)


def _precision(run: dict) -> str:
    precision = run.get("precision", "float32")
    return "" if precision == "float32" else f" {precision}"


def with_ratios(runs: list[dict]) -> list[dict]:
    # the baseline: whole-graph in float32 at the same batch (else whole at any precision)
    whole = {r["batch"]: r for r in sorted(runs, key=lambda r: r.get("precision", "float32") == "float32")
             if r["strategy"] == "whole"}
    for r in runs:
        base = whole.get(r["batch"])
        r["time_ratio"] = r["median_step_seconds"] / base["median_step_seconds"] if base else None
        r["peak_ratio"] = (r["step_peak_bytes"] / base["step_peak_bytes"]
                           if base and base.get("step_peak_bytes") and r.get("step_peak_bytes") else None)
        r["whole_peak_bytes"] = base.get("step_peak_bytes") if base else None
    return runs


def max_batch_under(runs: list[dict], budget: float) -> dict[str, float]:
    """Per configuration, the batch whose predicted peak (a line through the measured peaks) meets ``budget``."""
    by_label = defaultdict(list)
    for r in runs:
        if r.get("step_peak_bytes"):
            by_label[label(r)].append((r["batch"], r["step_peak_bytes"]))
    out = {}
    for name, points in by_label.items():
        points = sorted(set(points))
        if len({b for b, _ in points}) < 2:  # one batch size: no line to fit
            continue
        n = len(points)
        mx = sum(b for b, _ in points) / n
        my = sum(p for _, p in points) / n
        slope = sum((b - mx) * (p - my) for b, p in points) / sum((b - mx) ** 2 for b, _ in points)
        if slope > 0:
            out[name] = (budget - (my - slope * mx)) / slope
    return out


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


# One letter per policy in the table (its legend says which): re-run, store, multi-level re-create.
POLICY_LETTERS = {"recompute": "r", "store": "s", "recreate": "c"}


def table(runs: list[dict]) -> str:
    head = ("| job | strategy | sections | policy | batch | median step s | time / whole | peak MiB | peak / whole "
            "| forward runs | exact | planner predicted MiB | metric |\n" + "|---" * 13 + "|")
    legend = "\n\npolicy: r = recompute, s = store, c = recreate (multi-level recompute)"
    rows = []
    order = {"whole": 0, "recompute_grad": 1, "sectioned": 2}
    for r in sorted(runs, key=lambda r: (r["batch"], order.get(r["strategy"], 3), r["num_sections"], label(r))):
        policies = ",".join(POLICY_LETTERS.get(p, p) for p in r["policies"])
        predicted = r.get("predicted_peak_bytes")
        rows.append(
            f"| {r.get('folder', '-')} | {r['strategy']}{_precision(r)} "
            f"| {r['num_sections']} ({'+'.join(map(str, r['section_blocks']))}) | {policies} "
            f"| {r['batch']} | {_fmt(r['median_step_seconds'], '.3f')} | {_fmt(r['time_ratio'], '.2f')} "
            f"| {_fmt(r['step_peak_bytes'] and r['step_peak_bytes'] / MiB, '.0f')} | {_fmt(r['peak_ratio'], '.2f')} "
            f"| {r.get('forward_runs_per_section')} | {'yes' if r.get('exact') else 'no' if 'exact' in r else '-'} "
            f"| {_fmt(predicted and predicted / MiB, '.0f')} | {_metric(r)} |")
    return head + "\n" + "\n".join(rows) + legend


def _metric(run: dict) -> str:
    """The run's eval metric, e.g. `accuracy 0.9833`."""
    name = run.get("metric")
    value = run.get(name) if name else None
    return f"{name} {value:.4g}" if isinstance(value, (int, float)) else "-"


def plots(runs: list[dict], out: Path) -> tuple[list[Path], list[str]]:
    """The plots that can be drawn, and for each one that cannot, why."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, skipped = [], []
    series = defaultdict(list)
    for r in runs:
        if r.get("step_peak_bytes"):
            series[label(r)].append((r["batch"], r["step_peak_bytes"] / MiB))
    if not series:
        skipped.append("peak_vs_batch.png: no run measured its peak memory")
    else:
        drawn.append(_peak_plot(plt, series, out / "peak_vs_batch.png"))
    compared = [r for r in runs if r["time_ratio"] is not None and r["peak_ratio"] is not None]
    if not compared:
        skipped.append("frontier.png: no `whole` run at the same batch to take ratios against "
                       "(add engine=whole to the sweep)")
    else:
        drawn.append(_frontier_plot(plt, compared, out / "frontier.png"))
    return drawn, skipped


def _peak_plot(plt, series: dict, first: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, points in sorted(series.items()):
        points.sort()
        ax.plot([b for b, _ in points], [p for _, p in points], marker="o", label=name)
    ax.set(xlabel="batch", ylabel="measured step peak (MiB)", title="Peak memory against batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(first, dpi=120)
    plt.close(fig)
    return first


def _frontier_plot(plt, runs: list[dict], second: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    markers = {"whole": "s", "recompute_grad": "^", "sectioned": "o"}
    colors = {"whole": "tab:green", "recompute_grad": "tab:orange", "sectioned": "tab:blue"}
    for r in runs:
        planned = bool(r.get("memory_budget_bytes"))  # sections=auto: the planner's choice under a budget
        name = (f"sectioned auto (planner{', lean' if r.get('lean') else ''})" if planned else r["strategy"])
        color = ("tab:purple" if r.get("lean") else "tab:red") if planned else colors.get(r["strategy"], "black")
        ax.scatter(r["peak_ratio"], r["time_ratio"], marker="*" if planned else markers.get(r["strategy"], "x"),
                   color=color, label=name,
                   s=80 if planned else None)
        note = f"{r['num_sections']}s b{r['batch']}"
        whole = r.get("whole_peak_bytes")
        if planned and whole:
            note += f" budget {r['memory_budget_bytes'] / whole:.2f}"
        ax.annotate(note, (r["peak_ratio"], r["time_ratio"]), fontsize=6)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set(xlabel="peak memory / whole", ylabel="step time / whole", title="Time against memory (same batch)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(second, dpi=120)
    plt.close(fig)
    return second


def report(folder: Path, out: Path | None = None) -> Path:
    runs = with_ratios(load_runs(folder))
    if not runs:
        raise SystemExit(f"error: no runs with metrics.json under {folder}")
    out = out or folder
    out.mkdir(parents=True, exist_ok=True)
    pictures, skipped = plots(runs, out)
    for why in skipped:
        print(f"skipped {why}", file=sys.stderr)
    text = [f"# Sweep report: {folder}", "", table(runs), ""]
    whole = [r for r in runs if r["strategy"] == "whole" and r.get("step_peak_bytes")]
    if whole:
        ref = max(whole, key=lambda r: r["batch"])
        budget = ref["step_peak_bytes"]
        fits = max_batch_under(runs, budget)
        if fits:
            text += [f"## Largest batch within {budget / MiB:.0f} MiB (whole's peak at batch {ref['batch']})", "",
                     "| configuration | batch | / whole |", "|---|---|---|"]
            base = fits.get("whole")
            for name, batch in sorted(fits.items(), key=lambda kv: -kv[1]):
                text.append(f"| {name} | {batch:.0f} | {_fmt(base and batch / base, '.2f')} |")
            text.append("")
    planned = [r for r in runs if r.get("memory_budget_bytes")]
    if planned:
        text += ["## Planner: budget, prediction, measurement", "",
                 "| budget MiB | predicted MiB | measured MiB | measured / predicted | within budget |",
                 "|---|---|---|---|---|"]
        for r in sorted(planned, key=lambda r: r["memory_budget_bytes"]):
            b, p, m = r["memory_budget_bytes"], r["predicted_peak_bytes"], r["step_peak_bytes"]
            text.append(f"| {b / MiB:.0f} | {p / MiB:.0f} | {m / MiB:.0f} | {m / p:.2f} | {'yes' if m <= b else 'NO'} |")
        text.append("")
    text += [f"![{p.stem}]({p.name})" for p in pictures]
    text += [f"Not drawn: {why}." for why in skipped]
    path = out / "report.md"
    path.write_text("\n".join(text) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a sweep folder (outputs/multirun/<date>/<time>)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the sweep folder)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder", file=sys.stderr)
        return 2
    print(report(args.folder, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
