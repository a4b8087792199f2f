"""What one exchange costs per tensor when the tensors are small: the fixed cost that Python and torch's
eager dispatch add to every tensor, whatever its size (a transformer's biases and norms pay it many
times a step), for each method in turn.

    python benchmarks/per_tensor_overhead.py [--tensors 100] [--numel 128] [--methods none,fp16,topk]
                                             [--group-vectors-below N]

One ``GradzipState.exchange`` of ``--tensors`` gradients of ``--numel`` elements each into output
tensors (as the DDP hook runs it), world size 1, one intra-op thread; prints the median over
``--repeat`` exchanges of the wall time divided by the number of tensors, in microseconds, and the
same with the tensors exchanged as one group (``GradzipState(group_vectors_below=...)``; they are
vectors) when ``--group-vectors-below`` exceeds ``--numel``.
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


def per_tensor_us(method: str, tensors: int, numel: int, repeat: int, group_vectors_below: int = 0) -> float:
    gen = torch.Generator().manual_seed(0)
    grads = [(f"t{i}", torch.randn(numel, generator=gen) * 0.01) for i in range(tensors)]
    out = [torch.empty_like(g) for _, g in grads]
    state = GradzipState(make(method, **BENCH_PARAMS.get(method, {})), transport=LocalTransport(), seed=0,
                         group_vectors_below=group_vectors_below)
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
    parser.add_argument("--group-vectors-below", type=int, default=2**16,
                        help="also time the tensors exchanged as one group (0: do not)")
    parser.add_argument("--methods", default=",".join(n for n in compressors() if n not in ("auto", "sketch")),
                        help="comma-separated methods (default: all but auto and sketch)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    grouped = args.group_vectors_below > args.numel
    print(f"{args.tensors} tensors of {args.numel} elements, world size 1, median of {args.repeat} exchanges; "
          f"us per tensor" + (", each on its own and as one group" if grouped else ""))
    for method in args.methods.split(","):
        alone = per_tensor_us(method, args.tensors, args.numel, args.repeat)
        line = f"{method:20s} {alone:8.1f}"
        if grouped:
            together = per_tensor_us(method, args.tensors, args.numel, args.repeat, args.group_vectors_below)
            line += f" {together:8.1f}  ({alone / together:.0f}x)"
        print(line)


if __name__ == "__main__":
    main()
