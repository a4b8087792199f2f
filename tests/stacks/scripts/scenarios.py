"""Test plumbing shared by the multi-run scripts here (not part of what a user writes).

A launch reads a plan (a JSON list of runs, each a dict with at least ``name``) and calls the script's
training function once per run, in order, on every rank.  For each run every rank writes, under
``OUT/<name>/``:

- ``rank<r>.started``  before the run begins (so a launch that dies tells which run it died in);
- ``rank<r>.pt``       the final ``state_dict()`` of the trained model (only if the run returned);
- ``rank<r>.json``     losses, gradzip's stats, anything else the run reports, and ``error``: the
                       traceback if the run raised (the launch then goes on with the next run).

A run that takes longer than its ``deadline`` (seconds) is taken for a hang: ``faulthandler`` prints
every thread's stack to stderr and ends the process, and the test relaunches the runs after it.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import math
import os
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist


def main(doc: str, train) -> None:
    """Parse ``--plan/--out/--device``, join the process group, run the plan, leave the group."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--plan", required=True, help="JSON file: the list of runs")
    parser.add_argument("--out", required=True, help="folder for the results")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    run_plan(args.plan, args.out, lambda **run: train(device=device, **run))
    dist.destroy_process_group()


@contextlib.contextmanager
def kernels_from(numel: int, on: bool):
    """For the length of a run: gradzip's fused kernels on every tensor of at least ``numel``
    elements (their defaults, 2^20 and 2^24, are far above these scripts' models), or, with ``on``
    false, none at all (``GRADZIP_FUSED=0``).  Yields a dict that counts the kernels' launches by name."""
    from gradzip import kernels

    launches: dict = {}
    run = kernels.Kernel.run

    def counted(self, *args, **static):
        launches[self.__name__] = launches.get(self.__name__, 0) + 1
        return run(self, *args, **static)

    saved = ({k: k.min_numel for k in kernels.KERNELS}, kernels.MIN_NUMEL, kernels.LARGE_NUMEL,
             os.environ.get("GRADZIP_FUSED"))
    kernels.MIN_NUMEL = kernels.LARGE_NUMEL = numel
    for kernel in kernels.KERNELS:
        kernel.min_numel = numel
    os.environ["GRADZIP_FUSED"] = "1" if on else "0"
    kernels.Kernel.run = counted
    try:
        yield launches
    finally:
        kernels.Kernel.run = run
        thresholds, kernels.MIN_NUMEL, kernels.LARGE_NUMEL, switch = saved
        for kernel, numel in thresholds.items():
            kernel.min_numel = numel
        if switch is None:
            os.environ.pop("GRADZIP_FUSED", None)
        else:
            os.environ["GRADZIP_FUSED"] = switch


def _plain(value):
    """JSON-safe copy: non-finite floats become strings, tensors lists."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def write_result(folder, rank: int, model, report: dict) -> None:
    """``folder``/rank<r>.pt: the model's state_dict (if a model is given); rank<r>.json: the report."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if model is not None:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, folder / f"rank{rank}.pt")
    (folder / f"rank{rank}.json").write_text(json.dumps(_plain({"error": None, **report})))


def run_plan(plan_path, out, train) -> None:
    """Call ``train(**run)`` for each run of the plan; it returns ``(model, report_dict)``."""
    rank = dist.get_rank()
    for run in json.loads(Path(plan_path).read_text()):
        folder = Path(out) / run["name"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.started").touch()
        faulthandler.dump_traceback_later(run.get("deadline", 90), exit=True)
        start = time.perf_counter()
        model, report = None, {}
        try:
            model, report = train(**run)
        except Exception:  # noqa: BLE001 - reported to the test, which fails this run
            report = {"error": traceback.format_exc()}
        finally:
            faulthandler.cancel_dump_traceback_later()
        write_result(folder, rank, model, {**report, "seconds": time.perf_counter() - start})


@contextlib.contextmanager
def kernels_ahead():
    """For the length of a run: the bucket route's kernels compiled ahead on every bucket, on this CPU as
    on a GPU (where the bucket route takes them), and each one's first call waiting for its package, as if its compile had
    been quick: the exchange that queued it takes the reference path, the next ones the kernel.  Yields
    a dict that counts the kernels' runs by name."""
    from gradzip import devices, kernels

    runs: dict = {}
    ahead, predicate = kernels.Kernel.ahead, devices.runs_kernels_ahead

    def counted(self, *args, **static):
        result = ahead(self, *args, **static)
        if result is None:
            kernels.settle()
        else:
            runs[self.__name__] = runs.get(self.__name__, 0) + 1
        return result

    kernels.Kernel.ahead, devices.runs_kernels_ahead = counted, lambda where: True
    try:
        yield runs
    finally:
        kernels.Kernel.ahead, devices.runs_kernels_ahead = ahead, predicate
