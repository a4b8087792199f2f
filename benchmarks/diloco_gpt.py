"""DiLoCo's outer loop against per-step training, on the tiny GPT over emulated slow links.

    sudo python3 benchmarks/diloco_gpt.py --out docs/results/diloco_gpt.md     # about 40 minutes on 2 cores

Every run: the harness's GPT (2 blocks, width 128, context 64), character-level on the license texts
Debian ships, 4 workers, each in its own network namespace behind a tbf-shaped link (gradzip.netem),
AdamW at lr 3e-3, 16 sequences per worker per (inner) step, 40 epochs of 25 steps = 1000 steps, test
loss on 256 held-out sequences after every epoch (DiLoCo: of its global parameters theta_g).  Times are
training time (the epochs' ``train_s``: evaluation and checkpoints excluded, but an overlapped exchange
still in flight at an epoch's end is waited for inside it).  A dense
step at 10 Mbit/s takes seconds, so there the per-step contenders that send more than about a tenth of
dense's bytes run ``--slow-steps`` steps only; dense's loss at equal steps is then that of the
100 Mbit/s run: the same computation (the script checks that the losses of the steps both ran agree).

Runs go to ``--out-dir``/<link>/<label>; a finished run (its summary.json exists) is not run again, so an
interrupted benchmark resumes where it stopped.  Needs root (network namespaces).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from gradzip.harness.trainer import TrainConfig, launch

BASE = dict(model="gpt", dataset="chars", seq_len=64, optimizer="adamw", lr=0.003, batch_size=16, max_steps=25,
            test_size=256, workers=4, progress=False, timeout_s=3600.0)
SPARSELOCO = "diloco:sync_every={h},outer_lr=1,outer_momentum=0"

# label -> (TrainConfig fields, sends much every step: fewer steps on slow links)
CONTENDERS = {
    "dense DDP": (dict(compressor="none"), True),
    "no communication (limit)": (dict(baseline="nocomm"), False),
    "bf16 every step": (dict(compressor="bf16"), True),
    "powersgd every step": (dict(compressor="powersgd"), False),
    "diloco H=10 sparseloco": (dict(compressor="sparseloco", outer=SPARSELOCO.format(h=10)), False),
    "diloco H=10 sparseloco overlap": (dict(compressor="sparseloco", outer=SPARSELOCO.format(h=10) + ",overlap=true"),
                                       False),
    "diloco H=10 none": (dict(compressor="none", outer="diloco:sync_every=10,outer_lr=1,outer_momentum=0"), False),
    "diloco H=10 none, paper's outer step": (dict(compressor="none", outer="diloco:sync_every=10"), False),
}
H_SWEEP = (10, 25, 50, 100)  # sparseloco, on the first link only
# Other outer compressors at H=10, on the first link only: bf16, and gradzip's 4-bit quantiser (sign and a
# 3-bit level per element, one fp32 scale per 512); and the dense exchange overlapped with a step.
OUTER_BASELINES = {
    "diloco H=10 bf16": dict(compressor="bf16", outer="diloco:sync_every=10,outer_lr=1,outer_momentum=0"),
    "diloco H=10 none overlap": dict(compressor="none",
                                     outer="diloco:sync_every=10,outer_lr=1,outer_momentum=0,overlap=true"),
    "diloco H=10 qsgd 4-bit": dict(compressor="qsgd", params={"levels": 7, "norm": "max"},
                                   outer="diloco:sync_every=10,outer_lr=1,outer_momentum=0"),
}
LINKS = ("100mbit", "10mbit")


def _runs(link: str, first: bool, slow_steps: int) -> dict:
    runs = {}
    for label, (fields, heavy) in CONTENDERS.items():
        epochs = 40
        if heavy and link != LINKS[0]:
            epochs = max(1, slow_steps // BASE["max_steps"])
        runs[label] = dict(fields, epochs=epochs, netem=f"rate={link}")
    if first:
        for h in H_SWEEP:
            runs.setdefault(f"diloco H={h} sparseloco", dict(compressor="sparseloco", outer=SPARSELOCO.format(h=h),
                                                             epochs=40, netem=f"rate={link}"))
        for label, fields in OUTER_BASELINES.items():
            runs[label] = dict(fields, epochs=40, netem=f"rate={link}")
        runs["one worker alone"] = dict(compressor="none", workers=1, epochs=40)
    return runs


def _run(out_dir: Path, label: str, fields: dict) -> dict:
    name = label.replace(" ", "_").replace(",", "").replace("'", "").replace("=", "")
    directory = out_dir / name
    if not (directory / "summary.json").exists():
        print(f"run {out_dir.name}/{name}", flush=True)
        launch(TrainConfig(**{**BASE, **fields}, out_dir=str(out_dir), name=name))
    records = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]
    return {"label": label, "epochs": [r for r in records if r["kind"] == "epoch"],
            "steps": [r for r in records if r["kind"] == "step"],
            "summary": json.loads((directory / "summary.json").read_text())}


def _loss_at_time(run: dict, seconds: float):
    """Test loss after the last epoch whose training time (evaluation excluded) ended within ``seconds``."""
    t, loss = 0.0, None
    for epoch in run["epochs"]:
        t += epoch["train_s"]
        if t > seconds * 1.0001:
            break
        loss = epoch["test_loss"]
    return loss


def _step_ms(run: dict) -> float:
    return 1e3 * sum(e["train_s"] for e in run["epochs"]) / run["epochs"][-1]["step"]


def _kib_per_step(run: dict) -> float:
    # The summary's total: an overlapped exchange finishes after its step's record was written.
    return run["summary"]["total_bytes_sent"] / run["summary"]["steps"] / 1024


def _fmt(value, spec=".3f") -> str:
    return "—" if value is None else format(value, spec)


def _table(link: str, runs: dict, dense_losses: dict, alone: dict) -> list:
    dense, limit = runs["dense DDP"], runs["no communication (limit)"]
    main = runs["diloco H=10 sparseloco"]
    horizon = sum(e["train_s"] for e in main["epochs"])
    dense_kib, limit_ms = _kib_per_step(dense), _step_ms(limit)
    lines = [f"### {link[:-4]} Mbit/s", "",
             f"Equal wall-clock: {horizon:.0f} s of training (evaluation excluded), the time `diloco H=10 "
             f"sparseloco` took for its 1000 steps. Dense DDP: {_step_ms(dense):.0f} ms per step; the "
             f"no-communication limit: {limit_ms:.1f} ms.", "",
             "| contender | steps run | test loss @1000 steps | test loss @ equal wall-clock | ms per inner step "
             "| × no-comm limit | KiB sent per inner step per worker | × fewer bytes than dense |",
             "|---|---|---|---|---|---|---|---|"]
    for label, run in runs.items():
        steps = run["epochs"][-1]["step"]
        at_1000 = run["epochs"][-1]["test_loss"] if steps >= 1000 else None
        if label == "dense DDP" and at_1000 is None:
            at_1000 = dense_losses.get(1000)
            label += " (loss @1000: the 100 Mbit/s run)"
        kib = _kib_per_step(run)
        fewer = f"{dense_kib / kib:.0f}" if kib > 0 else "∞"
        lines.append(f"| {label} | {steps} | {_fmt(at_1000)} | {_fmt(_loss_at_time(run, horizon))} | "
                     f"{_step_ms(run):.1f} | {_step_ms(run) / limit_ms:.2f} | {kib:.1f} | {fewer} |")
    lines.append(f"| one worker alone (no link; 16 sequences per step) | 1000 | {alone['epochs'][-1]['test_loss']:.3f} "
                 f"| — | {_step_ms(alone):.1f} | — | 0 | — |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the Markdown tables here too")
    parser.add_argument("--out-dir", default="runs/bench-diloco-gpt")
    parser.add_argument("--slow-steps", type=int, default=100,
                        help="steps of the per-step contenders that send much, on links after the first")
    args = parser.parse_args()
    results = {}
    for i, link in enumerate(LINKS):
        results[link] = {label: _run(Path(args.out_dir) / link, label, fields)
                         for label, fields in _runs(link, i == 0, args.slow_steps).items()}
    first = results[LINKS[0]]
    alone = first.pop("one worker alone")
    dense_losses = {e["step"]: e["test_loss"] for e in first["dense DDP"]["epochs"]}
    lines = []
    for link in LINKS:
        runs = {k: v for k, v in results[link].items() if k in CONTENDERS or k in OUTER_BASELINES}
        slow_dense = {e["step"]: e["test_loss"] for e in runs["dense DDP"]["epochs"]}
        differ = {s: (loss, dense_losses[s]) for s, loss in slow_dense.items() if loss != dense_losses.get(s)}
        if differ:
            print(f"warning: dense at {link} and at {LINKS[0]} differ at equal steps: {differ}")
        lines += _table(link, runs, dense_losses, alone) + [""]
    lines += ["### Test loss against H (sparseloco, outer lr 1, no outer momentum; 100 Mbit/s)", "",
              "| H | test loss @1000 steps | KiB sent per inner step per worker | ms per inner step |", "|---|---|---|---|"]
    for h in H_SWEEP:
        run = first[f"diloco H={h} sparseloco"]
        lines.append(f"| {h} | {run['epochs'][-1]['test_loss']:.3f} | {_kib_per_step(run):.2f} | {_step_ms(run):.1f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
