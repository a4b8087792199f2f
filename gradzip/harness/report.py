"""Tables and plots of a sweep's runs: ``gradzip report DIR`` (and the end of ``gradzip sweep``) runs this.

``render(directory)`` reads the runs' ``summary.json`` and ``metrics.jsonl`` and writes, in ``directory``:

- ``results.csv`` and ``results.md``: one row per (method, workers[, tuned]) with mean and std over seeds;
- ``accuracy_vs_density.png``: final score against the fraction of gradient elements sent (a table
  of accuracy by k% of elements kept, as curves: one line per method group and worker count);
- ``loss_curves.png``, ``accuracy_curves.png``, ``accuracy_vs_time.png``: per epoch, or per step when the
  runs have a single epoch;
- ``step_time_breakdown.png``: compute / compress / communicate / decompress per step;
- ``compression_over_time.png``: compression ratio and density per epoch or step (DGC's warm-up).

The runs are the ones ``sweep.json`` lists; without it, every ``summary.json`` under ``runs/`` or directly
under ``directory`` (``gradzip report runs/demo`` works for ``gradzip demo``'s runs).  Unfinished runs are
left out.  For language models the score is the test perplexity (lower is better) instead of accuracy.
"""
from __future__ import annotations

import csv
import json
import math
import os
import platform
import re
import statistics
from pathlib import Path
from typing import Optional

__all__ = ["load_runs", "aggregate", "beyond_spread", "machine", "provenance", "render", "PLOTS"]

PLOTS = ("accuracy_vs_density.png", "loss_curves.png", "accuracy_curves.png", "accuracy_vs_time.png",
         "step_time_breakdown.png", "compression_over_time.png")
_TIMES = ("compute", "compress", "communicate", "decompress")


# -- loading ------------------------------------------------------------------------------------------------


def load_runs(directory) -> tuple:
    """(finished runs, number planned); each run is its manifest entry plus ``summary``, ``steps``, ``epochs``."""
    directory = Path(directory)
    manifest = directory / "sweep.json"
    if manifest.exists():
        entries = json.loads(manifest.read_text())["runs"]
    else:
        entries = [_entry_from_summary(directory, path) for path in
                   sorted(directory.glob("runs/*/summary.json")) + sorted(directory.glob("*/summary.json"))]
    runs = []
    for entry in entries:
        path = directory / entry["path"]
        if not (path / "summary.json").exists():
            continue
        records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()] \
            if (path / "metrics.jsonl").exists() else []
        runs.append({**entry, "summary": json.loads((path / "summary.json").read_text()),
                     "steps": [r for r in records if r["kind"] == "step"],
                     "epochs": [r for r in records if r["kind"] == "epoch"]})
    return runs, len(entries)


def _entry_from_summary(directory: Path, path: Path) -> dict:
    s = json.loads(path.read_text())
    params = s.get("params") or {}
    # Runs named alike but for the seed (gradzip train's default names) are seeds of one setting.
    label = re.sub(rf"(-w{s['workers']})?-s{s['seed']}$", "", s["name"])
    return {"name": s["name"], "path": str(path.parent.relative_to(directory)), "label": label,
            "group": s["compressor"], "compressor": s["compressor"], "params": params, "sweep_param": None,
            "value": None, "workers": s["workers"], "seed": s["seed"], "lr": s["lr"], "tuned": None}


# -- aggregation --------------------------------------------------------------------------------------------


def _mean_std(values) -> tuple:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    if not all(math.isfinite(v) for v in values):  # a diverged seed (NaN loss): statistics.stdev raises
        return mean, math.nan
    return mean, statistics.stdev(values)


def aggregate(runs: list) -> list:
    """One row per (label, workers, tuned, lr), in the order the runs were planned; statistics over seeds."""
    groups: dict = {}
    for run in runs:
        groups.setdefault((run["label"], run["workers"], run["tuned"], run["summary"]["lr"]), []).append(run)
    rows = []
    for (label, workers, tuned, _), members in groups.items():
        first, summaries = members[0], [m["summary"] for m in members]
        row = {k: first[k] for k in ("label", "group", "compressor", "params", "sweep_param", "value")}
        row["overrides"] = first.get("overrides") or {}
        row.update(workers=workers, tuned=tuned, runs=members, seeds=len(members),
                   lr=first["summary"]["lr"], score_name=first["summary"]["score"],
                   reached=sum(s.get("time_to_target_s") is not None for s in summaries),
                   target=first["summary"].get("target"))
        fields = {
            "score": [s["final_score"] for s in summaries],
            "test_loss": [s["final_test_loss"] for s in summaries],
            "train_loss": [m["epochs"][-1]["train_loss"] if m["epochs"] else None for m in members],
            "time_to_target_s": [s.get("time_to_target_s") for s in summaries],
            "epochs_to_target": [s.get("epochs_to_target") for s in summaries],
            "wall_s": [s["wall_s"] for s in summaries],
            "passes": [s.get("passes") for s in summaries],  # absent from runs made before it was recorded
            "step_ms": [_ms(s, "step") for s in summaries],
            **{f"{k}_ms": [_ms(s, k) for s in summaries] for k in _TIMES},
            "mib_sent_per_worker": [s["total_bytes_sent"] / 2 ** 20 for s in summaries],
            "ratio": [s["mean_ratio"] for s in summaries],
            "density": [s["mean_density"] for s in summaries],
            "bits_per_element": [s.get("mean_bits_per_element") for s in summaries],  # older runs lack it
        }
        for key, values in fields.items():
            row[key], row[f"{key}_std"] = _mean_std(values)
        rows.append(row)
    return rows


def _ms(summary: dict, key: str) -> Optional[float]:
    value = summary.get(f"mean_{key}_s")
    return None if value is None else 1000 * value


def _row_name(row: dict) -> str:
    return f"{row['label']} w{row['workers']}" + (" tuned" if row["tuned"] else "")


# -- tables -------------------------------------------------------------------------------------------------

_CSV_STATS = ("score", "test_loss", "train_loss", "time_to_target_s", "epochs_to_target", "step_ms",
              "compute_ms", "compress_ms", "communicate_ms", "decompress_ms", "mib_sent_per_worker", "ratio",
              "density", "bits_per_element", "wall_s", "passes")


def write_csv(rows: list, path: Path) -> None:
    columns = ["label", "group", "compressor", "params", "overrides", "workers", "tuned", "lr", "seeds", "score_name",
               "target", "reached"] + [f"{k}{s}" for k in _CSV_STATS for s in ("", "_std")]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for row in rows:
            values = {**row, "params": json.dumps(row["params"], sort_keys=True),
                      "overrides": json.dumps(row["overrides"], sort_keys=True),
                      "tuned": "" if row["tuned"] is None else row["tuned"]}
            writer.writerow(["" if values.get(c) is None else values[c] for c in columns])


def _pm(mean, std, digits: int) -> str:
    if mean is None:
        return "—"
    if isinstance(mean, float) and not math.isfinite(mean):
        return str(mean)
    return f"{mean:.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}")


def _params_text(row: dict) -> str:
    """The compressor's parameters, then the method's own [base] settings (e.g. ``netem``) after a ";"."""
    parts = [", ".join(f"{k}={v}" for k, v in d.items()) for d in (row["params"], row["overrides"]) if d]
    return "; ".join(parts) or "—"


def write_markdown(rows: list, path: Path, *, title: str, description: str, finished: int, planned: int,
                   tuned_lrs: Optional[dict], manifest: Optional[dict] = None) -> None:
    lm = any(r["score_name"] == "test_perplexity" for r in rows)
    score = "test perplexity" if lm else "test accuracy"
    has_tuned = any(r["tuned"] is not None for r in rows)
    target = next((r["target"] for r in rows if r["target"] is not None), None)
    lines = [f"# {title}", ""]
    if description:
        lines += [description, ""]
    lines += _provenance(rows, manifest or {})
    lines += [f"{finished} of {planned} runs finished.  Mean ± std over seeds of the final {score}, final losses, "
              f"time and epochs to reach the target ({'none set' if target is None else target}; "
              f"reached/seeds when not all did), mean step time and its split in ms (compress, communicate and "
              f"decompress run on gradzip's thread and overlap backward; compute is the rest), MiB sent per "
              f"worker, mean compression ratio (dense bytes / bytes sent), bits sent per gradient element, "
              f"density: the fraction of elements whose values a sparsifier sent (100% for every method that "
              f"sends each element in some coded form, quantisers, sign methods and PowerSGD included); "
              f"passes: how many times a run went through its training data (all workers' samples over the "
              f"training set's size).",
              ""]
    header = (["method", "params", "workers"] + (["tuned"] if has_tuned else [])
              + ["lr", "seeds", "passes", score, "test loss", "train loss", "time to target (s)", "epochs to target",
                 "step ms", "compute", "compress", "communicate", "decompress", "MiB sent/worker", "ratio",
                 "bits/element", "density"])
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        reached = "" if r["reached"] in (0, r["seeds"]) else f" ({r['reached']}/{r['seeds']})"
        cells = ([r["label"], _params_text(r), str(r["workers"])]
                 + (["yes" if r["tuned"] else "no"] if has_tuned else [])
                 + [f"{r['lr']:g}", str(r["seeds"]), _pm(r["passes"], None, 2),
                    _pm(r["score"], r["score_std"], 2 if lm else 4), _pm(r["test_loss"], r["test_loss_std"], 4),
                    _pm(r["train_loss"], r["train_loss_std"], 4),
                    _pm(r["time_to_target_s"], r["time_to_target_s_std"], 1) + reached,
                    _pm(r["epochs_to_target"], r["epochs_to_target_std"], 1) + reached]
                 + [_pm(r[f"{k}_ms"], None, 1) for k in ("step",) + _TIMES]
                 + [_pm(r["mib_sent_per_worker"], None, 2), _pm(r["ratio"], None, 1),
                    _pm(r["bits_per_element"], None, 2), _density_text(r["density"])])
        lines.append("| " + " | ".join(cells) + " |")
    lines += _pivot(rows, score, lm)
    lines += _differences(rows, score, lm)
    if tuned_lrs:
        lines += ["", "## Tuned learning rates", "",
                  f"Chosen by the best mean {tuned_lrs['score'].replace('_', ' ')} over tuning seeds "
                  f"{tuned_lrs['seeds']} on a held-out {tuned_lrs['validation']:g} of the training set"
                  + (f"; the grid widened beyond its edges at most {tuned_lrs['widen']} times per setting while the "
                     f"best lr was at an edge (—: not tried for that setting)" if tuned_lrs.get("widen") else "")
                  + ".", "",
                  "| method | workers | tuned at | lr | " + " | ".join(f"lr {lr:g}" for lr in tuned_lrs["lrs"]) + " |",
                  "|---|---|---|---|" + "---|" * len(tuned_lrs["lrs"])]
        for label, per_workers in tuned_lrs["methods"].items():
            for workers, choice in per_workers.items():
                scores = [choice["scores"].get(f"{lr:g}", "—") for lr in tuned_lrs["lrs"]]  # —: not tried
                edge = " (at the edge)" if choice.get("at_edge") else ""
                lines.append(f"| {label} | {workers} | {choice['tuned_at_workers']} | {choice['lr']:g}{edge} | "
                             + " | ".join("failed" if s is None else s if s == "—" else f"{s:.4f}" for s in scores)
                             + " |")
    lines += ["", "## Plots", ""] + [f"![{p[:-4].replace('_', ' ')}]({p})" for p in PLOTS]
    path.write_text("\n".join(lines) + "\n")


def machine() -> str:
    """The machine a sweep ran on, in words: results name it, since timings mean nothing without it."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    try:
        memory = f", {os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2 ** 30:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores" + (f" ({cpu})" if cpu else "")
            + memory + ", " + (", ".join(gpus) if gpus else "no GPU") + f", torch {torch.__version__}")


def provenance(command: Optional[str], seeds: str, passes: str, machine_text: Optional[str]) -> list:
    """The lines every published result starts with: its command, seeds, passes over the data and machine."""
    return [f"- Command: `{command}`" if command else "- Command: not recorded", f"- Seeds: {seeds}",
            f"- Passes over the training data: {passes}", f"- Machine: {machine_text or 'not recorded'}", ""]


def passes_range(passes) -> str:
    """Passes over the training data as the provenance line gives them: "2.00", "0.16-0.32" (the range,
    to two decimals), or "not recorded" where no run recorded them (None)."""
    passes = sorted({round(p, 2) for p in passes if p is not None})
    if not passes:
        return "not recorded"
    return f"{passes[0]:.2f}" + ("" if len(passes) == 1 else f"-{passes[-1]:.2f}")


def _provenance(rows: list, manifest: dict) -> list:
    seeds = sorted({run["seed"] for r in rows for run in r["runs"]})
    return provenance(manifest.get("command"),
                      f"{', '.join(map(str, seeds))} (settings with one seed: no difference is claimed)",
                      passes_range(r["passes"] for r in rows), manifest.get("machine"))


def beyond_spread(a: dict, b: dict, key: str) -> Optional[bool]:
    """Whether rows ``a`` and ``b`` differ in ``key`` by more than the sum of their stds over seeds.

    None where either has fewer than two seeds: one seed has no spread, so no difference can be claimed.
    """
    if a[f"{key}_std"] is None or b[f"{key}_std"] is None or a[key] is None or b[key] is None:
        return None
    return abs(a[key] - b[key]) > a[f"{key}_std"] + b[f"{key}_std"]


def _differences(rows: list, score: str, lm: bool) -> list:
    """Each method against dense (compressor "none") at the same workers and tuning, with the rule applied."""
    dense = {(r["workers"], r["tuned"]): r for r in rows if r["compressor"] == "none" and not r["params"]}
    pairs = [(r, dense[(r["workers"], r["tuned"])]) for r in rows
             if (r["workers"], r["tuned"]) in dense and r is not dense[(r["workers"], r["tuned"])]]
    if not pairs:
        return []
    digits, has_tuned = 2 if lm else 4, any(r["tuned"] is not None for r in rows)
    verdict = {True: "yes", False: "no: within the spread", None: "not claimed: one seed"}
    lines = ["", "## Against dense", "",
             f"Mean {score} minus dense's at the same workers{' and tuning' if has_tuned else ''}; a difference "
             f"is claimed only where it exceeds the sum of the two stds over seeds.", "",
             "| method | workers | " + ("tuned | " if has_tuned else "") + f"Δ {score} | beyond the spread |",
             "|---|---|" + ("---|" if has_tuned else "") + "---|---|"]
    for r, d in pairs:
        delta = None if r["score"] is None or d["score"] is None else r["score"] - d["score"]
        lines.append("| " + " | ".join([r["label"], str(r["workers"])] + (["yes" if r["tuned"] else "no"] if has_tuned
                                                                          else [])
                                       + [_pm(delta, None, digits), verdict[beyond_spread(r, d, "score")]]) + " |")
    return lines


def _density_text(density) -> str:
    return "—" if density is None or not math.isfinite(density) else f"{100 * density:.3g}%"


def _pivot(rows: list, score: str, lm: bool) -> list:
    """A k%-style table for swept groups: one line per swept value, one column per group and workers."""
    swept = [r for r in rows if r["sweep_param"] is not None]
    if not swept:
        return []
    columns = list(dict.fromkeys((r["group"], r["workers"], r["tuned"]) for r in swept))
    params = list(dict.fromkeys(r["sweep_param"] for r in swept))
    lines = ["", f"## {score} / test loss by {', '.join(params)}", "",
             "| " + " / ".join(params) + " | "
             + " | ".join(f"{g} w{w}" + (" tuned" if t else "") for g, w, t in columns) + " |",
             "|---|" + "---|" * len(columns)]
    cells = {(r["group"], r["workers"], r["tuned"], json.dumps(r["value"])): r for r in swept}
    for value in dict.fromkeys(json.dumps(r["value"]) for r in swept):
        line = []
        for column in columns:
            r = cells.get(column + (value,))
            line.append("" if r is None
                        else f"{_pm(r['score'], r['score_std'], 2 if lm else 4)} / {_pm(r['test_loss'], None, 4)}")
        lines.append(f"| {json.loads(value)} | " + " | ".join(line) + " |")
    return lines


# -- plots --------------------------------------------------------------------------------------------------


def _figure(ncols: int = 1, height: float = 4.5):
    # The object-oriented API without pyplot: no global backend to switch, safe in any process (Agg).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.5 * ncols + 2.5, height), layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, axes


def _style(i: int) -> dict:
    from matplotlib import colormaps

    return {"color": colormaps["tab10" if i < 10 else "tab20"](i % 20),
            "linestyle": ("-", "--", ":", "-.")[(i // 20) % 4] if i >= 10 else "-"}


def _legend(fig, axes) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize="x-small",
                   ncols=max(1, math.ceil(len(handles) / 32)))


def _save(fig, path: Path) -> None:
    fig.savefig(path, dpi=110)


def _smooth(values: list, window: int) -> list:
    if window <= 1:
        return values
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _series(runs: list, kind: str, key: str, x: str) -> tuple:
    """Mean over seeds of ``key`` against ``x`` for records of ``kind`` ("steps" or "epochs")."""
    series = [[(r[x], r[key]) for r in run[kind] if r.get(key) is not None] for run in runs]
    n = min(len(s) for s in series) if series else 0
    xs = [sum(s[i][0] for s in series) / len(series) for i in range(n)]
    ys = [sum(s[i][1] for s in series) / len(series) for i in range(n)]
    return xs, ys


def _per_epoch(rows: list) -> bool:
    return all(len(run["epochs"]) > 1 for r in rows for run in r["runs"])


def plot_accuracy_vs_density(rows: list, path: Path, lm: bool) -> None:
    fig, (ax,) = _figure()
    lines: dict = {}
    for r in rows:
        if r["density"] is not None and math.isfinite(r["density"]) and r["score"] is not None:
            lines.setdefault((r["group"], r["workers"], r["tuned"]), []).append(r)
    for i, ((group, workers, tuned), members) in enumerate(lines.items()):
        members.sort(key=lambda r: r["density"])
        ax.errorbar([100 * r["density"] for r in members], [r["score"] for r in members],
                    yerr=[r["score_std"] or 0.0 for r in members], marker="o", capsize=3,
                    label=f"{group} w{workers}" + (" tuned" if tuned else ""), **_style(i))
    densities = [r["density"] for m in lines.values() for r in m]
    if any(d <= 0 for d in densities):
        # Sending nothing (k = 0) is a point of the table: symlog keeps it on a log-like axis.
        ax.set_xscale("symlog", linthresh=0.1)
        ax.set_xlim(left=0)
    elif densities:
        ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.1, 1, 10, 100 as in a k% table
    ax.set_xlabel("density: % of gradient elements sent (log scale)")
    ax.set_ylabel("final test perplexity" if lm else "final test accuracy")
    ax.set_title(f"Final test {'perplexity' if lm else 'accuracy'} vs density (mean ± std over seeds)")
    ax.grid(True, which="both", alpha=0.3)
    _legend(fig, [ax])
    _save(fig, path)


def plot_curves(rows: list, path: Path, metric: str, lm: bool) -> None:
    """``metric`` "loss" or "accuracy" (perplexity for language models)."""
    fig, (ax,) = _figure()
    name = "perplexity" if (metric == "accuracy" and lm) else metric
    if _per_epoch(rows):
        for i, r in enumerate(rows):
            for split, style in (("test", "-"), ("train", "--")):
                xs, ys = _series(r["runs"], "epochs", f"{split}_{name}", "epoch")
                ax.plot([x + 1 for x in xs], ys, marker="o" if split == "test" else None,
                        label=_row_name(r) if split == "test" else None, **{**_style(i), "linestyle": style})
        ax.set_xlabel("epoch")
        ax.set_ylabel(f"{name} (solid: test, dashed: train)")
        ax.set_title(f"{name.capitalize()} per epoch (mean over seeds)")
    else:
        window = _window(rows)
        for i, r in enumerate(rows):
            xs, ys = _series(r["runs"], "steps", "loss" if name == "loss" else name, "step")
            ax.plot(xs, _smooth(ys, window), label=_row_name(r), **_style(i))
        ax.set_xlabel("step")
        ax.set_ylabel(f"training {name} (moving average of {window} steps)")
        ax.set_title(f"Training {name} per step (mean over seeds)")
    if name in ("loss", "perplexity"):
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    _legend(fig, [ax])
    _save(fig, path)


def _window(rows: list) -> int:
    steps = min((len(run["steps"]) for r in rows for run in r["runs"]), default=0)
    return max(1, steps // 20)


def plot_accuracy_vs_time(rows: list, path: Path, lm: bool) -> None:
    fig, (ax,) = _figure()
    name = "perplexity" if lm else "accuracy"
    if _per_epoch(rows):
        for i, r in enumerate(rows):
            xs, ys = _series(r["runs"], "epochs", f"test_{name}", "wall_s")
            ax.plot(xs, ys, marker="o", label=_row_name(r), **_style(i))
        ax.set_ylabel(f"test {name} at the end of each epoch")
    else:
        window = _window(rows)
        for i, r in enumerate(rows):
            xs, ys = _series(r["runs"], "steps", name, "wall_s")
            ax.plot(xs, _smooth(ys, window), label=_row_name(r), **_style(i))
            ax.plot([r["wall_s"]], [r["score"]], marker="x", markersize=8, **{**_style(i), "linestyle": "none"})
        ax.set_ylabel(f"training {name} (moving average, {window} steps)")
        ax.plot([], [], marker="x", color="gray", linestyle="none", label=f"final test {name}")
    if lm:
        ax.set_yscale("log")
    ax.set_xlabel("wall time (s)")
    ax.set_title(f"{'Perplexity' if lm else 'Accuracy'} vs wall time (mean over seeds)")
    ax.grid(True, alpha=0.3)
    _legend(fig, [ax])
    _save(fig, path)


def plot_step_breakdown(rows: list, path: Path) -> None:
    fig, (ax,) = _figure(height=max(3.0, 0.28 * len(rows) + 1.5))
    names = [_row_name(r) for r in rows]
    left = [0.0] * len(rows)
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    for key, color in zip(_TIMES, colors):
        widths = [r[f"{key}_ms"] or 0.0 for r in rows]
        ax.barh(range(len(rows)), widths, left=left, color=color, label=key)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_yticks(range(len(rows)), names, fontsize="x-small" if len(rows) > 20 else "small")
    ax.invert_yaxis()  # first row on top, as in the table
    ax.set_xlabel("mean time per step (ms)")
    ax.set_title("Step time breakdown (compress/communicate/decompress overlap backward; compute is the rest)",
                 fontsize="medium")
    ax.legend(title="part", fontsize="small")
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def plot_compression(rows: list, path: Path) -> None:
    fig, axes = _figure(ncols=2)
    per_epoch = _per_epoch(rows)
    kind, x = ("epochs", "epoch") if per_epoch else ("steps", "step")
    for i, r in enumerate(rows):
        for ax, key in zip(axes, ("ratio", "density")):
            xs, ys = _series(r["runs"], kind, key, x)
            # Log axes: a step that sent nothing (ratio inf or NaN, density 0) has no point.
            pts = [(a + (1 if per_epoch else 0), b) for a, b in zip(xs, ys) if math.isfinite(b) and b > 0]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if per_epoch else None,
                    label=_row_name(r) if key == "ratio" else None, **_style(i))
    for ax, key, title in zip(axes, ("ratio", "density"),
                              ("Compression ratio (dense bytes / bytes sent)", "Density (fraction of elements sent)")):
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_ylabel(key)
        ax.set_title(f"{title} per {x}", fontsize="medium")
        ax.grid(True, which="both", alpha=0.3)
    _legend(fig, axes)
    _save(fig, path)


# -- entry point --------------------------------------------------------------------------------------------


def render(directory) -> list:
    """Write results.md, results.csv and the plots into ``directory``; returns the paths written."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a directory (expected a sweep's directory, with sweep.json)")
    runs, planned = load_runs(directory)
    if not runs:
        raise ValueError(f"no finished runs in {directory} (looked for sweep.json, runs/*/summary.json and "
                         f"*/summary.json)")
    rows = aggregate(runs)
    lm = any(r["score_name"] == "test_perplexity" for r in rows)
    manifest = json.loads((directory / "sweep.json").read_text()) if (directory / "sweep.json").exists() else {}
    tuned = directory / "tuned_lrs.json"
    paths = [directory / "results.csv", directory / "results.md"] + [directory / p for p in PLOTS]
    write_csv(rows, paths[0])
    write_markdown(rows, paths[1], title=f"Sweep {manifest.get('name', directory.name)}",
                   description=manifest.get("description", ""), finished=len(runs), planned=planned,
                   tuned_lrs=json.loads(tuned.read_text()) if tuned.exists() else None, manifest=manifest)
    plot_accuracy_vs_density(rows, paths[2], lm)
    plot_curves(rows, paths[3], "loss", lm)
    plot_curves(rows, paths[4], "accuracy", lm)
    plot_accuracy_vs_time(rows, paths[5], lm)
    plot_step_breakdown(rows, paths[6])
    plot_compression(rows, paths[7])
    return paths
