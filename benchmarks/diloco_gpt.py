"""DiLoCo's outer loop against per-step training on the tiny GPT, over several seeds, with wall-clock
projected for slow links.

    python3 benchmarks/diloco_gpt.py --estimate            # one short cell: the cost of the runs below
    python3 benchmarks/diloco_gpt.py --out docs/results/diloco_gpt.md          # the comparison
    python3 benchmarks/diloco_gpt.py --grid --out docs/results/diloco_outer_grid.md   # outer lr x momentum x H
    python3 benchmarks/diloco_gpt.py --check-links --out docs/results/diloco_links.md  # the projection, checked

Every run: the harness's GPT (2 blocks, width 128, context 64; 0.42M parameters), character-level on the
``corpus`` dataset (the Python documentation's sources, Debian package python3-doc: 10.0 MB of training
text, 49 held-out documents as test), 2 worker processes (gloo), AdamW, 16 sequences of 64 characters per
worker per (inner) step, test loss on 512 held-out sequences every ``--eval-every`` steps (DiLoCo: of its
global parameters theta_g).  800 steps are 0.16 passes over the training data (the lone worker's 1600
steps too), so no contender can win by memorising it (the license texts of the earlier version of this
benchmark gave 19 passes).

The comparison (default), ``--steps`` S inner steps each (800), every seed of ``--seeds`` (0, 1, 2):
- dense DDP at the learning rate tuned first: the grid ``--lrs`` on a 10% validation split of the training
  set (seed 0, S steps), widened while the best is at an edge (``gradzip.harness.sweep.bracket_lr``); every
  contender then uses that lr;
- per-step methods: bf16, PowerSGD (rank 2) and Top-k 1%, every step;
- DiLoCo at every H of ``--hs`` (10, 50, 200) that gives at least 10 syncs in S steps (S = 800: H = 10
  and 50; H = 200 needs ``--steps 2000``): plain parameter averaging (outer lr
  1, no momentum), the DiLoCo paper's outer step (lr 0.7, Nesterov 0.9), SparseLoCo (outer lr 1), and
  gradzip's 4-bit quantiser (qsgd levels 7, max norm; outer lr 1) as a compressed outer method;
- one worker alone, for 2S steps, so that it also reaches the others' number of tokens.

Loss at equal inner steps (S), at equal tokens (S x 16 x 2 x 64) and at equal wall-clock on 100 Mbit/s and
10 Mbit/s links.  Wall-clock is the cost model's (gradzip/costmodel.py; alpha-beta ring collectives, alpha
100 us), not emulated links: a step costs the measured compute (the median local step of the DiLoCo runs,
2 workers sharing this machine) plus the method's codec and collectives, profiled on the GPT's gradients
(``profile_method``), every step for the per-step methods and once per H steps for DiLoCo
(``outer_step_time``), none of it overlapped.  The arithmetic of a run does not depend on the link, so each
run trains once, unthrottled, and its losses are read at the step its projected time allows.  The earlier
version ran every contender behind emulated links (gradzip.netem, root), one seed: the cost model's
alpha-beta projection came within 8% of such runs on the CNN (docs/results/cost_model.md).
``--check-links`` checks it on this benchmark: a few contenders (``CHECKED``) for 60-300 inner steps on
emulated 100 and 10 Mbit/s links (root), measured ms per inner step against the projection.

``--grid``: DiLoCo with ``compressor="none"``, outer lr (0.5, 0.7, 1, 1.4) x outer momentum (Nesterov; 0,
0.5, 0.9) x H (as above), at the tuned lr, seed 0 (``--grid-seeds``).

Runs go to ``--out-dir``/{tuning,main,grid}/<name>; a finished run (its summary.json exists) is not run
again, so an interrupted benchmark resumes where it stopped.

Cost, estimated with ``--estimate`` (not run in full): fresh 20-step cells of dense DDP and DiLoCo, timed
while other jobs shared the 2 cores, extrapolated to every planned run, and scaled to idle cores by one
training step's CPU time on one thread over the cell's step.  Two estimates, minutes apart:
  load 4.6: dense 13.0 s start-up, 157 ms/step; DiLoCo 12.0 s, 98 ms/step; 0.9 s per evaluation; x0.54
  load 3.6: DiLoCo 6.9 s start-up, 67 ms/step; 0.7 s per evaluation; x0.65
  comparison (39 runs + about 4 tuning runs): 93 and 60 minutes as measured, 50 and 39 on 2 idle cores;
  grid (24 runs):                             42 and 29 minutes as measured, 22 and 19 on 2 idle cores;
  ``--steps 600`` (H = 50 still 12 syncs) takes about a quarter less; ``--steps 2000`` (H = 200 too, 51
  runs) about 2 hours on 2 idle cores.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gradzip.compressors import make
from gradzip.costmodel import Link, outer_step_time, profile_method, step_time
from gradzip.harness.report import machine, passes_range, provenance
from gradzip.harness.sweep import bracket_lr
from gradzip.harness.trainer import TrainConfig, launch

BASE = dict(model="gpt", dataset="corpus", seq_len=64, optimizer="adamw", batch_size=16, test_size=512, workers=2,
            progress=False, timeout_s=3600.0)
LINKS = ("100mbit", "10mbit")
PER_STEP = {
    "dense DDP": dict(compressor="none"),
    "bf16 every step": dict(compressor="bf16"),
    "powersgd every step": dict(compressor="powersgd"),
    "topk 1% every step": dict(compressor="topk", params={"ratio": 0.01}),
}
# name -> (compressor, its parameters, outer options besides sync_every)
OUTER = {
    "averaging": ("none", {}, "outer_lr=1,outer_momentum=0"),
    "paper's outer step": ("none", {}, "outer_lr=0.7,outer_momentum=0.9"),
    "sparseloco": ("sparseloco", {}, "outer_lr=1,outer_momentum=0"),
    "qsgd 4-bit": ("qsgd", {"levels": 7, "norm": "max"}, "outer_lr=1,outer_momentum=0"),
}
ALONE = "one worker alone"
MIN_SYNCS = 10
GRID_LRS, GRID_MOMENTA = (0.5, 0.7, 1.0, 1.4), (0.0, 0.5, 0.9)


def hs_for(steps: int, hs) -> list:
    """The H of ``hs`` that give at least MIN_SYNCS syncs in ``steps`` inner steps."""
    return [h for h in hs if steps // h >= MIN_SYNCS]


def contenders(steps: int, hs) -> dict:
    """label -> TrainConfig fields (without lr, seed and lengths), and the steps each runs."""
    runs = {label: (fields, steps) for label, fields in PER_STEP.items()}
    for h in hs_for(steps, hs):
        for name, (compressor, params, options) in OUTER.items():
            runs[f"diloco H={h} {name}"] = (dict(compressor=compressor, params=params,
                                                 outer=f"diloco:sync_every={h},{options}"), steps)
    runs[ALONE] = (dict(compressor="none", workers=1), 2 * steps)
    return runs


def grid_cells(hs) -> dict:
    return {f"H={h} lr={lr:g} momentum={mu:g}": dict(
                compressor="none", outer=f"diloco:sync_every={h},outer_lr={lr},outer_momentum={mu}")
            for h in hs for mu in GRID_MOMENTA for lr in GRID_LRS}


def _name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "._+-" else "_" for c in label.replace("%", "pct"))


def run(out_dir: Path, label: str, fields: dict, steps: int, eval_every: int, lr: float, seed: int, **extra) -> dict:
    """Train one contender (or reuse its finished run); returns its epochs, steps and summary."""
    name = f"{_name(label)}-s{seed}"
    directory = out_dir / name
    if not (directory / "summary.json").exists():
        print(f"run {out_dir.name}/{name}", flush=True)
        launch(TrainConfig(**{**BASE, **fields, **extra}, lr=lr, seed=seed, max_steps=eval_every,
                           epochs=steps // eval_every, out_dir=str(out_dir), name=name))
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return {"epochs": [r for r in records if r["kind"] == "epoch"], "steps": [r for r in records if r["kind"] == "step"],
            "summary": json.loads((directory / "summary.json").read_text())}


def tune(out_dir: Path, args) -> tuple:
    """Dense DDP's lr: the best validation loss, the grid widened while the best is at an edge."""
    def losses(lr):
        # One evaluation, at the end: the validation split (15,600 sequences) is slow to score.
        r = run(out_dir, f"dense DDP lr={lr:g}", PER_STEP["dense DDP"], args.steps, args.steps, lr, 0, validation=0.1)
        return [r["summary"]["final_test_loss"]]

    return bracket_lr(losses, args.lrs, args.widen, lower_is_better=True)


# --------------------------------------------------------------------------------- the cost model


def _gradients() -> list:
    """The GPT's gradients on one corpus batch, for profiling what each method sends."""
    from gradzip.harness.data import load_dataset
    from gradzip.harness.models import build_model

    data, info = load_dataset("corpus", seq_len=BASE["seq_len"])
    torch.manual_seed(0)
    model = build_model("gpt", info)
    x, y = data[: BASE["batch_size"]]
    out = model(x)
    torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
    return [(n, p.grad.detach().clone()) for n, p in model.named_parameters()]


class Pace(NamedTuple):
    """A contender's projected time per inner step: ``warm_ms`` for its first ``warm`` steps (PowerSGD's
    ``dense_steps``, sent dense), ``ms`` after them."""

    ms: float
    warm: int = 0
    warm_ms: float = 0.0

    def seconds_for(self, steps: float) -> float:
        return (min(steps, self.warm) * self.warm_ms + max(0.0, steps - self.warm) * self.ms) / 1e3

    def steps_within(self, seconds: float) -> float:
        warm_s = self.warm * self.warm_ms / 1e3
        if seconds <= warm_s:
            return 1e3 * seconds / self.warm_ms
        return self.warm + 1e3 * (seconds - warm_s) / self.ms


def pace(fields: dict, compute_s: float, link: Link, grads: list, cache: dict) -> Pace:
    """The projected pace on ``link``, with a method's dense first steps at dense DDP's pace."""
    warm = getattr(make(fields["compressor"], **fields.get("params", {})), "dense_steps", 0) \
        if "outer" not in fields and fields.get("workers") != 1 else 0
    dense_ms = step_ms(PER_STEP["dense DDP"], compute_s, link, grads, cache) if warm else 0.0
    return Pace(step_ms(fields, compute_s, link, grads, cache), warm, dense_ms)


def step_ms(fields: dict, compute_s: float, link: Link, grads: list, cache: dict) -> float:
    """Projected ms per inner step on ``link`` with 2 workers (1 worker: compute only), once compressing."""
    if fields.get("workers") == 1:
        return 1e3 * compute_s
    key = (fields["compressor"], json.dumps(fields.get("params", {}), sort_keys=True), "outer" in fields)
    if key not in cache:  # DiLoCo exchanges every tensor in one call: one bucket
        one_bucket = dict(bucket_cap_mb=1e6, first_bucket_mb=None) if "outer" in fields else {}
        cache[key] = profile_method(grads, fields["compressor"], fields.get("params", {}), **one_bucket)
    if "outer" in fields:
        h = int(fields["outer"].split("sync_every=")[1].split(",")[0])
        return 1e3 * outer_step_time(cache[key], compute_s, link, 2, h)["step_s"]
    return 1e3 * step_time(cache[key], compute_s, link, 2)["step_s"]


def compute_seconds(runs: dict) -> float:
    """The median local step: DiLoCo's inner steps that sent nothing (2 workers sharing this machine)."""
    times = [s["step_s"] for label, seeds in runs.items() if label.startswith("diloco")
             for r in seeds for s in r["steps"] if s["bytes_sent"] == 0]
    return statistics.median(times)


# ---------------------------------------------------------------------------------------- tables


def loss_at_step(r: dict, step: int):
    return next((e["test_loss"] for e in r["epochs"] if e["step"] == step), None)


def loss_within(r: dict, steps: float):
    """Test loss after ``steps`` inner steps, interpolated linearly between the two evaluations around it
    (the last one past the run's end; None: before the first).  Reading the last evaluation at or before
    ``steps`` instead would make a contender whose time falls a hair short of an evaluation lose 50 steps."""
    evals = [(e["step"], e["test_loss"]) for e in r["epochs"]]
    before = [(s, v) for s, v in evals if s <= steps + 1e-9]
    after = [(s, v) for s, v in evals if s > steps + 1e-9]
    if not before:
        return None
    (s0, v0) = before[-1]
    if not after or not (math.isfinite(v0) and math.isfinite(after[0][1])):
        return v0
    s1, v1 = after[0]
    return v0 + (v1 - v0) * (steps - s0) / (s1 - s0)


def _pm(values, spec=".3f") -> str:
    if any(v is None for v in values) or not values:
        return "—"
    if any(not math.isfinite(v) for v in values):
        return "diverged"
    mean = statistics.mean(values)
    return format(mean, spec) + (f" ± {statistics.stdev(values):{spec}}" if len(values) > 1 else "")


def main_table(runs: dict, fields: dict, steps: int, grads: list) -> list:
    compute_s = compute_seconds(runs)
    links, cache = {link: Link.from_rate(link) for link in LINKS}, {}
    ms = {(label, link): pace(fields[label][0], compute_s, links[link], grads, cache)
          for label in runs for link in LINKS}
    reference = next(label for label in runs if label.startswith("diloco") and label.endswith("sparseloco"))
    horizon = {link: ms[reference, link].seconds_for(steps) for link in LINKS}
    tokens = steps * BASE["batch_size"] * BASE["workers"] * BASE["seq_len"]
    lines = [f"Compute per inner step (median local step, 2 workers on this machine): {1e3 * compute_s:.1f} ms. "
             f"Equal wall-clock: the projected time `{reference}` needs for {steps} steps: "
             + ", ".join(f"{horizon[link]:.0f} s at {link[:-4]} Mbit/s" for link in LINKS) + ".", "",
             f"| contender | seeds | passes | test loss @{steps} steps | @ equal tokens ({tokens / 1e6:.2f}M) | "
             + " | ".join(f"@ equal wall-clock {link[:-4]} Mbit/s" for link in LINKS)
             + " | KiB sent per inner step per worker | " + " | ".join(f"ms/step {link[:-4]} Mbit/s" for link in LINKS)
             + " |", "|---" * (6 + 2 * len(LINKS)) + "|"]
    for label, seeds in runs.items():
        per_token = BASE["batch_size"] * seeds[0]["summary"]["workers"] * BASE["seq_len"]
        cells = [_pm([loss_at_step(r, steps) for r in seeds]), _pm([loss_at_step(r, tokens // per_token) for r in seeds])]
        cells += [_pm([loss_within(r, ms[label, link].steps_within(horizon[link])) for r in seeds]) for link in LINKS]
        kib = statistics.mean(r["summary"]["total_bytes_sent"] / r["summary"]["steps"] / 1024 for r in seeds)
        kib *= seeds[0]["summary"]["workers"] > 1  # a lone worker's gradzip counts what it would send: nothing
        passes = statistics.mean(r["summary"]["passes"] for r in seeds)
        lines.append(f"| {label} | {len(seeds)} | {passes:.2f} | " + " | ".join(cells) + f" | {kib:.1f} | "
                     + " | ".join(_pace_text(ms[label, link]) for link in LINKS) + " |")
    return lines


def _pace_text(p: Pace) -> str:
    return f"{p.ms:.1f}" + (f" (first {p.warm}: {p.warm_ms:.1f})" if p.warm else "")


def grid_table(runs: dict, hs, steps: int) -> list:
    lines = [f"Test loss after {steps} inner steps (mean ± std over seeds), DiLoCo with `compressor=\"none\"`, "
             f"Nesterov outer momentum.", "",
             "| H | outer momentum | " + " | ".join(f"outer lr {lr:g}" for lr in GRID_LRS) + " |",
             "|---|---|" + "---|" * len(GRID_LRS)]
    for h in hs:
        for mu in GRID_MOMENTA:
            cells = [_pm([loss_at_step(r, steps) for r in runs[f"H={h} lr={lr:g} momentum={mu:g}"]])
                     for lr in GRID_LRS]
            lines.append(f"| {h} | {mu:g} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------- the projection, checked

#: Contender -> inner steps on each emulated link: enough for 5 syncs after the first sync period.
CHECKED = {"dense DDP": 60, "bf16 every step": 60, "powersgd every step": 60, "topk 1% every step": 60,
           "diloco H=10 averaging": 60, "diloco H=10 sparseloco": 60, "diloco H=10 qsgd 4-bit": 60,
           "diloco H=50 qsgd 4-bit": 300}


def _period(label: str) -> int:
    """Steps left out at the start of a checked run: its first sync period (DiLoCo), or 5 steps."""
    return int(label.split("H=")[1].split()[0]) if label.startswith("diloco") else 5


def check_links(root: Path, lr: float) -> tuple:
    """Each CHECKED contender on emulated links (gradzip.netem: a network namespace per worker, tc tbf
    both ways; root), seed 0: measured ms per inner step against the cost model's projection, both from
    the same runs' compute (the median local step of the DiLoCo runs here)."""
    fields = contenders(800, [10, 50])
    runs = {(label, link): run(root / link, label, fields[label][0], steps, steps, lr, 0, netem=f"rate={link}")
            for link in LINKS for label, steps in CHECKED.items()}
    compute_s = statistics.median(s["step_s"] for (label, _), r in runs.items() if label.startswith("diloco")
                                  for s in r["steps"] if s["bytes_sent"] == 0)
    grads, cache = _gradients(), {}
    lines = [f"Measured on emulated links (2 workers, one network namespace each, tbf both ways), seed 0, the "
             f"steps after the first sync period (first 5 steps for per-step methods); projected by the cost "
             f"model from these runs' median local step ({1e3 * compute_s:.1f} ms).", "",
             "| contender | link | steps | measured ms/step | projected ms/step | projected / measured |",
             "|---|---|---|---|---|---|"]
    for (label, link), r in runs.items():
        skip = _period(label)
        kept = r["steps"][skip:]
        measured = 1e3 * statistics.mean(s["step_s"] for s in kept)
        p = pace(fields[label][0], compute_s, Link.from_rate(link), grads, cache)
        projected = 1e3 * (p.seconds_for(skip + len(kept)) - p.seconds_for(skip)) / len(kept)
        lines.append(f"| {label} | {link[:-4]} Mbit/s | {len(kept)} | {measured:.1f} | {projected:.1f} | "
                     f"{projected / measured:.2f} |")
    return lines, {f"{label} {link}": [r] for (label, link), r in runs.items()}


# --------------------------------------------------------------------------------------- running


def _cpu_step_s(steps: int = 30) -> float:
    """CPU seconds of one local step on one thread (what each of 2 workers on 2 idle cores spends)."""
    torch.set_num_threads(1)
    from gradzip.harness.data import load_dataset
    from gradzip.harness.models import build_model

    data, info = load_dataset("corpus", seq_len=BASE["seq_len"])
    torch.manual_seed(0)
    model = build_model("gpt", info)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    b = BASE["batch_size"]
    for i in range(steps + 5):
        if i == 5:
            start = time.thread_time()
        x, y = data[i * b: (i + 1) * b]
        opt.zero_grad()
        out = model(x)
        torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
    return (time.thread_time() - start) / steps


def estimate(args) -> None:
    """Time 20-step cells of dense DDP and DiLoCo and extrapolate to every run of both sweeps."""
    out_dir, cell = Path(args.out_dir) / "estimate", {}
    shutil.rmtree(out_dir, ignore_errors=True)  # time fresh runs, start-up included
    for label, fields in (("dense DDP", PER_STEP["dense DDP"]),
                          ("diloco", dict(compressor="none", outer="diloco:sync_every=10,outer_lr=1,outer_momentum=0"))):
        start = time.perf_counter()
        r = run(out_dir, label, fields, 20, 10, args.lr, 0)
        total = time.perf_counter() - start
        train = sum(e["train_s"] for e in r["epochs"])
        evals = sum(e["epoch_s"] - e["train_s"] for e in r["epochs"]) / len(r["epochs"])
        cell[label] = (total - sum(e["epoch_s"] for e in r["epochs"]), train / 20, evals)
        print(f"{label}: start-up {cell[label][0]:.1f} s, {1e3 * cell[label][1]:.1f} ms per step, "
              f"{cell[label][2]:.2f} s per evaluation of {BASE['test_size']} sequences")

    def cost(plan):  # plan: [(per-step method?, steps)]
        return sum(cell["dense DDP" if heavy else "diloco"][0] + s * cell["dense DDP" if heavy else "diloco"][1]
                   + s // args.eval_every * cell["diloco"][2] for heavy, s in plan)

    main = [(label in PER_STEP, s) for label, (_, s) in contenders(args.steps, args.hs).items()] * len(args.seeds)
    # The grid and one widening, typically; each scores its 15,600 validation sequences once, at the end.
    tuning = [(True, args.steps)] * (len(args.lrs) + 1)
    grid = [(False, args.steps)] * len(grid_cells(hs_for(args.steps, args.hs))) * len(args.grid_seeds)
    validation = len(tuning) * (15_600 / BASE["test_size"] - args.steps // args.eval_every) * cell["diloco"][2]
    idle = _cpu_step_s() / cell["diloco"][1]  # < 1 when other jobs slowed the cells down
    load = os.getloadavg()[0]
    for what, factor in ((f"as measured (load average {load:.1f})", 1.0),
                         (f"on 2 idle cores (x{idle:.2f}: one thread's CPU time per step / the cell's step)", idle)):
        print(f"{what}: comparison {len(main)} runs + {len(tuning)} tuning runs, about "
              f"{factor * (cost(main) + cost(tuning) + validation) / 60:.0f} minutes; grid {len(grid)} runs, about "
              f"{factor * cost(grid) / 60:.0f} minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the Markdown tables here too")
    parser.add_argument("--out-dir", default="runs/bench-diloco-gpt")
    parser.add_argument("--steps", type=int, default=800, help="inner steps per run (the lone worker: twice)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--grid-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--hs", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2], help="dense DDP's tuning grid")
    parser.add_argument("--widen", type=int, default=3, help="lrs beyond the grid's edge, at most")
    parser.add_argument("--lr", type=float, default=3e-3, help="lr of --estimate's cells")
    parser.add_argument("--grid", action="store_true", help="the outer lr x momentum x H sweep instead")
    parser.add_argument("--estimate", action="store_true", help="time two 20-step cells, print the cost of both sweeps")
    parser.add_argument("--check-links", action="store_true",
                        help="short runs on emulated links (root): measured step times against the projection")
    args = parser.parse_args()
    if args.steps % args.eval_every:
        parser.error("--steps must be a multiple of --eval-every")
    if args.estimate:
        return estimate(args)
    root = Path(args.out_dir)
    lr, scores, at_edge = tune(root / "tuning", args)
    lines = [f"Dense DDP's lr, tuned on a 10% validation split (seed 0, {args.steps} steps): {lr:g}"
             + (" (still at the edge of the lrs tried: widen further)" if at_edge else "") + "; validation loss "
             + ", ".join(f"{k:g}: {v[0]:.3f}" for k, v in sorted(scores.items())) + ".", ""]
    hs = hs_for(args.steps, args.hs)
    if args.check_links:
        checked, runs = check_links(root / "links", lr)
        lines += checked
    elif args.grid:
        runs = {label: [run(root / "grid", label, f, args.steps, args.eval_every, lr, s) for s in args.grid_seeds]
                for label, f in grid_cells(hs).items()}
        lines += grid_table(runs, hs, args.steps)
    else:
        fields = contenders(args.steps, args.hs)
        runs = {label: [run(root / "main", label, f, n, args.eval_every, lr, s) for s in args.seeds]
                for label, (f, n) in fields.items()}
        lines += main_table(runs, fields, args.steps, _gradients())
    seeds = [0] if args.check_links else args.grid_seeds if args.grid else args.seeds
    why = ("timings of one seed: no loss is compared, so none is claimed" if args.check_links else
           "one seed: no difference is claimed here" if len(seeds) == 1 else "mean ± std")
    lines = provenance("python3 benchmarks/diloco_gpt.py " + shlex.join(sys.argv[1:]),
                       ", ".join(map(str, seeds)) + f" ({why}; dense DDP's lr tuned on seed 0)",
                       passes_range(r["summary"]["passes"] for seeds in runs.values() for r in seeds),
                       machine()) + lines
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
