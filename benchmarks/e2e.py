"""End-to-end benchmark; same as `gradzip bench e2e` (see --help).  Needs root for emulated links.

    python benchmarks/e2e.py --steps 300 --out docs/results/e2e_table.md
"""
import sys

from gradzip.cli import bench_app  # importing gradzip.cli adds the e2e command to bench_app

if __name__ == "__main__":
    bench_app(["e2e", *sys.argv[1:]], prog_name="benchmarks/e2e.py")
