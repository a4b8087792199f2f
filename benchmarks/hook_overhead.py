"""What a Python comm hook costs when every bucket is sent densely: DDP's own (C++) allreduce, bare
Python allreduce hooks, and gradzip's hook with ``none`` and with ``auto`` restricted to dense (after
its decision every bucket takes the plain-allreduce path), in alternating blocks of steps in the same
worker processes, so that drift of a shared machine hits all of them alike.

    python benchmarks/hook_overhead.py --steps 80 --blocks 6

Prints each variant's mean and best block step time and its ratio to DDP's own allreduce.

    python benchmarks/hook_overhead.py --breakdown

instead times each part of gradzip's dense path (the steps of ``gradzip.integrations.ddp.ddp_comm_hook``
when a bucket is sent densely), per bucket, in one process (world size 1), for ``none`` and for auto
after it chose dense.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

VARIANTS = ("ddp allreduce", "python hook", "python hook, divide first", "gradzip none", "gradzip auto (dense)",
            "gradzip auto (after trials)")
# Untimed steps before each block: DDP's bucket rebuild, auto's decision, warm caches.  auto with its
# default candidates explores for 9 steps and may verify a plan for 27 more; whatever it leaves behind
# (its own thread, allocations, a kept plan) then shows in the timed steps.
UNTIMED = {"gradzip auto (after trials)": 40}


def _python_allreduce(_, bucket):
    world = dist.get_world_size()
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(world))


def _python_allreduce_divided(_, bucket):
    fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _worker(rank, world, port, steps, blocks, out):
    import gradzip
    from gradzip.harness.data import load_dataset
    from gradzip.harness.models import build_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, info = load_dataset("fashion-mnist", train=False)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1, 28, 28, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    times = {v: [] for v in VARIANTS}
    chosen = []  # what auto chose in each block: a block that compresses is not the dense steady state
    for _ in range(blocks):
        for variant in VARIANTS:
            torch.manual_seed(0)
            net = nn.parallel.DistributedDataParallel(build_model("cnn", info))
            if variant == "python hook":
                net.register_comm_hook(None, _python_allreduce)
            elif variant == "python hook, divide first":
                net.register_comm_hook(None, _python_allreduce_divided)
            elif variant == "gradzip none":
                gradzip.register(net, "none")
            elif variant == "gradzip auto (dense)":
                gradzip.register(net, "auto", candidates=["none"])
            elif variant == "gradzip auto (after trials)":
                auto_state = gradzip.register(net, "auto")
            opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
            untimed = UNTIMED.get(variant, 10)
            for step in range(steps + untimed):
                if step == untimed:
                    dist.barrier()
                    start = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
            dist.barrier()
            times[variant].append((time.perf_counter() - start) / steps)
            if variant == "gradzip auto (after trials)":
                chosen.append(sorted(set(auto_state.compressor.choices(auto_state.tensors).values())))
    if rank == 0:
        out.put((times, chosen))
    dist.destroy_process_group()


def _breakdown(steps: int = 100) -> None:
    """Median microseconds per bucket of each part of the hook's dense path, in one process."""
    import gradzip
    from gradzip.harness.data import load_dataset
    from gradzip.harness.models import build_model
    from gradzip.integrations import ddp
    from gradzip.launcher import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    _, info = load_dataset("fashion-mnist", train=False)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    for method in ("none", "auto"):
        parts: dict[str, list[float]] = {}

        def timed(label, fn):
            start = time.perf_counter()
            value = fn()
            parts.setdefault(label, []).append(time.perf_counter() - start)
            return value

        def dense_path(state, bucket):  # ddp_comm_hook's dense path, one part at a time
            grads = timed("bucket.gradients()", bucket.gradients)
            named = timed("names", lambda: [(state.param_names[p], g) for p, g in zip(bucket.parameters(), grads)])
            buffer = bucket.buffer()
            assert timed("state.plain_allreduce_dtype()", lambda: state.plain_allreduce_dtype(named)) == buffer.dtype, "not a dense bucket"
            timed("state.record_dense()", lambda: state.record_dense(named))
            timed("divide", lambda: buffer.div_(dist.get_world_size(state.dense_group)))
            fut = timed("allreduce call (world size 1)",
                        lambda: dist.all_reduce(buffer, group=state.dense_group, async_op=True).get_future())
            return timed("future.then()", lambda: fut.then(lambda f: f.value()[0]))

        step = 0
        original = ddp.ddp_comm_hook
        # Timed from step 60: auto has chosen by then, and DDP has rebuilt its buckets.
        ddp.ddp_comm_hook = lambda state, bucket: (dense_path if step >= 60 else original)(state, bucket)
        try:
            torch.manual_seed(0)
            net = nn.parallel.DistributedDataParallel(build_model("cnn", info))
            gradzip.register(net, method)
        finally:
            ddp.ddp_comm_hook = original
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        for step in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        print(f"{method}: median us per bucket:", ", ".join(f"{label} {1e6 * statistics.median(t):.0f}"
                                                            for label, t in parts.items()))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=80, help="timed steps per block")
    parser.add_argument("--blocks", type=int, default=6, help="blocks per variant, alternating")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead, time each part of gradzip's dense path per bucket, in one process")
    args = parser.parse_args()
    if args.breakdown:
        return _breakdown()
    from gradzip.launcher import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(args.workers, free_port(), args.steps, args.blocks, out),
                       nprocs=args.workers, start_method="spawn")
    times, chosen = out.get()
    base = statistics.mean(times[VARIANTS[0]])
    print(f"{args.workers} workers, Fashion-MNIST CNN, batch 32, {args.blocks} blocks of {args.steps} steps")
    print(f"{'variant':28s} {'mean ms':>8s} {'best ms':>8s} {'vs ddp':>7s}")
    for variant, ts in times.items():
        mean = statistics.mean(ts)
        print(f"{variant:28s} {mean * 1e3:8.1f} {min(ts) * 1e3:8.1f} {mean / base:6.3f}x")
    print("auto after its trials chose, per block:", "; ".join(",".join(c) for c in chosen))


if __name__ == "__main__":
    main()
