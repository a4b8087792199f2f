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
