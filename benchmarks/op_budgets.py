"""Operations and host reads of every method's exchange per DDP bucket, on both routes, on CPU.

The numbers behind the budgets of tests/test_budgets.py, for each method on the per-tensor route
(``bucketed=False``, the CPU default) and on the bucket route (``bucketed=True``, the CUDA default): a
one-process gloo group, the harness's GPT (width 32) at 2 and 8 blocks in one DDP bucket, two warm-up
steps, then one step counted by :func:`gradzip.testing.count_exchanges` (every aten operation dispatched
inside the exchange, and the host reads among them: what would wait for a GPU).

    python benchmarks/op_budgets.py [--methods topk,qsgd,fp16:feedback=residual]  # one parameter each
    python benchmarks/op_budgets.py --gpt 1024x8 --routes bucket   # per bucket of the GPU bench's model

``--ahead`` counts the bucket route as a GPU runs it once its kernels are compiled ahead (a GPU's form
of ``devices.runs_kernels_ahead``, the packages waited for before the counted step: a compile, tens of seconds, for each one the cache lacks; a kernel counts as
one operation).

``--gpt WIDTHxDEPTH`` instead counts one step of ``gradzip bench step``'s GPT (context 256, vocabulary
8192, 16 heads) in DDP's 25 MB buckets, as the GPU table's launches are counted: launching operations
per bucket (mean and largest over the step's buckets).

Prints, per method and route: operations per step at each depth, operations added per parameter tensor,
host reads per step at each depth, and at depth 2 the operations that would launch a kernel on a GPU
(not views, aliases or bare allocations: a proxy for the GPU issue's "launches per bucket at most DDP's
plus 40"; a few operations launch more than one kernel).  Counts are exact, not timings: the machine's load does not
change them (data-dependent methods vary by a few operations from step to step).
"""
from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradzip
from gradzip import devices, kernels
from gradzip.bench.kernels import BENCH_PARAMS
from gradzip.compressors.registry import parse_spec
from gradzip.harness.data import DatasetInfo
from gradzip.harness.models import GPT
from gradzip.testing import count_exchanges, launching_ops as launching

INFO = DatasetInfo("budget", (16,), 64, "language_model")
DEPTHS = (2, 8)
AHEAD = False  # --ahead
#: auto settles on Top-k at once: its own exchange, not its trials, is counted.
PARAMS = {**BENCH_PARAMS, "auto": {"candidates": "topk:ratio=0.01", "warmup": 0, "trials": 1, "verify": 0}}


def count(method: str, depth: int, bucketed: bool, width: int = 32, info: DatasetInfo = INFO,
          heads: int = 4, bucket_cap_mb: float = 1024, batch: int = 4):
    """(parameter tensors, operations, host reads, kernel-launching operations, the counts) of one
    step's exchanges."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(info, layers=depth, width=width, heads=heads)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    name, given = parse_spec(method)  # "fp16:feedback=residual": a method with parameters
    state = gradzip.register(ddp, name, bucketed=bucketed, **{**PARAMS.get(name, {}), **given})
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(depth)

    def step():
        x = torch.randint(0, info.num_classes, (batch, info.input_shape[0] + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x[:, :-1]).reshape(-1, info.num_classes), x[:, 1:].reshape(-1)).backward()
        opt.step()

    try:
        for _ in range(4 if method == "auto" else 2):  # auto: explore, decide, then its choice's route
            step()
        for _ in range(2):  # a kernel queued at a step runs at the next (a residual's: from the second)
            if AHEAD:
                kernels.settle()
                step()
        with count_exchanges(state) as counts:
            step()
        return len(list(model.parameters())), counts.ops, counts.host_reads, launching(counts.by_op()), counts
    finally:
        state.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(gradzip.compressors()))
    parser.add_argument("--routes", default="tensor,bucket", help="tensor, bucket or both (default)")
    parser.add_argument("--gpt", default=None, metavar="WIDTHxDEPTH",
                        help="count per DDP bucket of bench step's GPT of this width and depth instead")
    parser.add_argument("--ahead", action="store_true", help="with the bucket route's kernels compiled ahead")
    args = parser.parse_args()
    if args.ahead:
        global AHEAD
        AHEAD = True
        devices.runs_kernels_ahead = lambda where: True
    routes = [route == "bucket" for route in args.routes.split(",")]
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        if args.gpt:
            per_bucket(args.methods.split(","), routes, *(int(v) for v in args.gpt.split("x")))
            return
        print("| method | route | ops/step d2 | ops/step d8 | ops/tensor | host reads d2 / d8 | launching ops d2 |")
        print("|---|---|---|---|---|---|---|")
        for method in args.methods.split(","):
            for bucketed in routes:
                (t2, ops2, reads2, launch2, _), (t8, ops8, reads8, _, _) = (count(method, d, bucketed) for d in DEPTHS)
                route = "bucket" if bucketed else "per tensor"
                print(f"| {method} | {route} | {ops2} | {ops8} | {(ops8 - ops2) / (t8 - t2):.1f} | {reads2} / {reads8} "
                      f"| {launch2} |", flush=True)
    finally:
        dist.destroy_process_group()


def per_bucket(methods, routes, width: int, depth: int) -> None:
    """The table of ``--gpt``: per method and route, the step's buckets and launching operations per bucket."""
    info = DatasetInfo("bench-step", (256,), 8192, "language_model")
    print(f"GPT width {width}, depth {depth}, 16 heads, context 256, vocabulary 8192, 25 MB buckets")
    print("| method | route | buckets | launching ops per bucket (mean) | largest | host reads per bucket |")
    print("|---|---|---|---|---|---|")
    for method in methods:
        for bucketed in routes:
            *_, counts = count(method, depth, bucketed, width=width, info=info, heads=16, bucket_cap_mb=25, batch=1)
            per = [launching(call.ops) for call in counts.calls] or [0]
            reads = counts.host_reads / max(1, len(counts.calls))
            print(f"| {method} | {'bucket' if bucketed else 'per tensor'} | {len(counts.calls)} | {sum(per) / len(per):.0f} "
                  f"| {max(per)} | {reads:g} |", flush=True)


if __name__ == "__main__":
    main()
