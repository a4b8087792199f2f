"""gradzip's whole exchange against GRACE's compress + decompress of the same method, in one run.

GRACE (Xu et al. 2021, github.com/sands-lab/grace) is not a dependency and none of its code is in this
repository: pass the folder of a checkout of it (its ``grace_dl`` package is imported from there).

    python benchmarks/grace_kernels.py --grace /path/to/grace [--numel 25000000] [--repeat 5]

Workload: ``gradzip bench kernels``' flat one (one 25M-element fp32 gradient, 5000 x 5000), one
intra-op thread, CPU time of the process.  For each method both sides see the same tensor:

- gradzip: one world-size-1 ``GradzipState.exchange`` into an output tensor, as the DDP hook runs it
  (non-finite checks, compress, error feedback with the method's default scheme, decode, copy out);
- GRACE: ``compress`` then ``decompress`` of its compressor, without error feedback (GRACE's memory is
  a separate object; leaving it out favours GRACE).  GRACE's PowerSGD allreduces inside ``compress``,
  so a one-process gloo group is set up for it.

Printed per method: milliseconds, passes over memory (one pass: ``torch.add(x, 1, out=buf)``, measured in
the same rounds) and the ratio gradzip / GRACE (the performance target is at most 0.5).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import gradzip
from gradzip.bench.kernels import BENCH_PARAMS, workload

#: gradzip method -> (GRACE module, class, constructor arguments), with the same settings where GRACE
#: has them: Top-k/Random-k 1%, DGC 0.1%, QSGD with gradzip's default of 1 level (GRACE calls it
#: quantum_num) and buckets of 512, Signum's momentum 0.9, PowerSGD rank 2 with a warm start.
METHODS = {
    "none": ("none", "NoneCompressor", {}),
    "fp16": ("fp16", "FP16Compressor", {}),
    "topk": ("topk", "TopKCompressor", {"compress_ratio": 0.01}),
    "randomk": ("randomk", "RandomKCompressor", {"compress_ratio": 0.01}),
    "dgc": ("dgc", "DgcCompressor", {"compress_ratio": 0.001}),
    "threshold": ("threshold", "ThresholdCompressor", {"threshold": 1e-3}),
    "qsgd": ("qsgd", "QSGDCompressor", {"quantum_num": 1, "bucket_size": 512}),
    "terngrad": ("terngrad", "TernGradCompressor", {}),
    "natural": ("natural", "NaturalCompressor", {}),
    "onebit": ("onebit", "OneBitCompressor", {}),
    "signsgd": ("signsgd", "SignSGDCompressor", {}),
    "signum": ("signum", "SignumCompressor", {"momentum": 0.9}),
    "efsignsgd": ("efsignsgd", "EFSignSGDCompressor", {"lr": 1.0}),
    "powersgd": ("powersgd", "PowerSGDCompressor", {"rank": 2, "use_memory": True}),
}


def _grace(grace_dir: str, method: str):
    sys.path.insert(0, os.path.abspath(grace_dir))
    module, cls, kwargs = METHODS[method]
    return getattr(importlib.import_module(f"grace_dl.dist.compressor.{module}"), cls)(**kwargs)


def _cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return 1e3 * (time.process_time() - start)


def run(grace_dir: str, methods, numel: int, repeat: int) -> list[dict]:
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")
    dist.init_process_group("gloo", rank=0, world_size=1)  # GRACE's PowerSGD allreduces in compress
    (name, x), = workload("flat", numel, torch.device("cpu"))
    buf, out = torch.empty_like(x), torch.empty_like(x)
    rows = []
    try:
        for method in methods:
            state = gradzip.GradzipState(method, **BENCH_PARAMS.get(method, {}))
            theirs = _grace(grace_dir, method)

            def ours():
                state.exchange([(name, x)], out=[out])

            def grace():
                payload, ctx = theirs.compress(x, name)
                theirs.decompress(payload, ctx)

            try:
                for _ in range(2):  # warm-up: residuals, bases and buffers exist from here on
                    ours()
                    grace()
            except ImportError as exc:  # GRACE's natural compression needs CuPy
                rows.append({"method": method, "grace_error": f"{type(exc).__name__}: {exc}"})
                print(f"{method:10s} GRACE's version cannot run here ({rows[-1]['grace_error']}): skipped", flush=True)
                continue
            passes, mine, other = [], [], []
            for _ in range(repeat):
                passes.append(_cpu_ms(lambda: torch.add(x, 1.0, out=buf)))
                mine.append(_cpu_ms(ours))
                other.append(_cpu_ms(grace))
            one = statistics.median(passes)
            row = {"method": method, "pass_ms": one, "gradzip_ms": statistics.median(mine),
                   "grace_ms": statistics.median(other)}
            row["gradzip_passes"], row["grace_passes"] = row["gradzip_ms"] / one, row["grace_ms"] / one
            row["ratio"] = row["gradzip_ms"] / row["grace_ms"]
            rows.append(row)
            print(f"{method:10s} gradzip {row['gradzip_ms']:8.1f} ms ({row['gradzip_passes']:5.1f} passes)   GRACE "
                  f"{row['grace_ms']:8.1f} ms ({row['grace_passes']:5.1f} passes)   gradzip / GRACE {row['ratio']:.2f}"
                  f"  ({'met' if row['ratio'] <= 0.5 else 'NOT met'}: at most 0.5)", flush=True)
    finally:
        dist.destroy_process_group()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grace", required=True, help="folder of a checkout of github.com/sands-lab/grace")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated gradzip method names")
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"no GRACE counterpart for {', '.join(unknown)}; valid: {', '.join(METHODS)}")
    if not os.path.isdir(os.path.join(args.grace, "grace_dl")):
        parser.error(f"--grace {args.grace!r} holds no grace_dl package: give the folder of a GRACE checkout")
    rows = run(args.grace, methods, args.numel, args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "numel": args.numel, "repeat": args.repeat, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
