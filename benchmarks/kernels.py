"""Kernel benchmark of every gradzip compressor; same as `gradzip bench kernels` (see --help).

    python benchmarks/kernels.py --repeat 5 --json docs/results/kernels.json
"""
import sys

from gradzip.bench.cli import bench_app

if __name__ == "__main__":
    bench_app(["kernels", *sys.argv[1:]], prog_name="benchmarks/kernels.py")
