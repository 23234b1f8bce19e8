"""runner.report: ratios to whole from the same sweep, largest batch within a budget, plots written."""

import json

import pytest

from runner.report import main, max_batch_under, with_ratios

MiB = 2**20


def run(strategy, sections, batch, seconds, peak_mib, exact=True, **extra):
    return {"metric": "accuracy", "accuracy": 0.9, "strategy": strategy, "batch": batch, "num_sections": sections, "section_blocks": [1] * sections,
            "policies": ["recompute"] * sections, "median_step_seconds": seconds,
            "step_peak_bytes": int(peak_mib * MiB), "forward_runs_per_section": [2] * (sections - 1) + [1],
            "exact": exact, **extra}


def write_sweep(root, runs):
    for i, r in enumerate(runs):
        (root / str(i)).mkdir()
        (root / str(i) / "metrics.json").write_text(json.dumps(r))


def test_ratios_are_taken_against_whole_at_the_same_batch():
    runs = with_ratios([run("whole", 1, 512, 2.0, 400), run("sectioned", 4, 512, 2.5, 160),
                        run("whole", 1, 1024, 4.0, 800), run("sectioned", 4, 1024, 5.0, 300)])
    assert [round(r["time_ratio"], 3) for r in runs] == [1.0, 1.25, 1.0, 1.25]
    assert [round(r["peak_ratio"], 3) for r in runs] == [1.0, 0.4, 1.0, 0.375]


def test_largest_batch_within_budget_follows_the_measured_line():
    runs = [run("whole", 1, 512, 2.0, 400), run("whole", 1, 1024, 4.0, 800),
            run("sectioned", 4, 512, 2.5, 160), run("sectioned", 4, 1024, 5.0, 300)]
    fits = max_batch_under(runs, 800 * MiB)
    assert fits["whole"] == pytest.approx(1024)
    assert fits["sectioned 4s recompute"] == pytest.approx(512 + (800 - 160) / (140 / 512))


def test_report_writes_markdown_and_plots(tmp_path):
    write_sweep(tmp_path, [run("whole", 1, 512, 2.0, 400), run("recompute_grad", 4, 512, 2.4, 180, exact=False),
                           run("sectioned", 4, 512, 2.3, 170),
                           run("sectioned", 2, 512, 2.1, 250, memory_budget_bytes=300 * MiB,
                               predicted_peak_bytes=240 * MiB)])
    assert main([str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| 1 | recompute_grad | 4 (1+1+1+1) | r,r,r,r | 512 | 2.400 | 1.20 | 180 | 0.45 |" in text
    assert text.count("accuracy 0.9") == 4
    assert "| 300 | 240 | 250 | 1.04 | yes |" in text
    assert (tmp_path / "peak_vs_batch.png").stat().st_size > 1000
    assert (tmp_path / "frontier.png").stat().st_size > 1000


def test_report_of_an_empty_folder_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no runs with metrics.json"):
        main([str(tmp_path)])


def test_report_without_a_whole_baseline_skips_the_frontier_saying_why(tmp_path, capsys):
    write_sweep(tmp_path, [run("sectioned", 4, 512, 2.3, 170), run("sectioned", 2, 512, 2.1, 250)])
    assert main([str(tmp_path)]) == 0
    assert not (tmp_path / "frontier.png").exists() and (tmp_path / "peak_vs_batch.png").is_file()
    assert "skipped frontier.png: no `whole` run" in capsys.readouterr().err
    assert "Not drawn: frontier.png" in (tmp_path / "report.md").read_text()


def test_policies_each_have_their_own_letter():
    from runner.report import table

    text = table(with_ratios([run("whole", 1, 512, 2.0, 400),
                              run("sectioned", 3, 512, 2.5, 160, policies=["store", "recreate", "recompute"])]))
    assert "| s,c,r |" in text and "c = recreate" in text
