"""End-to-end benchmark: does compression make training faster on a given link?

For each link (an emulated cluster per setting, one network namespace per worker) it trains the
Fashion-MNIST CNN with every contender — DDP's own allreduce, PyTorch's fp16 and PowerSGD hooks, a
no-communication hook (the compute-only limit), a hook that only waits for every rank once per bucket
(a one-element allreduce: the floor of any synchronous method), gradzip's methods, and DiLoCo's outer loop (each worker
steps its own replica and they exchange pseudo-gradients every H steps) — for the same number of steps,
and reports the training epoch time, step time and test accuracy, with ratios against dense and
against the limit, all measured in the same run.  A contender that crashes is reported as crashed.

With ``repeats`` > 1 the contenders run again, in the same order, that many times per link, and the
table gives medians.  Ratios are taken within each repeat (dense and a method run minutes apart, not
half an hour), then the median and range over repeats: on a shared machine the same run moves by a
few per cent from one launch to the next.
"""
from __future__ import annotations

import itertools
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Optional

from ..harness.report import machine, passes_range, provenance
from ..harness.trainer import TrainConfig, launch

LINKS = ("rate=100mbit", "rate=1gbit", "rate=10gbit", "unthrottled")

# (label, baseline hook or None, gradzip compressor, its parameters[, outer loop: TrainConfig.outer])
CONTENDERS = [
    ("dense allreduce", "allreduce", "none", {}),
    ("torch fp16 hook", "torch-fp16", "none", {}),
    ("torch bf16 hook", "torch-bf16", "none", {}),
    ("torch PowerSGD hook", "torch-powersgd", "none", {}),
    ("no communication (limit)", "nocomm", "none", {}),
    ("sync only", "sync", "none", {}),
    ("gradzip fp16", None, "fp16", {}),
    ("gradzip bf16", None, "bf16", {}),
    ("gradzip powersgd r2", None, "powersgd", {"rank": 2, "dense_steps": 10}),
    ("gradzip dgc 0.1%", None, "dgc", {"ratio": 0.001, "warmup_epochs": 0}),
    ("gradzip topk 1%", None, "topk", {"ratio": 0.01}),
    ("gradzip efsignsgd", None, "efsignsgd", {}),
    ("gradzip auto", None, "auto", {}),
    ("gradzip diloco H=50", None, "none", {}, "diloco:sync_every=50"),
    ("gradzip diloco H=50 topk 1%", None, "topk", {"ratio": 0.01}, "diloco:sync_every=50"),
]


@dataclass
class Result:
    link: str
    label: str
    epoch_s: Optional[float] = None
    step_s: Optional[float] = None
    accuracy: Optional[float] = None
    mb_sent: Optional[float] = None
    error: Optional[str] = None
    note: Optional[str] = None  # auto: which candidates it chose, over how many tensors
    repeat: int = 0
    buckets: Optional[list] = None  # rank 0's GradzipState.bucket_stats() (gradzip contenders)
    median_step_s: Optional[float] = None  # rank 0's median step: not moved by a first step's one-time costs
    passes: Optional[float] = None  # times the run went through its training data


def _choices_note(choices: dict) -> str:
    counts = Counter(choices.values())
    return ", ".join(f"{spec} x{n}" for spec, n in counts.most_common())


def run(links=LINKS, workers: int = 4, steps: int = 300, batch_size: int = 32, lr: float = 0.05,
        out_dir: str = "runs/bench-e2e", contenders=CONTENDERS, test_size: Optional[int] = None,
        repeats: int = 1, log=print) -> list[Result]:
    """Train every contender on every link, ``repeats`` times in turn; ``test_size`` None evaluates on
    the whole test set.

    A contender that has not finished within 4x the first contender's (dense DDP's) time on that link,
    or 2 minutes, is stopped and reported as crashed: a hung peer is a result, not a reason to wait.  So
    is one that makes no step for 20 of the first contender's mean steps, or a minute.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    results = []
    for link in links:
        timeout_s, stall_s = max(300.0, 5.0 * steps), None
        for repeat, (i, contender) in itertools.product(range(repeats), enumerate(contenders)):
            label, baseline, compressor, params = contender[:4]
            outer = contender[4] if len(contender) > 4 else None
            tag = f"-r{repeat}" if repeats > 1 else ""
            name = f"{link.replace('=', '-')}-{label.replace(' ', '_')}{tag}"
            start = time.perf_counter()
            try:
                config = TrainConfig(compressor=compressor, params=dict(params), baseline=baseline, outer=outer,
                                     workers=workers, epochs=1, max_steps=steps, batch_size=batch_size, lr=lr,
                                     test_size=test_size, netem=None if link == "unthrottled" else link,
                                     out_dir=out_dir, timeout_s=timeout_s, stall_s=stall_s, name=name,
                                     progress=False)
                launch(config)
            except Exception as exc:  # a crash of a contender is a result, not a benchmark failure
                results.append(Result(link, label, error=str(exc).splitlines()[0][:200], repeat=repeat))
                log(f"{link:14s} {label + tag:26s} CRASHED: {results[-1].error}")
                continue
            finally:
                if i == 0:
                    timeout_s = max(120.0, 4.0 * (time.perf_counter() - start))
            epoch = [json.loads(line) for line in open(f"{out_dir}/{config.name}/metrics.jsonl")
                     if '"kind": "epoch"' in line][-1]
            summary = json.load(open(f"{out_dir}/{config.name}/summary.json"))
            step_times = [json.loads(line)["step_s"] for line in open(f"{out_dir}/{config.name}/metrics.jsonl")
                          if '"kind": "step"' in line]
            results.append(Result(link, label, epoch["train_s"], summary["mean_step_s"], epoch["test_accuracy"],
                                  summary["total_bytes_sent"] / 2**20 if baseline is None else None,
                                  note=_choices_note(summary["choices"]) if "choices" in summary else None,
                                  repeat=repeat, buckets=summary.get("buckets") if baseline is None else None,
                                  median_step_s=statistics.median(step_times), passes=summary.get("passes")))
            r = results[-1]
            if i == 0:
                stall_s = max(60.0, 20.0 * r.step_s)
            log(f"{link:14s} {label + tag:26s} epoch {r.epoch_s:7.2f} s  step {1000 * r.step_s:7.1f} ms  "
                f"acc {r.accuracy:.4f}  ({time.perf_counter() - start:.0f} s)" + (f"  [{r.note}]" if r.note else ""))
    return results


def medians(results: list[Result]) -> list[Result]:
    """One row per link and contender: the median of its repeats, or crashed if it crashed in any."""
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.link, r.label), []).append(r)
    rows = []
    for (link, label), runs in groups.items():
        crashed = [r for r in runs if r.error]
        if crashed:
            rows.append(Result(link, label, error=crashed[0].error
                               + (f" ({len(crashed)} of {len(runs)} repeats)" if len(runs) > 1 else "")))
            continue

        def median(field):
            values = [getattr(r, field) for r in runs]
            return None if None in values else statistics.median(values)

        rows.append(Result(link, label, median("epoch_s"), median("step_s"), median("accuracy"), median("mb_sent"),
                           note=" | ".join(dict.fromkeys(r.note for r in runs if r.note)) or None,
                           median_step_s=median("median_step_s")))
    return rows


def _ratios(results: list[Result], link: str, numerator: str, denominator: str, field: str = "epoch_s") -> list[float]:
    """numerator's epoch time (or another ``field``) over denominator's, within each repeat in which both
    finished."""
    times = {(r.label, r.repeat): getattr(r, field) for r in results
             if r.link == link and r.error is None and getattr(r, field) is not None}
    return [times[numerator, k] / times[denominator, k] for k in sorted({r.repeat for r in results})
            if (numerator, k) in times and (denominator, k) in times]


def _ratio_text(ratios: list[float], suffix: str = "") -> str:
    """'1.37x', or with several repeats the median and range: '1.37x (1.31-1.40)'."""
    text = f"{statistics.median(ratios):.2f}{suffix}"
    return text + (f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else "")


def table(results: list[Result], steps: int, workers: int, command: Optional[str] = None) -> str:
    """Markdown: per link, each contender's epoch time and accuracy, and its speed against dense and the limit
    (with several repeats: medians, and each ratio's median and range over the repeats)."""
    repeats = len({r.repeat for r in results})
    lines = provenance(command, "0 (every run; repeats measure time, and accuracy differences are one seed's)",
                       passes_range(r.passes for r in results), machine())
    lines += [f"{workers} workers, Fashion-MNIST CNN, batch 32 per worker, {steps} steps per 'epoch'; test accuracy "
             f"after them (DiLoCo: of its global parameters); KiB/step: sent per worker per (inner) step."
             + (f" Median of {repeats} repeats; ratios within each repeat, then their median (range)."
                if repeats > 1 else ""), ""]
    combined = medians(results)
    for link in dict.fromkeys(r.link for r in combined):
        rows = [r for r in combined if r.link == link]
        dense = next((r for r in rows if r.label.startswith("dense") and r.error is None), None)
        limit = next((r for r in rows if r.label.startswith("no communication") and r.error is None), None)
        lines += [f"### {link}", "",
                  "| method | epoch s | step ms | median step ms | test acc | MiB sent/worker | KiB/step | speedup vs dense "
                  "| x limit |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.error:
                lines.append(f"| {r.label} | crashed: {r.error} | | | | | | | |")
                continue
            speed = _ratio_text(_ratios(results, link, dense.label, r.label), "x") if dense else "-"
            vs_limit = _ratio_text(_ratios(results, link, r.label, limit.label)) if limit else "-"
            sent = f"{r.mb_sent:.1f} | {r.mb_sent * 1024 / steps:.1f}" if r.mb_sent is not None else "- | -"
            median_ms = f"{1000 * r.median_step_s:.1f}" if r.median_step_s is not None else "-"
            lines.append(f"| {r.label} | {r.epoch_s:.2f} | {1000 * r.step_s:.1f} | {median_ms} | {r.accuracy:.4f} | {sent} | "
                         f"{speed} | {vs_limit} |")
        lines.append("")
        lines += [f"{r.label} chose: {r.note}" for r in rows if r.note] + [""]
        lines += bucket_table([r for r in results if r.link == link and r.repeat == 0])
    return "\n".join(lines + targets(results))


def bucket_table(results: list[Result]) -> list[str]:
    """Where each bucket's exchange spends its time, per gradzip contender (rank 0, first repeat), in ms
    per exchange: the hook on backward's thread, the wait in gradzip's queue, and the thread's split."""
    rows = [r for r in results if r.buckets]
    if not rows:
        return []
    lines = ["Per bucket, ms per exchange on rank 0 (hook: on backward's thread; queued: waiting for gradzip's "
             "thread; plain: share of exchanges on DDP's own allreduce, whose time is not split):", "",
             "| method | bucket | elements | plain | hook | queued | compress | communicate | decompress |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for b in r.buckets:
            n = max(b["exchanges"], 1)
            ms = " | ".join(f"{1000 * b[k] / n:.2f}" for k in ("hook_s", "queued_s", "compress_s", "communicate_s",
                                                                 "decompress_s"))
            lines.append(f"| {r.label} | {b['bucket']} ({b['tensors']}) | {b['elements']:,} | "
                         f"{b['plain'] / n:.0%} | {ms} |")
    return lines + [""]


def _ok(passed: bool) -> str:
    return "met" if passed else "NOT met"


def targets(results: list[Result]) -> list[str]:
    """The performance targets, checked against this run's numbers (lines of Markdown): at 100 Mbit/s the
    fastest gradzip method at least 5x dense's and 2.5x torch fp16's speed and within 0.5 points of dense's
    accuracy; at 1 Gbit/s at least 1.4x dense and within 1.15x the no-communication limit; auto at most
    1.03x dense's epoch time unthrottled; every gradzip method completes on every link.  With several
    repeats, against the median over repeats of each ratio taken within a repeat."""
    lines = ["### Targets", ""]
    by = {(r.link, r.label): r for r in medians(results) if r.error is None}
    for link in dict.fromkeys(r.link for r in results):
        dense, limit = by.get((link, "dense allreduce")), by.get((link, "no communication (limit)"))
        fp16 = by.get((link, "torch fp16 hook"))
        # DiLoCo's contenders train another way (H local steps per exchange): the per-step targets
        # compare per-step methods only, and the outer loop gets a line of its own.
        ours = [r for (lk, label), r in by.items() if lk == link and label.startswith("gradzip")
                and "diloco" not in label]
        outer = [r for (lk, label), r in by.items() if lk == link and label.startswith("gradzip diloco")]
        if not dense or not ours:
            continue

        def ratio(numerator, denominator):
            return statistics.median(_ratios(results, link, numerator.label, denominator.label))

        best = min(ours, key=lambda r: r.epoch_s)
        speedup = ratio(dense, best)
        text = f"- {link}: fastest gradzip method {best.label}, {speedup:.2f}x dense"
        if link == "rate=100mbit":
            gap = 100 * (dense.accuracy - best.accuracy)
            text += f" (5x: {_ok(speedup >= 5)})"
            if fp16:
                text += f", {ratio(fp16, best):.2f}x torch fp16 (2.5x: {_ok(ratio(fp16, best) >= 2.5)})"
            text += f", accuracy {abs(gap):.2f} points {'below' if gap > 0 else 'above'} dense (0.5: {_ok(gap <= 0.5)})"
            passing = [r.label for r in ours if ratio(dense, r) >= 5 and dense.accuracy - r.accuracy <= 0.005
                       and (fp16 is None or ratio(fp16, r) >= 2.5)]
            text += f"; methods meeting all three: {', '.join(passing) or 'none'}"
        elif link == "rate=1gbit" and limit:
            text += (f" (1.4x: {_ok(speedup >= 1.4)}), {ratio(best, limit):.2f}x the limit "
                     f"(1.15x: {_ok(ratio(best, limit) <= 1.15)})")
        auto = by.get((link, "gradzip auto"))
        if auto:
            spread = _ratios(results, link, auto.label, dense.label)
            text += f"; auto {ratio(auto, dense):.3f}x dense's epoch time" + (
                f" ({min(spread):.3f}x-{max(spread):.3f}x over {len(spread)} repeats)" if len(spread) > 1 else "")
            text += f", {ratio(auto, best):.2f}x the fastest"
            if link == "unthrottled":
                text += f" (at most 1.03x dense: {_ok(ratio(auto, dense) <= 1.03)})"
        lines.append(text)
        lines += _hook_targets(results, by, link, ours, dense, limit)
        if outer:
            fastest = min(outer, key=lambda r: r.epoch_s)
            lines.append(f"- {link}, outer loop (not counted above): fastest {fastest.label}, "
                         f"{ratio(dense, fastest):.2f}x dense, accuracy {100 * (fastest.accuracy - dense.accuracy):+.2f} "
                         f"points against dense")
    crashed = sorted({r.label for r in results if r.error and r.label.startswith("gradzip")})
    lines.append(f"- every gradzip method completed on every link: {_ok(not crashed)}"
                 + (f" ({', '.join(crashed)} did not)" if crashed else ""))
    return lines


def _hook_targets(results, by, link, ours, dense, limit) -> list[str]:
    """Against PyTorch's own hooks (median step times, ratios within a repeat; epoch times where a run has
    no step times): gradzip's fp16 and bf16 at most 1.0x the matching hook's; at 1 Gbit/s the fastest
    gradzip method and auto at most 0.8x the fp16 hook and 1.2x the no-communication limit; auto at most
    1.03x the faster of dense and the fp16 hook."""
    field = "median_step_s" if all(r.median_step_s is not None for r in results if r.error is None) else "epoch_s"

    def ratio(numerator, denominator):
        return statistics.median(_ratios(results, link, numerator.label, denominator.label, field))

    lines = []
    for half in ("fp16", "bf16"):
        ours_half, hook = by.get((link, f"gradzip {half}")), by.get((link, f"torch {half} hook"))
        if ours_half and hook:
            r = ratio(ours_half, hook)
            lines.append(f"- {link}: gradzip {half} {r:.3f}x torch's {half} hook (at most 1.0x: {_ok(r <= 1.0)})")
    fp16, auto = by.get((link, "torch fp16 hook")), by.get((link, "gradzip auto"))
    if fp16 and limit and link == "rate=1gbit":
        best = min(ours, key=lambda r: getattr(r, field))
        for label, r in ((f"fastest gradzip method ({best.label})", best), ("auto", auto)):
            if r:
                to_hook, to_limit = ratio(r, fp16), ratio(r, limit)
                lines.append(f"- {link}: {label} {to_hook:.2f}x torch fp16 hook (0.8x: {_ok(to_hook <= 0.8)}), "
                             f"{to_limit:.2f}x the limit (1.2x: {_ok(to_limit <= 1.2)})")
    if auto and fp16:
        faster = min((dense, fp16), key=lambda r: getattr(r, field))
        r = ratio(auto, faster)
        lines.append(f"- {link}: auto {r:.3f}x the faster of dense and torch fp16 ({faster.label}) "
                     f"(at most 1.03x: {_ok(r <= 1.03)})")
    return lines


def plot(results: list[Result], path: str, workers: int) -> None:
    """Epoch time against link bandwidth, one line per contender (log-log), for a run of ``workers``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    speeds = {"rate=100mbit": 0.1, "rate=1gbit": 1.0, "rate=10gbit": 10.0, "unthrottled": 40.0}
    results = medians(results)
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for label in dict.fromkeys(r.label for r in results):
        points = sorted((speeds[r.link], r.epoch_s) for r in results
                        if r.label == label and r.error is None and r.link in speeds)
        if points:
            style = "--" if not label.startswith("gradzip") else "-"
            ax.plot(*zip(*points), style, marker="o", label=label)
    top = ax.get_ylim()[1]  # crashes have no time: mark them along the top, one legend entry per contender
    for label, marker in zip(dict.fromkeys(r.label for r in results if r.error is not None and r.link in speeds),
                             itertools.cycle("xX+*")):
        xs = [speeds[r.link] for r in results if r.label == label and r.error is not None and r.link in speeds]
        ax.plot(xs, [top] * len(xs), marker, color="red", markersize=9, linestyle="none", label=f"{label}: crashed")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xticks(list(speeds.values()), ["100 Mbit/s", "1 Gbit/s", "10 Gbit/s", "unthrottled"])
    ax.set_xlabel("link bandwidth per worker (emulated, tbf)")
    ax.set_ylabel("training epoch time (s)")
    ax.set_title(f"Epoch time vs bandwidth ({workers} workers, Fashion-MNIST CNN)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(results: list[Result], path: str) -> None:
    json.dump([r.__dict__ for r in results], open(path, "w"), indent=1)


def load(path: str) -> list[Result]:
    return [Result(**row) for row in json.load(open(path))]
