"""``gradzip sweep`` and ``gradzip report``: tiny real sweeps (MLP on digits, 1 worker, a few steps)."""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gradzip.cli import app
from gradzip.harness.report import PLOTS, beyond_spread
from gradzip.harness.sweep import (bracket_lr, load_sweep, main_runs, parse_sweep, pick_lr, run_sweep,
                                  tuning_runs)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

TINY = """
name = "tiny"
[base]
model = "mlp"
dataset = "digits"
max_steps = 5
lr = 0.05
[grid]
workers = [1]
seeds = [0]
[[grid.methods]]
compressor = "none"
label = "dense"
[[grid.methods]]
compressor = "topk"
sweep_param = "ratio"
values = [0.1]
"""


def _csv(directory: Path) -> list:
    with (directory / "results.csv").open() as f:
        return list(csv.DictReader(f))


def _summary(directory: Path, run: str) -> dict:
    return json.loads((directory / "runs" / run / "summary.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The TINY sweep run once through the CLI: (config path, sweep directory, CLI output)."""
    root = tmp_path_factory.mktemp("sweep")
    config = root / "tiny.toml"
    config.write_text(TINY)
    result = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(root / "out")])
    assert result.exit_code == 0, result.output
    return config, root / "out" / "tiny", result.output


def test_sweep_writes_table_and_plots_consistent_with_summaries(tiny):
    _, directory, output = tiny
    assert "2 runs ran, 0 were finished before" in output
    assert sorted(p.name for p in (directory / "runs").iterdir()) == ["dense-w1-s0", "topk-ratio0.1-w1-s0"]
    for name in PLOTS:
        data = (directory / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    rows = _csv(directory)
    assert [(r["label"], r["workers"], r["seeds"]) for r in rows] == [("dense", "1", "1"), ("topk-ratio0.1", "1", "1")]
    for row, run in zip(rows, ["dense-w1-s0", "topk-ratio0.1-w1-s0"]):
        s = _summary(directory, run)
        assert float(row["score"]) == pytest.approx(s["final_test_accuracy"])
        assert float(row["test_loss"]) == pytest.approx(s["final_test_loss"])
        assert float(row["step_ms"]) == pytest.approx(1000 * s["mean_step_s"])
        assert float(row["mib_sent_per_worker"]) == pytest.approx(s["total_bytes_sent"] / 2 ** 20)
        assert float(row["density"]) == pytest.approx(s["mean_density"])
        assert float(row["bits_per_element"]) == pytest.approx(s["mean_bits_per_element"])
        assert s["mean_bits_per_element"] == pytest.approx(32 / s["mean_ratio"])  # fp32 gradients
        assert float(row["lr"]) == 0.05
        assert not list((directory / "runs" / run).glob("checkpoint-*.pt"))  # removed once the run finished
    assert float(rows[1]["density"]) == pytest.approx(0.1, abs=0.01)
    markdown = (directory / "results.md").read_text()
    assert "| dense | — | 1 | 0.05 | 1 | " in markdown and "| topk-ratio0.1 | ratio=0.1 | 1 |" in markdown
    assert f"{_summary(directory, 'dense-w1-s0')['final_test_accuracy']:.4f}" in markdown
    assert "by ratio" in markdown  # the swept group's k% table
    # Rule for published results: the command, seeds, passes and machine, and no claim from one seed.
    assert f"- Command: `gradzip sweep {tiny[0]} --out-dir {directory.parent}`" in markdown
    assert "- Seeds: 0 " in markdown and "CPU cores" in markdown.split("- Machine: ")[1].splitlines()[0]
    passes = _summary(directory, "dense-w1-s0")["passes"]
    assert f"- Passes over the training data: {passes:.2f}" in markdown
    delta = float(rows[1]["score"]) - float(rows[0]["score"])
    assert f"| topk-ratio0.1 | 1 | {delta:.4f} | not claimed: one seed |" in markdown


def test_rerun_skips_finished_runs_and_continues_unfinished_ones(tiny):
    config, directory, _ = tiny
    summaries = sorted((directory / "runs").glob("*/summary.json"))
    mtimes = [p.stat().st_mtime_ns for p in summaries]
    result = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(directory.parent)])
    assert result.exit_code == 0, result.output
    assert "0 runs ran, 2 were finished before" in result.output
    assert [p.stat().st_mtime_ns for p in summaries] == mtimes
    # A run made before a TrainConfig field existed ran with its default: still the same config.
    stored = summaries[0].parent / "config.json"
    old = json.loads(stored.read_text())
    stored.write_text(json.dumps({k: v for k, v in old.items() if k != "optimizer"}))
    result = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(directory.parent)])
    assert result.exit_code == 0 and "0 runs ran, 2 were finished before" in result.output, result.output
    # A sweep killed during its second run: that run has no summary yet; the rerun runs only it.
    (directory / "runs" / "topk-ratio0.1-w1-s0" / "summary.json").unlink()
    counts = run_sweep(load_sweep(config, out_dir=str(directory.parent)), log=lambda s: None, report=False)
    assert (counts["ran"], counts["skipped"], counts["failed"]) == (1, 1, [])
    assert summaries[0].stat().st_mtime_ns == mtimes[0]


def test_report_command_rerenders_and_a_changed_config_is_refused(tiny):
    config, directory, _ = tiny
    (directory / "results.md").unlink()
    (directory / PLOTS[0]).unlink()
    result = CliRunner().invoke(app, ["report", str(directory)])
    assert result.exit_code == 0, result.output
    assert (directory / "results.md").exists() and (directory / PLOTS[0]).stat().st_size > 5000
    # Same sweep name and run names, another lr: reusing the finished runs would report the wrong thing.
    config.write_text(TINY.replace("lr = 0.05", "lr = 0.07"))
    result = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(directory.parent)])
    config.write_text(TINY)
    assert result.exit_code == 2 and "differs in lr" in result.output
    result = CliRunner().invoke(app, ["report", str(directory / "nowhere")])
    assert result.exit_code == 2 and "not a directory" in result.output


def test_lr_tuning_picks_the_best_validation_lr(tmp_path):
    sweep = parse_sweep({
        "base": {"model": "mlp", "dataset": "digits", "max_steps": 8, "lr": 0.05},
        "grid": {"workers": [1], "seeds": [0, 1], "methods": [{"compressor": "topk", "label": "topk"}]},
        "tuning": {"lrs": [1e-5, 0.2], "validation": 0.2, "max_steps": 6},
    }, default_name="tuned", out_dir=str(tmp_path))
    counts = run_sweep(sweep, log=lambda s: None)
    assert counts["ran"] == 4 and counts["failed"] == []
    directory = tmp_path / "tuned"
    scores = {}
    for lr in ("1e-05", "0.2"):
        run = directory / "tuning" / f"topk-w1-lr{lr}-s0"
        config = json.loads((run / "config.json").read_text())
        assert (config["validation"], config["max_steps"]) == (0.2, 6)
        scores[float(lr)] = json.loads((run / "summary.json").read_text())["final_test_accuracy"]
    assert scores[1e-5] != scores[0.2]
    best = max(scores, key=scores.get)
    chosen = json.loads((directory / "tuned_lrs.json").read_text())["methods"]["topk"]["1"]
    assert chosen["lr"] == best and chosen["scores"] == {"1e-05": scores[1e-5], "0.2": scores[0.2]}
    (row,) = _csv(directory)
    assert (row["tuned"], float(row["lr"]), row["seeds"]) == ("True", best, "2")
    finals = [_summary(directory, f"topk-tuned-w1-s{s}") for s in (0, 1)]
    assert all(f["lr"] == best for f in finals)
    accuracies = [f["final_test_accuracy"] for f in finals]
    assert float(row["score"]) == pytest.approx(statistics.mean(accuracies))
    assert float(row["score_std"]) == pytest.approx(statistics.stdev(accuracies))
    assert "## Tuned learning rates" in (directory / "results.md").read_text()


def test_pick_lr_prefers_the_best_mean_then_the_earlier_lr():
    assert pick_lr({0.1: [0.5, 0.7], 0.01: [0.65, 0.65]}) == 0.01
    assert pick_lr({0.1: [0.6], 0.01: [0.6]}) == 0.1
    assert pick_lr({0.1: [float("nan")], 0.01: [0.2]}) == 0.01
    assert pick_lr({0.1: [None], 0.01: [0.2]}) == 0.01
    assert pick_lr({0.1: [120.0], 0.01: [95.0]}, lower_is_better=True) == 0.01


def _parabola(best: float, calls: list):
    """A cheap objective: accuracy 1 - (log10 lr - log10 best)^2, two seeds; records the lrs asked for."""
    import math

    def scores_of(lr):
        calls.append(lr)
        return [1 - (math.log10(lr) - math.log10(best)) ** 2] * 2
    return scores_of


def test_bracket_lr_widens_until_the_best_is_inside():
    calls = []
    lr, scores, at_edge = bracket_lr(_parabola(0.1, calls), [0.001, 0.003, 0.01], widen=5)
    # 0.01 best -> 0.0333 (x 0.01/0.003) -> 0.111 -> 0.37, where 0.111 is inside: stop.
    assert calls == [0.001, 0.003, 0.01, 0.0333, 0.111, 0.37]
    assert (lr, at_edge) == (0.111, False) and list(scores) == calls
    calls = []
    lr, _, at_edge = bracket_lr(_parabola(1e-5, calls), [0.001, 0.01], widen=2)
    assert calls == [0.001, 0.01, 0.0001, 1e-05] and (lr, at_edge) == (1e-05, True)  # out of steps, at the edge
    calls = []
    assert bracket_lr(_parabola(0.003, calls), [0.01, 0.001, 0.003], widen=3)[::2] == (0.003, False)
    assert calls == [0.01, 0.001, 0.003]  # already inside: the grid as given
    lower = bracket_lr(lambda lr: [abs(lr - 0.5)], [0.1, 0.2], widen=4, lower_is_better=True)
    assert list(lower[1]) == [0.1, 0.2, 0.4, 0.8] and lower[0] == 0.4
    failed = []
    assert bracket_lr(lambda lr: failed.append(lr) or [None, float("nan")], [0.1, 0.2], widen=3)[2] is True
    assert failed == [0.1, 0.2]  # nothing trained: no direction to widen in


def test_sweep_widens_the_lr_grid_on_validation_runs(tmp_path):
    sweep = parse_sweep({
        "base": {"model": "mlp", "dataset": "digits", "max_steps": 6, "lr": 0.05},
        "grid": {"workers": [1], "seeds": [0], "methods": [{"compressor": "none", "label": "dense"}]},
        "tuning": {"lrs": [0.001, 0.003], "validation": 0.2, "widen": 2, "tuned": True},
    }, default_name="widened", out_dir=str(tmp_path))
    assert [r.config.lr for r in tuning_runs(sweep)] == [0.001, 0.003]  # the plan: the grid only
    counts = run_sweep(sweep, log=lambda s: None)
    directory = tmp_path / "widened"
    tuned = json.loads((directory / "tuned_lrs.json").read_text())
    choice = tuned["methods"]["dense"]["1"]
    scores = {}
    for name in choice["scores"]:
        run = directory / "tuning" / f"dense-w1-lr{name}-s0"
        assert json.loads((run / "config.json").read_text())["validation"] == 0.2
        scores[float(name)] = json.loads((run / "summary.json").read_text())["final_test_accuracy"]
        assert choice["scores"][name] == scores[float(name)]
    # 6 steps at these small lrs: the larger learns more, so the grid grew upwards by its ratio (3x).
    assert scores[0.003] > scores[0.001] and list(scores)[:3] == [0.001, 0.003, 0.009]
    replay = bracket_lr(lambda lr: [scores[lr]], [0.001, 0.003], widen=2)
    assert list(replay[1]) == list(scores) and (choice["lr"], choice["at_edge"]) == (replay[0], replay[2])
    assert tuned["lrs"] == sorted(scores) and tuned["widen"] == 2
    assert counts["ran"] == len(scores) + 1 and counts["failed"] == []  # the tuning runs and the tuned run
    assert len(json.loads((directory / "sweep.json").read_text())["tuning_runs"]) == len(scores)
    assert "lr 0.009" in (directory / "results.md").read_text()


GOOD = {"base": {"model": "mlp", "dataset": "digits"}, "grid": {"methods": [{"compressor": "none"}]}}


@pytest.mark.parametrize("change,message", [
    ({"colour": 1}, "unknown key(s) colour in the sweep's top level; allowed: name,"),
    ({"base": {"epoch": 2}}, "unknown key(s) epoch in [base]; allowed: model,"),
    ({"base": {"workers": 2}}, "unknown key(s) workers in [base]"),
    ({"grid": {"worker": [1], "methods": [{"compressor": "none"}]}}, "unknown key(s) worker in [grid]"),
    ({"grid": {"methods": [{"compressor": "topk", "ratios": [1]}]}}, "unknown key(s) ratios in [[grid.methods]] #1"),
    ({"grid": {"methods": [{"compressor": "zip"}]}}, "unknown compressor 'zip'"),
    ({"grid": {"methods": [{"compressor": "topk", "params": {"ratoi": 0.1}}]}}, "valid: ratio"),
    ({"grid": {"methods": [{"compressor": "dgc", "sweep_param": "ratio", "values": [0.1, 0]}]}},
     "run dgc-ratio0-w2-s0: ratio must be a number with 0 < ratio <= 1"),
    ({"grid": {"methods": [{"compressor": "none"}, {"compressor": "none"}]}}, "two methods are labelled 'none'"),
    ({"grid": {"methods": [{"compressor": "topk", "sweep_param": "ratio"}]}}, "sweep_param (a parameter name) and"),
    ({"grid": {"methods": []}}, "at least one [[grid.methods]]"),
    ({"grid": {"workers": 2, "methods": [{"compressor": "none"}]}}, "[grid] workers must be a non-empty list"),
    ({"grid": {"seeds": [-1], "methods": [{"compressor": "none"}]}}, "[grid] seeds must be a non-empty list"),
    ({"tuning": {"lrs": []}}, "lrs in [tuning] must be a non-empty list of numbers > 0"),
    ({"tuning": {"lrs": [0.1], "tuned": "yes"}}, "tuned in [tuning] must be true, false or \"both\""),
    ({"tuning": {"lrs": [0.1], "validation": 0}}, "validation in [tuning] must be a fraction"),
    ({"tuning": {"lrs": [0.1], "step": 3}}, "unknown key(s) step in [tuning]; allowed: lrs,"),
    ({"tuning": {"lrs": [0.1, 0.2], "widen": -1}}, "widen in [tuning] must be an integer >= 0, got -1"),
    ({"tuning": {"lrs": [0.1, 0.1], "widen": 2}}, "it needs at least two distinct lrs"),
])
def test_config_errors_are_one_line_value_errors(change, message):
    with pytest.raises(ValueError) as info:
        parse_sweep({**GOOD, **change})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_cli_reports_a_bad_config_with_exit_code_2(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('[base]\nmodel = "mlp"\nlearning_rate = 0.1\n[[grid.methods]]\ncompressor = "none"\n')
    result = CliRunner().invoke(app, ["sweep", str(config), "--out-dir", str(tmp_path)])
    assert result.exit_code == 2 and "unknown key(s) learning_rate in [base]" in result.output
    config.write_text("[base\n")
    result = CliRunner().invoke(app, ["sweep", str(config)])
    assert result.exit_code == 2 and "not valid TOML" in result.output


def test_shipped_configs_plan_without_errors(tmp_path):
    plans = {p.stem: load_sweep(p, out_dir=str(tmp_path)) for p in sorted(CONFIGS.glob("*.toml"))}
    assert {"quick_demo", "seed001_kpercent", "thesis_comparison"} <= set(plans)
    kpercent = plans["seed001_kpercent"]
    ratios: dict = {}
    for m in kpercent.methods:
        ratios.setdefault(m.group, []).append(m.value)
    k = [0, 0.001, 0.002, 0.003, 0.005, 0.009, 0.01, 0.02, 0.03, 0.05, 0.1, 1.0]
    assert sorted(ratios["topk-noef"]) == k and kpercent.workers == (1, 2)
    assert all(v > 0 for v in ratios["dgc"])  # DGC needs ratio > 0
    thesis = plans["thesis_comparison"]
    assert {m.compressor for m in thesis.methods} == {"none", "fp16", "topk", "dgc", "qsgd", "powersgd", "signsgd",
                                                      "efsignsgd"}
    assert thesis.tuning is not None and thesis.tuning.tuned == "both" and thesis.workers == (2, 4)
    assert len(tuning_runs(thesis)) > 0 and len(main_runs(thesis)) > 0
    assert len(main_runs(plans["quick_demo"])) == 6


def test_a_difference_counts_only_beyond_the_sum_of_the_spreads():
    def row(mean, std):
        return {"score": mean, "score_std": std}

    assert beyond_spread(row(0.90, 0.01), row(0.87, 0.01), "score") is True
    assert beyond_spread(row(0.90, 0.02), row(0.87, 0.02), "score") is False
    assert beyond_spread(row(0.87, 0.01), row(0.90, 0.01), "score") is True  # either direction
    assert beyond_spread(row(0.90, None), row(0.50, 0.01), "score") is None  # one seed: no spread to compare
    assert beyond_spread(row(None, None), row(0.50, 0.01), "score") is None
