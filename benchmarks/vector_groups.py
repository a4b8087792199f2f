"""Training step time of a GPT under DDP + gradzip, with its biases and norms' weights exchanged each on
its own and as groups (``gradzip.register(..., group_vectors_below=...)``), measured in the same run.

    python benchmarks/vector_groups.py [--methods topk,qsgd,efsignsgd,onebit] [--layers 6] [--width 256]
                                       [--steps 60] [--repeats 3]

Each launch is ``torchrun --nproc_per_node 2`` of this file (one thread per worker, gloo, loopback): the
harness's GPT (``--layers`` blocks of ``--width``; 8 vectors and 4 matrices per block) trained with AdamW
on random tokens for ``--steps`` steps.  The state's ``group_vectors_below`` alternates between 0 and
``--group-vectors-below`` from one step to the next, so both settings meet the same machine load; rank 0
reports the median step time of each (the first 10 steps, which build buffers and DDP's buckets, are
left out).  The table gives the medians over ``--repeats`` launches per method and the ratio grouped /
alone, taken within each launch (median and range).  Also run: dense DDP (no hook), as a reference.
Numerics are not compared here (a group's state and its vectors' own states take turns).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(method: str, below: int, layers: int, width: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip
    from gradzip.harness.data import DatasetInfo
    from gradzip.harness.models import GPT

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    vocab, context, batch = 96, 64, 8
    model = GPT(DatasetInfo("random tokens", (context,), vocab, "language_model"), layers=layers, width=width)
    ddp = DDP(model)
    state = gradzip.register(ddp, method) if method != "dense" else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    times = {0: [], below: []}
    for step in range(steps):
        setting = below if step % 2 else 0
        if state is not None:
            state.group_vectors_below = setting
        x = torch.randint(vocab, (batch, context + 1), generator=gen)
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[:, :-1]).reshape(-1, vocab), x[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if step >= 10:
            times[setting].append(time.perf_counter() - start)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"alone_s": statistics.median(times[0]), "grouped_s": statistics.median(times[below])}, f)
    dist.destroy_process_group()


def launch(method: str, below: int, args, port: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--log-dir",
                        os.path.join(folder, "torchrun"), "--master_port", str(port), __file__, "--worker", method,
                        str(below), str(args.layers), str(args.width), str(args.steps), out],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        method, below, layers, width, steps, out = sys.argv[2:8]
        return worker(method, int(below), int(layers), int(width), int(steps), out)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="topk,qsgd,efsignsgd,onebit")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group-vectors-below", type=int, default=2**16)
    parser.add_argument("--port", type=int, default=29631)
    args = parser.parse_args()
    print(f"GPT {args.layers}x{args.width}, 2 workers (gloo, loopback, one thread each), {args.steps} steps, "
          f"{args.repeats} repeats; median step ms")
    dense = [launch("dense", args.group_vectors_below, args, args.port)["alone_s"] for _ in range(args.repeats)]
    print(f"{'dense DDP':12s} {1e3 * statistics.median(dense):8.1f}")
    print(f"{'method':12s} {'alone':>8s} {'grouped':>8s}  grouped / alone (range)")
    for method in args.methods.split(","):
        runs = [launch(method, args.group_vectors_below, args, args.port) for _ in range(args.repeats)]
        alone, grouped = [r["alone_s"] for r in runs], [r["grouped_s"] for r in runs]
        ratios = [g / a for a, g in zip(alone, grouped)]
        print(f"{method:12s} {1e3 * statistics.median(alone):8.1f} {1e3 * statistics.median(grouped):8.1f}  "
              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
