"""``gradzip bench ...``: the benchmark commands (a typer sub-app mounted by gradzip/cli.py)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Benchmarks of gradzip's own code.")


@bench_app.callback()
def _group():
    """Benchmarks of gradzip's own code."""


@bench_app.command()
def kernels(
    device: str = typer.Option("cpu", help="cpu | cuda"),
    repeat: int = typer.Option(5, help="rounds; every number is a median over them"),
    methods: Optional[str] = typer.Option(None, help="comma-separated method names (default: all registered)"),
    workloads: str = typer.Option("flat,resnet50", help="comma-separated: flat (one 25M tensor) | resnet50"),
    numel: int = typer.Option(25_000_000, help="elements of the flat workload's tensor (and of the DGC test)"),
    profile: bool = typer.Option(False, help="also list the top operators per method (torch.profiler)"),
    alone: bool = typer.Option(True, help="also time each compressor without feedback and state"),
    selection: bool = typer.Option(True, help="also time DGC's sampled selection against exact top-k"),
    clock: str = typer.Option("wall", help="wall | cpu (process CPU time on one thread: steadier on a shared machine)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write the results as JSON to this file"),
):
    """Time compress + decompress + error feedback of every method against one memory pass."""
    from .kernels import main

    names = [m.strip() for m in methods.split(",") if m.strip()] if methods else None
    kinds = [w.strip() for w in workloads.split(",") if w.strip()]
    try:
        main(names, device=device, repeat=repeat, workloads=kinds, numel=numel, profile=profile, alone=alone,
             selection=selection, clock=clock, json_out=str(json_out) if json_out else None, echo=typer.echo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)


@bench_app.command()
def step(
    device: Optional[str] = typer.Option(None, help="cuda | cpu (default: cuda where there is one)"),
    model: str = typer.Option("gpt", help="gpt (the harness's GPT on random tokens)"),
    width: Optional[int] = typer.Option(None, help="GPT width (default 1024 on cuda, 128 on cpu)"),
    depth: Optional[int] = typer.Option(None, help="GPT layers (default 8 on cuda, 2 on cpu)"),
    context: Optional[int] = typer.Option(None, help="tokens per sequence (default 256 on cuda, 64 on cpu)"),
    batch: Optional[int] = typer.Option(None, help="sequences per step and rank (default 16 on cuda, 4 on cpu)"),
    vocab: Optional[int] = typer.Option(None, help="vocabulary size (default 8192 on cuda, 256 on cpu)"),
    steps: Optional[int] = typer.Option(None, help="timed steps (default 20 on cuda, 5 on cpu)"),
    warmup: Optional[int] = typer.Option(None, help="untimed steps after the first (default 3 on cuda, 1 on cpu)"),
    bucket_mb: float = typer.Option(25.0, help="DDP's bucket_cap_mb"),
    amp: Optional[str] = typer.Option(None, help="bf16 | none (default bf16 on cuda, none on cpu)"),
    profile_steps: int = typer.Option(2, help="steps under torch.profiler for the per-step counts"),
    methods: Optional[str] = typer.Option(None, help="comma-separated: ddp, torch-allreduce, torch-fp16, torch-bf16, "
                                                     "torch-powersgd and gradzip methods, each optionally "
                                                     "NAME:KEY=VALUE,... (default: all)"),
    seed: int = 0,
    repeats: int = typer.Option(1, help="run the whole contender list this many times in turn; medians, spread"),
    isolate: Optional[bool] = typer.Option(None, "--isolate/--no-isolate",
                                           help="each contender in a fresh Python process (default: at world "
                                                "size 1; under torchrun all run in the ranks' processes)"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="write every number and the environment here"),
    memory_snapshot: Optional[Path] = typer.Option(None, help="CUDA: write each contender's allocator history "
                                                             "here (NAME.pickle), for benchmarks/memory_peak.py"),
):
    """ms per DDP training step, x DDP, first step, peak memory, kernel launches and host syncs of DDP,
    PyTorch's hooks and every gradzip method (under torchrun: every rank runs, rank 0 prints)."""
    from .step import main, split_methods

    if model != "gpt":
        typer.echo(f"error: --model must be 'gpt', got {model!r}", err=True)
        raise typer.Exit(2)
    names = split_methods(methods) if methods else None
    try:
        main(names, device=device, width=width, depth=depth, context=context, batch=batch, vocab=vocab, steps=steps,
             warmup=warmup, amp=amp, bucket_mb=bucket_mb, profile_steps=profile_steps, seed=seed,
             repeats=repeats, isolate=isolate, memory_snapshot=str(memory_snapshot) if memory_snapshot else None,
             json_out=str(json_out) if json_out else None, echo=typer.echo)
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2)
