"""What one exchange costs per tensor when the tensors are small: the fixed cost that Python and torch's
eager dispatch add to every tensor, whatever its size (a transformer's biases and norms pay it many
times a step), for each method in turn.

    python benchmarks/per_tensor_overhead.py [--tensors 100] [--numel 128] [--methods none,fp16,topk]

One ``GradzipState.exchange`` of ``--tensors`` gradients of ``--numel`` elements each into output
tensors (as the DDP hook runs it), world size 1, one intra-op thread; prints the median over
``--repeat`` exchanges of the wall time divided by the number of tensors, in microseconds.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from gradzip import GradzipState
from gradzip.bench.kernels import BENCH_PARAMS
from gradzip.collectives import LocalTransport
from gradzip.compressors import compressors, make


def per_tensor_us(method: str, tensors: int, numel: int, repeat: int) -> float:
    gen = torch.Generator().manual_seed(0)
    grads = [(f"t{i}", torch.randn(numel, generator=gen) * 0.01) for i in range(tensors)]
    out = [torch.empty_like(g) for _, g in grads]
    state = GradzipState(make(method, **BENCH_PARAMS.get(method, {})), transport=LocalTransport(), seed=0)
    for _ in range(5):  # warm: buffers, caches, auto's first trials
        state.exchange(grads, out=out)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        state.exchange(grads, out=out)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / tensors * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--numel", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--methods", default=",".join(n for n in compressors() if n not in ("auto", "sketch")),
                        help="comma-separated methods (default: all but auto and sketch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.tensors} tensors of {args.numel} elements, world size 1, median of {args.repeat} exchanges")
    for method in args.methods.split(","):
        print(f"{method:20s} {per_tensor_us(method, args.tensors, args.numel, args.repeat):8.1f} us per tensor")


if __name__ == "__main__":
    main()
