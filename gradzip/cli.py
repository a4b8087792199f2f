"""The ``gradzip`` command line (typer)."""
from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import List, Optional

import typer

import gradzip
from gradzip.compressors import parse_value

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="gradzip: gradient compression for data-parallel PyTorch training.")


def parse_params(items: List[str]) -> dict:
    """``["ratio=0.01", "nesterov=true", "value_dtype=float16"]`` -> typed dict."""
    params = {}
    for item in items:
        if "=" not in item:
            raise typer.BadParameter(f"{item!r} is not KEY=VALUE (e.g. --param ratio=0.01)")
        key, raw = item.split("=", 1)
        params[key.strip()] = parse_value(raw)
    return params


@app.command()
def methods():
    """List the compression methods: what each does, and its parameters with their defaults."""
    typer.echo(format_methods())


def format_methods(width: int = 80) -> str:
    """Each method's name and one-line description, aligned, with its parameters wrapped beneath."""
    import textwrap

    from .compressors import summary

    names = gradzip.compressors()
    indent = " " * (max(map(len, names)) + 2)
    lines = []
    for name in names:
        lines.append(f"{name:{len(indent)}s}{summary(name)}")
        params = ", ".join(f"{k}={v!r}" for k, v in gradzip.parameters_of(name).items())
        lines += textwrap.wrap(params, width, initial_indent=indent, subsequent_indent=indent + "  ",
                               break_on_hyphens=False)
    return "\n".join(lines)


# TrainConfig fields `gradzip train` does not expose: every other field is an option of the same name and
# default (tests/test_cli_config.py checks both), so a new field is one more option in train() below.
TRAIN_FIELDS_NOT_OPTIONS = {
    # PyTorch's reference DDP hooks instead of gradzip: `gradzip bench e2e` compares against them
    "baseline",
    # a tuple (no plain typer type); the synthetic data's (C, H, W) is set from Python or a sweep's [base]
    "synthetic_shape",
    # hang guards for unattended runs: `gradzip bench e2e`, sweeps ([base]) and Python scripts set them; an
    # interactive `gradzip train` is stopped with Ctrl-C
    "timeout_s",
    "stall_s",
}


@app.command()
def train(
    model: str = typer.Option("cnn", help="cnn | mlp | resnet20 | lstm | gpt"),
    dataset: str = typer.Option("fashion-mnist",
                                help="fashion-mnist | mnist | digits | cifar10 | text | chars | corpus | synthetic"),
    data_dir: Optional[str] = typer.Option(None, help="directory with the dataset's files"),
    compressor: str = typer.Option("none", "--compressor", "-c", help="see `gradzip methods`"),
    param: List[str] = typer.Option([], "--param", "-p", help="compressor parameter KEY=VALUE (repeatable)"),
    integration: str = typer.Option("ddp", help="ddp (comm hook) | optimizer (DistributedOptimizer)"),
    group_vectors_below: int = typer.Option(0, help="compress each bucket's 1-D and 0-d gradients under N "
                                            "elements as one tensor (biases, norms; 0: each alone)"),
    outer: Optional[str] = typer.Option(None, help='DiLoCo outer loop instead of DDP, e.g. "diloco:sync_every=50,'
                                        'fragments=4" (also outer_lr, outer_momentum, nesterov); -c compresses '
                                        'the pseudo-gradient'),
    workers: int = typer.Option(2, "--workers", "-n", help="local worker processes (ignored under torchrun)"),
    epochs: int = 1,
    batch_size: int = typer.Option(32, help="per worker"),
    optimizer: str = typer.Option("sgd", help="sgd | adamw (betas 0.9, 0.999)"),
    lr: float = 0.01,
    momentum: float = typer.Option(0.9, help="SGD's momentum (DGC applies it itself)"),
    weight_decay: float = 0.0,
    lr_warmup_epochs: float = 0.0,
    clip: Optional[float] = typer.Option(None, help="clip the averaged gradient's global norm"),
    seed: int = 0,
    target: Optional[float] = typer.Option(None, help="test accuracy (perplexity for lstm, gpt) to time"),
    train_size: Optional[int] = typer.Option(None, help="use only the first N training samples"),
    test_size: Optional[int] = None,
    validation: float = typer.Option(0.0, help="hold out this fraction of train for evaluation"),
    max_steps: Optional[int] = typer.Option(None, help="cap on steps per epoch"),
    seq_len: int = typer.Option(35, help="tokens per sample (text, chars); the gpt's context"),
    netem: Optional[str] = typer.Option(None, help='emulated link per worker, e.g. "rate=100mbit" (root)'),
    checkpoint_steps: Optional[int] = typer.Option(None, help="also checkpoint every N steps"),
    resume: bool = typer.Option(False, help="continue from runs/<name>/checkpoint-rank*.pt"),
    out_dir: str = "runs",
    name: Optional[str] = None,
    progress: bool = True,
):
    """Train a model with N local workers (or under torchrun) and any compressor."""
    options = dict(locals())  # first: each option is named as its TrainConfig field (--param fills params)
    from .harness.trainer import TrainConfig, launch

    try:
        options["params"] = parse_params(options.pop("param"))
        config = TrainConfig(**{f.name: options[f.name] for f in dataclasses.fields(TrainConfig)
                                if f.name not in TRAIN_FIELDS_NOT_OPTIONS})
        _check_data(config)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    try:
        summary = launch(config)
    except (PermissionError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1)
    if summary is not None:
        typer.echo(json.dumps(summary, indent=2))


DEMO_METHODS = [
    ("none", {}),
    ("fp16", {}),
    ("dgc", {"ratio": 0.01, "warmup_epochs": 0}),
    ("powersgd", {"rank": 2, "dense_steps": 10}),
]


@app.command()
def demo(
    steps: int = typer.Option(300, help="training steps per worker for each method"),
    workers: int = typer.Option(2, "--workers", "-n"),
    out_dir: str = "runs/demo",
):
    """First run: dense vs three compressors on Fashion-MNIST with 2 workers, then a comparison table."""
    from rich.console import Console

    from .harness.trainer import TrainConfig, launch

    console = Console()
    rows = []
    for method, params in DEMO_METHODS:
        config = TrainConfig(compressor=method, params=params, workers=workers, epochs=1, max_steps=steps,
                             lr=0.01, out_dir=out_dir, name=method, progress=True)
        try:
            _check_data(config)
        except FileNotFoundError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        console.print(f"[bold]{method}[/bold] {params or ''}")
        rows.append((method, params, launch(config)))
    for table in demo_tables(rows, workers, steps):
        console.print(table)
    console.print("Parameters: " + "; ".join(f"{m} {p}" for m, p, _ in rows if p) + ". Times are means per step "
                  "in ms; compress/communicate/decompress run on gradzip's thread and overlap backward ('none' "
                  "takes DDP's own allreduce instead, timed only within the step).")
    console.print("Compression pays only when the link, not the processor, is the bottleneck; on a fast local "
                  "link expect no speedup. Runs and metrics are in " + out_dir)


def demo_tables(rows: list, workers: int, steps: int) -> list:
    """The demo's results as two rich tables, each narrow enough for an 80-column terminal: what each
    method reached and sent, and where its step time went.  ``rows``: (method, params, run summary)."""
    from rich.table import Table

    results = Table(title=f"Fashion-MNIST CNN, {workers} workers, {steps} steps each (this machine's loopback link)")
    times = Table(title="Time per step, ms")
    for table, columns in ((results, ("method", "test acc", "ratio", "bits/element", "MB sent/worker", "step ms")),
                           (times, ("method", "step", "compute", "compress", "communicate", "decompress"))):
        for column in columns:
            table.add_column(column, justify="left" if column == "method" else "right", no_wrap=True)
    for method, params, s in rows:
        results.add_row(method, f"{s['final_test_accuracy']:.4f}", f"{s['mean_ratio']:.1f}x",
                        f"{s['mean_bits_per_element']:.2f}", f"{s['total_bytes_sent'] / 2**20:.1f}",
                        f"{1000 * s['mean_step_s']:.1f}")
        times.add_row(method, *(f"{1000 * s[f'mean_{k}_s']:.1f}" for k in ("step", "compute", "compress",
                                                                             "communicate", "decompress")))
    return [results, times]


def _check_data(config) -> None:
    """Fail in the launcher, with the loader's or the model's one-line message, before any worker starts."""
    from .harness import build_model, load_dataset

    _, info = load_dataset(config.dataset, data_dir=config.data_dir, train=False, seq_len=config.seq_len,
                           synthetic_shape=config.synthetic_shape)
    net = build_model(config.model, info)  # an unknown model, or one for the other task
    if config.outer is not None:
        from .harness.trainer import parse_outer

        tensors = sum(p.requires_grad for p in net.parameters())
        fragments = parse_outer(config.outer).get("fragments", 1)
        if fragments > tensors:
            raise ValueError(f"outer option fragments must be at most {tensors}, the number of {config.model}'s "
                             f"parameter tensors, got {fragments}")


@app.command()
def sweep(
    config: Path = typer.Argument(..., help="the sweep's TOML file (see configs/)"),
    out_dir: Optional[str] = typer.Option(None, help="overrides the file's out_dir"),
    name: Optional[str] = typer.Option(None, help="overrides the file's name (default: the file's stem)"),
    dry_run: bool = typer.Option(False, "--dry-run", help="list the planned runs and exit"),
    report: bool = typer.Option(True, help="render results.md, results.csv and plots at the end"),
):
    """Run a grid of trainings from a TOML file; rerunning continues where a killed sweep stopped."""
    from .harness.sweep import load_sweep, main_runs, run_sweep, tuning_runs

    try:
        plan = load_sweep(config, out_dir=out_dir, name=name)
        tuning, runs = tuning_runs(plan), main_runs(plan)
        for run in {(r.config.dataset, r.config.data_dir): r for r in tuning + runs}.values():
            _check_data(run.config)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    if dry_run:
        def method(c):
            return f"{c.compressor} {c.params}" + (f" outer={c.outer}" if c.outer else "")

        for run in tuning:
            typer.echo(f"tune {run.name}: {method(run.config)} lr={run.config.lr:g} "
                       f"validation={run.config.validation:g}")
        for run in {r.name: r for r in runs}.values():
            lr = "tuned" if run.tuned else f"{run.config.lr:g}"
            typer.echo(f"run  {run.name}: {method(run.config)} lr={lr}")
        typer.echo(f"{len(tuning)} tuning runs and {len({r.name for r in runs})} runs in {plan.directory} (a tuned "
                   f"run whose lr turns out to be the untuned one's shares that run)")
        return
    try:
        counts = run_sweep(plan, log=typer.echo, report=report)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo(f"{counts['ran']} runs ran, {counts['skipped']} were finished before"
               + (f"; results in {plan.directory}/results.md" if report else ""))
    if counts["failed"]:
        typer.echo(f"{len(counts['failed'])} runs failed (rerun the sweep to retry them): "
                   + ", ".join(counts["failed"]), err=True)
        raise typer.Exit(1)


@app.command()
def report(directory: Path = typer.Argument(..., help="a sweep's directory, or any directory of runs")):
    """Re-render a sweep's results.md, results.csv and plots from its finished runs."""
    from .harness.report import render

    try:
        paths = render(directory)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
    typer.echo("wrote " + ", ".join(str(p) for p in paths))


from .bench.cli import bench_app  # noqa: E402

app.add_typer(bench_app, name="bench", help="Benchmarks: kernels (compression cost), e2e (training speed).")


@bench_app.command("e2e")
def bench_e2e(
    links: List[str] = typer.Option(["rate=100mbit", "rate=1gbit", "rate=10gbit", "unthrottled"], "--link"),
    workers: int = typer.Option(4, "--workers", "-n"),
    steps: int = typer.Option(300, help="training steps per contender (one 'epoch')"),
    lr: float = typer.Option(0.05, help="SGD learning rate (momentum 0.9)"),
    test_size: Optional[int] = typer.Option(None, help="test images to evaluate on (default: all 10,000)"),
    only: Optional[str] = typer.Option(None, help="comma-separated contender labels to run (default: all)"),
    out: Optional[str] = typer.Option(None, help="also write the Markdown table here"),
    out_dir: str = "runs/bench-e2e",
    repeats: int = typer.Option(1, min=1, help="run all contenders this many times in turn per link; the table "
                                               "gives medians, and each ratio's median and range over repeats"),
):
    """Epoch time, step time and accuracy of dense, PyTorch's hooks, the no-communication limit and
    gradzip's methods, alone and in DiLoCo's outer loop, on emulated links (needs root for --link rate=...)."""
    from .bench import e2e

    contenders = e2e.CONTENDERS
    if only:
        wanted = [w.strip() for w in only.split(",") if w.strip()]
        labels = [c[0] for c in contenders]
        unknown = [w for w in wanted if w not in labels]
        if unknown:
            typer.echo(f"error: unknown contender(s) {', '.join(map(repr, unknown))}; valid: {', '.join(labels)}", err=True)
            raise typer.Exit(2)
        contenders = [c for c in contenders if c[0] in wanted]
    results = e2e.run(links=links, workers=workers, steps=steps, lr=lr, out_dir=out_dir, contenders=contenders,
                      test_size=test_size, repeats=repeats, log=typer.echo)
    e2e.save(results, f"{out_dir}/results.json")
    command = (["gradzip", "bench", "e2e", "-n", str(workers), "--steps", str(steps), "--lr", f"{lr:g}"]
               + [arg for link in links for arg in ("--link", link)] + (["--only", only] if only else [])
               + (["--test-size", str(test_size)] if test_size else []) + ["--repeats", str(repeats)])
    text = e2e.table(results, steps, workers, command=shlex.join(command))
    typer.echo(text)
    if out:
        Path(out).write_text(text)
        e2e.plot(results, str(Path(out).with_suffix(".png")), workers)


@app.command()
def advise(
    model: str = typer.Option("cnn", help="cnn | mlp | resnet20 | lstm | gpt, or your own: package.module:factory, "
                                          "a function returning the model, (model, batch) or (model, batch, loss_fn)"),
    batch: Optional[str] = typer.Option(None, help="with your own model: package.module:function returning one "
                                                   "input batch (if the factory returns the model alone)"),
    loss: Optional[str] = typer.Option(None, help="with your own model: package.module:function(model, batch) -> "
                                                  "scalar loss (default: inferred from the batch, see docs)"),
    dataset: Optional[str] = typer.Option(None, help="a built-in model's dataset (default fashion-mnist)"),
    data_dir: Optional[str] = None,
    netem: Optional[str] = typer.Option(None, help='measure on an emulated link, e.g. "rate=1gbit" (root)'),
    bandwidth: Optional[str] = typer.Option(None, help='use this bandwidth instead of measuring, e.g. "1gbit"'),
    alpha_us: Optional[float] = typer.Option(None, help="per-message latency in microseconds (with --bandwidth)"),
    workers: Optional[int] = typer.Option(None, "--workers", "-n",
                                          help="number of workers to project for (default: the torchrun job's size, else 2)"),
    method: List[str] = typer.Option([], "--method", "-m", help='e.g. "topk:ratio=0.01" (repeatable)'),
    outer: List[str] = typer.Option([], help='also each method in DiLoCo\'s outer loop, e.g. "diloco:sync_every=50" '
                                         '(repeatable)'),
    batch_size: Optional[int] = typer.Option(None, help="a built-in model's batch size (default 32)"),
    overlap: Optional[float] = typer.Option(None, help="fraction of communication hidden (default: DDP's bucket timeline)"),
):
    """Measure compute, link and each method's overhead; rank methods by projected step time.

    Under torchrun (`torchrun --nnodes ... -m gradzip advise`) it measures the real links between the
    job's ranks; rank 0 prints the table."""
    from .advise import advise as run_advise, user_model
    from .compressors.registry import did_you_mean
    from .harness.models import MODELS

    try:
        if ":" in model:
            if dataset is not None or batch_size is not None or data_dir is not None:
                raise ValueError("--dataset, --data-dir and --batch-size are for the built-in models; your factory "
                                 "or --batch gives the batch")
            net, data, loss_fn = user_model(model, batch, loss)
        elif batch is not None or loss is not None:
            raise ValueError("--batch and --loss go with your own model (--model package.module:factory)")
        elif model not in MODELS:
            raise ValueError(f"unknown model {model!r}{did_you_mean(model, MODELS)}; valid names: {', '.join(MODELS)}, "
                             "or your own as package.module:factory")
        else:
            net, data, loss_fn = model, dataset, None
        run_advise(net, data, loss_fn=loss_fn, netem=netem, bandwidth=bandwidth,
                   alpha=None if alpha_us is None else alpha_us * 1e-6, workers=workers, methods=method or None,
                   outer=outer, batch_size=batch_size, overlap=overlap, data_dir=data_dir, echo=typer.echo)
    except (ValueError, PermissionError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


def main():
    app()


if __name__ == "__main__":
    main()
