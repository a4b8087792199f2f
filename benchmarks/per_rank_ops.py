"""How a bucket exchange's operations grow with the number of ranks, on CPU.

The same bucket (six tensors of a few sizes) exchanged on the bucket route by 1, 2 and 4 ranks run as
threads of one process (:class:`gradzip.collectives.ThreadGroup`), every method with the parameters of
``gradzip bench kernels``; rank 0's third exchange counted by :class:`gradzip.testing.OpCounter` (which
sees only its own thread), after the kernels compiled ahead that the first two asked for are loaded (a
GPU's form of ``devices.runs_kernels_ahead``: a compile, tens of seconds, for each one the cache lacks).

    python benchmarks/per_rank_ops.py [--methods topk,signsgd]

Prints, per method, the operations that would launch a kernel on a GPU at each world size and how many
each further rank adds: the rank-order decoding of gathered payloads (a kernel per rank where one is
compiled ahead), plus about three copies a rank that the thread group itself makes.  Counts, not timings.
"""
from __future__ import annotations

import argparse
import threading

import torch

import gradzip
from gradzip import devices, kernels
from gradzip.bench.kernels import BENCH_PARAMS
from gradzip.collectives import ThreadGroup
from gradzip.state import GradzipState
from gradzip.testing import OpCounter, launching_ops

SHAPES = [(64, 32), (32,), (64, 32), (32, 32), (32,), (128,)]
WORLDS = (1, 2, 4)
STEPS = 3  # two that queue and load the kernels, then the counted one


def count(method: str, world: int) -> int:
    """Launching operations of rank 0's last exchange among ``world`` thread ranks."""
    group, counted, errors = ThreadGroup(world), [], []

    def rank_(rank: int) -> None:
        try:
            state = GradzipState(method, bucketed=True, **BENCH_PARAMS.get(method, {}))
            state.transport = group.transport(rank)
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(10 * step + rank)
                named = [(f"t{i}", torch.randn(s, generator=gen)) for i, s in enumerate(SHAPES)]
                if step == STEPS - 1:
                    group.barrier.wait()
                    if rank == 0:
                        kernels.settle()  # what the first steps queued, loaded before the counted one
                    group.barrier.wait()
                if step == STEPS - 1 and rank == 0:
                    with OpCounter() as counter:
                        state.exchange(named)
                    counted.append(launching_ops(counter.ops))
                else:
                    state.exchange(named)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return counted[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    skip = {"auto", "none", "fp16", "bf16"}  # auto explores; the others take DDP's plain allreduce
    parser.add_argument("--methods", default=",".join(m for m in gradzip.compressors() if m not in skip))
    args = parser.parse_args()
    devices.runs_kernels_ahead = lambda where: True  # a GPU's form: kernels compiled ahead run
    print("| method | " + " | ".join(f"world {w}" for w in WORLDS) + " | per further rank |")
    print("|---|" + "---|" * (len(WORLDS) + 1))
    for method in args.methods.split(","):
        counts = [count(method, w) for w in WORLDS]
        per_rank = (counts[-1] - counts[0]) / (WORLDS[-1] - WORLDS[0])
        print(f"| {method} | " + " | ".join(map(str, counts)) + f" | {per_rank:.1f} |", flush=True)


if __name__ == "__main__":
    main()
