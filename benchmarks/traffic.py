"""Memory traffic of one bucket exchange, estimated on CPU as a GPU would move it, in passes over the bucket.

Every aten operation an exchange dispatches (views and bare allocations aside) reads its tensor inputs
and writes its outputs; their bytes, summed, over one pass's (read 4 and write 4 bytes per float32
element), estimate what a GPU pays in memory bandwidth for an eager, unfused exchange. Indexing
operations count the elements they gather or scatter, not their whole source or target. It is a model,
not a measurement: sorts and top-k take several passes of their own, caches absorb small tensors, and
a kernel reads strided views at their own cost. Run with the GPU's forms of the device seam
(:mod:`gradzip.devices`), world size 1, one tensor of 2000 x 2000 (as ``gradzip bench kernels``' flat
workload, smaller) or a transformer block's shapes:

    python benchmarks/traffic.py [--methods topk,qsgd] [--workload flat|block] [--top 8]

Prints each method's estimated passes and operations, and with ``--top`` where the passes go.
"""
from __future__ import annotations

import argparse
import collections
import traceback
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gradzip
from gradzip import devices
from gradzip.bench.kernels import BENCH_PARAMS
from gradzip.state import GradzipState

_FREE = {"view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "t", "transpose", "expand",
         "alias", "detach", "permute", "reshape", "split", "split_with_sizes", "unbind", "narrow", "lift_fresh", "empty",
         "empty_like", "new_empty", "empty_strided", "_reshape_alias", "unfold", "sym_size", "sym_stride", "sym_numel"}
_SCATTERS = {"index_put_", "index_put", "_index_put_impl_", "index_add_", "index_add", "index_copy_", "index_copy",
             "scatter_", "scatter", "scatter_add_", "scatter_add", "scatter_reduce_", "scatter_reduce", "index_fill_",
             "masked_scatter_", "index_reduce_"}
_GATHERS = {"index", "index_select", "gather", "take", "embedding"}
WORKLOADS = {"flat": [(2000, 2000)], "block": [(3072, 1024), (3072,), (1024, 1024), (1024,), (4096, 1024), (4096,),
                                                (1024, 4096), (1024,), (1024,), (1024,)]}


def _bytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class Traffic(TorchDispatchMode):
    """Bytes each dispatched operation reads and writes, with the gradzip line that dispatched it."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in _FREE:
            return out
        read = (args, {k: v for k, v in (kwargs or {}).items() if k != "out"})  # out= is written, not read
        ins = [a for a in tree_flatten(read)[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if name in _SCATTERS:  # the target's untouched elements do not move: twice what is written, + indices
            moved = 2 * sum(_bytes(a) for a in ins[1:])
        elif name in _GATHERS:  # what is gathered, read and written, and the indices
            moved = 2 * sum(_bytes(o) for o in outs) + sum(_bytes(a) for a in ins[1:] if not a.is_floating_point())
        elif name.endswith("_"):  # in place: the inputs read, the first written back
            moved = sum(_bytes(a) for a in ins) + (_bytes(ins[0]) if ins else 0)
        else:
            moved = sum(_bytes(a) for a in ins) + sum(_bytes(o) for o in outs)
        frames = [f for f in traceback.extract_stack() if "/gradzip/" in f.filename]
        where = f"{frames[-1].filename.split('/gradzip/')[1]}:{frames[-1].lineno}" if frames else "?"
        self.log.append((moved, name, where))
        return out


def _gpu_forms():
    """Every predicate of the device seam as on a GPU, but no CUDA stream, event or pinned memory."""
    return mock.patch.multiple(devices, _type=lambda where: "cuda", cuda=lambda where: False)


def measure(method: str, shapes: list) -> tuple:
    """(passes, operations, the log) of one steady-state exchange of a bucket of ``shapes``."""
    numels = [torch.Size(s).numel() for s in shapes]
    gen = torch.Generator().manual_seed(0)

    def bucket():
        flat = torch.randn(sum(numels), generator=gen)
        return [(f"p{i}", v.view(s)) for i, (v, s) in enumerate(zip(torch.split(flat, numels), shapes))]

    with _gpu_forms():
        state = GradzipState(method, bucketed=True, **BENCH_PARAMS.get(method, {}))
        for _ in range(2):
            named = bucket()
            state.exchange(named, out=[g for _, g in named])
        named = bucket()
        with Traffic() as traffic:
            state.exchange(named, out=[g for _, g in named])
    one_pass = 8 * sum(numels)
    return sum(moved for moved, _, _ in traffic.log) / one_pass, len(traffic.log), traffic.log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default=",".join(sorted(set(gradzip.compressors()) - {"auto"})))
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="flat")
    parser.add_argument("--top", type=int, default=0, help="also list the lines moving the most")
    args = parser.parse_args()
    shapes = WORKLOADS[args.workload]
    print("| method | passes | operations |\n|---|---|---|")
    for method in args.methods.split(","):
        passes, ops, log = measure(method, shapes)
        print(f"| {method} | {passes:.1f} | {ops} |", flush=True)
        if args.top:
            lines = collections.Counter()
            for moved, name, where in log:
                lines[(name, where)] += moved / (8 * sum(torch.Size(s).numel() for s in shapes))
            for (name, where), p in lines.most_common(args.top):
                print(f"|   {name} at {where} | {p:.2f} | |")


if __name__ == "__main__":
    main()
