"""What a fused kernel's first use costs: one ``GradzipState.exchange`` per tensor size, timed, in a fresh
process (the first call compiles; a new size may recompile once).

    python benchmarks/compile_cost.py efsignsgd qsgd          # fused paths as gradzip chooses them
    GRADZIP_FUSED=0 python benchmarks/compile_cost.py qsgd    # the reference paths, for comparison
"""
import argparse
import time

import torch

import gradzip

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("methods", nargs="+")
parser.add_argument("--sizes", default="1181066,1199882,1181066,1000000",
                    help="comma-separated tensor sizes, in order (default: the CNN's two fc buckets, then another)")
args = parser.parse_args()
for method in args.methods:
    state = gradzip.GradzipState(method)
    for n in (int(s) for s in args.sizes.split(",")):
        start = time.perf_counter()
        state.exchange([(f"t{n}", torch.randn(n))])
        print(f"{method:10s} {n:>10,} elements  {time.perf_counter() - start:7.3f} s")
