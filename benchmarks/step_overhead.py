"""What a method adds to a whole training step when its codec shares the core with backward: the
Fashion-MNIST CNN under DDP at world size 1 (gloo), each method's step against DDP without a hook in
the same process, in alternating blocks of steps (drift of a shared machine hits all of them alike),
and each method's exchange of the same buckets alone, in a loop.

    taskset -c 0 python benchmarks/step_overhead.py [--methods topk,fp16:residual,fp16] [--blocks 8]

Pin it to one core (``taskset -c 0``), as a worker of a 2-worker run on a 2-core machine has one:
otherwise gradzip's thread compresses on the other core and its cost hides.  ``method:feedback``
picks an error-feedback scheme (``fp16:residual`` sends fp16 through gradzip's thread; ``fp16``
without feedback goes to DDP's own allreduce); ``@bucket`` takes the bucket route (``topk@bucket``,
``fp16:residual@bucket``), the CUDA default, on this CPU.  Prints, per method, the median block's ms per step,
its excess over DDP's, and the median ms of one exchange of the same buckets' local gradients
alone (gradzip's own state, world size 1, each gradient copied in first); the difference is what
running on gradzip's thread, interleaved with backward, costs.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.harness.data import load_dataset
from gradzip.harness.models import build_model
from gradzip.launcher import free_port


def _spec(method: str) -> tuple[str, dict]:
    method, _, route = method.partition("@")
    name, _, feedback = method.partition(":")
    return name, {**({"feedback": feedback} if feedback else {}), **({"bucketed": True} if route == "bucket" else {})}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="topk,fp16:residual,fp16")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30, help="steps per block")
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    _, info = load_dataset("fashion-mnist", train=False)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    variants = ["ddp"] + args.methods.split(",")
    runs, buckets = {}, {}
    for variant in variants:
        torch.manual_seed(0)
        net = nn.parallel.DistributedDataParallel(build_model("cnn", info))
        if variant != "ddp":
            name, params = _spec(variant)
            gradzip.register(net, name, **params)
            # DDP's two buckets after its rebuild (fc, conv), to time the same exchanges alone below.
            buckets[variant] = [[(n, p) for n, p in net.module.named_parameters() if n.startswith("fc")],
                                [(n, p) for n, p in net.module.named_parameters() if n.startswith("conv")]]
        runs[variant] = (net, torch.optim.SGD(net.parameters(), lr=0.01))

    def step(net, opt):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()

    for net, opt in runs.values():  # DDP's bucket rebuild, auto's and compile warm-ups
        for _ in range(20):
            step(net, opt)
    times = {v: [] for v in variants}
    for _ in range(args.blocks):
        for variant, (net, opt) in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step(net, opt)
            times[variant].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["ddp"])
    print(f"world size 1, one thread, Fashion-MNIST CNN, batch 32; median of {args.blocks} blocks of {args.steps} steps")
    print(f"{'variant':16s} {'ms/step':>8s} {'over DDP':>9s} {'exchange alone':>15s}")
    for variant in variants:
        ms = 1e3 * statistics.median(times[variant])
        alone = ""
        if variant != "ddp":
            name, params = _spec(variant)
            state = gradzip.GradzipState(name, **params)
            net, opt = runs[variant]
            opt.zero_grad()  # a local gradient (the module without DDP), not the last step's aggregate
            nn.functional.cross_entropy(net.module(x), y).backward()
            grads = [[(n, p.grad.detach().clone()) for n, p in bucket] for bucket in buckets[variant]]
            outs = [[torch.empty_like(g) for _, g in bucket] for bucket in grads]
            laps = []
            for i in range(220):
                start = time.perf_counter()
                for bucket, out in zip(grads, outs):
                    for o, (_, g) in zip(out, bucket):
                        o.copy_(g)
                    state.exchange(list(zip((n for n, _ in bucket), out)), out=out)
                if i >= 20:
                    laps.append(time.perf_counter() - start)
            alone = f"{1e3 * statistics.median(laps):13.2f} ms"
        print(f"{variant:16s} {ms:8.2f} {ms - 1e3 * base:+8.2f} {alone:>15s}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
