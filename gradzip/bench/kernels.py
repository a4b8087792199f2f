"""Kernel benchmark: how long each compressor takes, measured against one pass over memory.

``gradzip bench kernels`` times every registered method (defaults, except DGC ``ratio=0.001,
warmup_epochs=0`` and PowerSGD ``dense_steps=0`` so that both compress from the first step) on

- ``flat``: one 25M-element fp32 gradient, shaped 5000 x 5000 (PowerSGD's matrix view; every other
  method flattens it), and
- ``resnet50``: ResNet-50's 161 parameter tensors (25.6M elements; BN weights and biases are 1-D),

the way training runs them: one world-size-1 :meth:`GradzipState.exchange` of the gradients into
themselves (as the DDP hook does with its bucket; the bucket is refilled, untimed, before each) through
:func:`run_lockstep` with a :class:`LocalTransport`, i.e. compress + decompress + error feedback, the
non-finite checks and the copy out where there is one, with no network.  It also times the compressor alone (no feedback, no state).

The yardstick is one memory pass over the same tensors, ``torch.add(x, 1.0, out=buf)`` (read n floats,
write n floats), measured in the same run and interleaved with the methods, because the CPUs this runs
on are shared and timings drift.  Every number is a median over ``repeat`` rounds.

Last, DGC's sampled threshold selection is timed against an exact ``torch.topk`` at 0.1% density.
"""
from __future__ import annotations

import json
import math
import os
import platform
import time
from typing import Callable, Optional, Sequence

import torch

from .. import kernels
from ..collectives import LocalTransport, run_lockstep
from ..compressors import compressors, make
from ..compressors.base import TensorContext
from ..compressors.dense import NoCompression
from ..compressors.sparse import DGC
from ..state import GradzipState

__all__ = ["BENCH_PARAMS", "resnet50_shapes", "flat_shape", "workload", "run", "format_table", "main"]

#: Parameters that differ from the defaults: both methods would otherwise send densely at first.
BENCH_PARAMS = {"dgc": {"ratio": 0.001, "warmup_epochs": 0}, "powersgd": {"dense_steps": 0}}


def resnet50_shapes() -> list[tuple[str, tuple]]:
    """ResNet-50's parameters (torchvision order and names): 161 tensors, 25,557,032 elements.

    Stem conv 64x3x7x7; four stages of 3, 4, 6, 3 bottlenecks (1x1 reduce, 3x3, 1x1 expand to 4x the
    width, and a 1x1 downsample conv in each stage's first block); every conv followed by a batch norm
    with a 1-D weight and bias; fc 1000x2048 with a bias.
    """
    shapes: list[tuple[str, tuple]] = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]

    def bn(prefix, c):
        shapes.extend([(f"{prefix}.weight", (c,)), (f"{prefix}.bias", (c,))])

    inplanes = 64
    for stage, (width, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        out = 4 * width
        for b in range(blocks):
            p = f"layer{stage}.{b}"
            shapes.append((f"{p}.conv1.weight", (width, inplanes, 1, 1)))
            bn(f"{p}.bn1", width)
            shapes.append((f"{p}.conv2.weight", (width, width, 3, 3)))
            bn(f"{p}.bn2", width)
            shapes.append((f"{p}.conv3.weight", (out, width, 1, 1)))
            bn(f"{p}.bn3", out)
            if b == 0:
                shapes.append((f"{p}.downsample.0.weight", (out, inplanes, 1, 1)))
                bn(f"{p}.downsample.1", out)
            inplanes = out
    shapes.extend([("fc.weight", (1000, 2048)), ("fc.bias", (1000,))])
    return shapes


def flat_shape(numel: int) -> tuple[int, int]:
    """The most square (rows, cols) with rows * cols == numel: 25M is 5000 x 5000."""
    rows = math.isqrt(numel)
    while rows > 1 and numel % rows:
        rows -= 1
    return (max(rows, 1), numel // max(rows, 1))


def workload(kind: str, numel: int, device: torch.device, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    """Gradient-like tensors (N(0, 0.01^2)) of the ``flat`` or ``resnet50`` workload."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        shapes = [("grad", flat_shape(numel))]
    elif kind == "resnet50":
        shapes = resnet50_shapes()
    else:
        raise ValueError(f"workload must be 'flat' or 'resnet50', got {kind!r}")
    return [(name, (torch.randn(shape, generator=gen) * 0.01).to(device)) for name, shape in shapes]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: wall: elapsed time.  cpu: CPU time of this process (system time included, so page faults count), on
#: one intra-op thread (idle OpenMP workers spin and would be counted too); on a machine shared with other
#: jobs it does not count the time spent waiting for a core, so it is the steadier measure of work.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = _clock()
    fn()
    _sync(device)
    return _clock() - start


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


class _Method:
    """One method on one workload: a GradzipState for the training path, a bare compressor for 'alone'."""

    def __init__(self, name: str, named: list, device: torch.device):
        self.name = name
        self.params = dict(BENCH_PARAMS.get(name, {}))
        self.named = named
        self.device = device
        self.state = GradzipState(make(name, **self.params), transport=LocalTransport(), seed=0)
        self.compressor = make(name, **self.params)
        self.samples: dict[str, list] = {k: [] for k in ("ms", "alone", "compress", "communicate", "decompress")}
        # DDP's bucket: the hook's gradients are also where the averages go, so buffers are reused and
        # the gradient's own memory is written as in training.  Refilled before every exchange
        # (untimed), as backward refills the bucket.
        self.bucket = [(key, g.clone()) for key, g in named]

    def refill(self) -> None:
        for (_, grad), (_, g) in zip(self.bucket, self.named):
            grad.copy_(g)

    def exchange(self) -> None:
        self.state.exchange(self.bucket, out=[grad for _, grad in self.bucket])

    def alone(self) -> None:
        """The compressor's own exchange (dense for the tensors it does not compress), no feedback, no state."""
        gens = []
        for key, g in self.named:
            ctx = TensorContext(key=key, shape=g.shape, dtype=g.dtype, step=1000)
            run = self.compressor.exchange if self.compressor.compresses(ctx) else NoCompression().exchange
            gens.append(run(g, ctx))
        run_lockstep(gens, LocalTransport())

    def measure(self) -> None:
        self.refill()
        start = time.perf_counter()
        self.samples["ms"].append(1e3 * _timed(self.exchange, self.device))
        wall = time.perf_counter() - start
        report = self.state.last_report  # wall-clock split: kept as shares of this exchange's wall time
        for part in ("compress", "communicate", "decompress"):
            self.samples[part].append(getattr(report, f"{part}_s") / wall)

    def measure_alone(self) -> None:
        self.samples["alone"].append(1e3 * _timed(self.alone, self.device))


def _top_ops(fn: Callable[[], object], device: torch.device, top: int = 4) -> list[dict]:
    """The operators that took the most self time in one call of ``fn`` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0 or getattr(e, "self_device_time_total", 0) > 0]
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    total = sum(getattr(e, key) for e in events) or 1
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    return [{"op": e.key, "ms": getattr(e, key) / 1e3, "share": getattr(e, key) / total} for e in events[:top]]


def _baseline(named: list) -> Callable[[], None]:
    """One memory pass over the workload's tensors: read every element, write every element."""
    bufs = [torch.empty_like(g) for _, g in named]

    def one_pass():
        for (_, g), buf in zip(named, bufs):
            torch.add(g, 1.0, out=buf)

    return one_pass


def bench_workload(kind: str, methods: Sequence[str], *, numel: int, device: torch.device, repeat: int,
                   warmup: int = 2, profile: bool = False, alone: bool = True) -> dict:
    named = workload(kind, numel, device)
    one_pass = _baseline(named)
    runs = [_Method(name, named, device) for name in methods]
    for _ in range(warmup):  # residuals, momenta and PowerSGD bases exist from here on: steady state
        one_pass()
        for m in runs:
            m.refill()
            m.exchange()
    # Kernels the bucket route compiles ahead (a GPU's) may still be compiling on their background thread:
    # waited for, then one more exchange each, so that the timed rounds run them as a user's steps will.
    start = time.perf_counter()
    kernels.settle()
    compile_wait_ms = 1e3 * (time.perf_counter() - start)
    if compile_wait_ms > 1:
        for m in runs:
            m.refill()
            m.exchange()
    base: list[float] = []
    for _ in range(repeat):
        # Interleaved: every method sits between two baseline passes in every round.
        for m in runs:
            base.append(1e3 * _timed(one_pass, device))
            m.measure()
            if alone:
                m.measure_alone()
    base_ms = _median(base)
    rows = []
    for m in runs:
        ms = _median(m.samples["ms"])
        # best: fastest round over fastest pass, the least disturbed by other work on shared machines.
        row = {"method": m.name, "params": m.params, "ms": ms, "x_pass": ms / base_ms,
               "best_x_pass": min(m.samples["ms"]) / min(base), "density": m.state.stats()["density"]}
        # Where the time goes: ExchangeReport's (wall-clock) split, as shares of the exchange, and in ms.
        for part in ("compress", "communicate", "decompress"):
            row[f"{part}_share"] = _median(m.samples[part])
        row["other_share"] = 1 - row["compress_share"] - row["communicate_share"] - row["decompress_share"]
        for part in ("compress", "communicate", "decompress", "other"):
            row[f"{part}_ms"] = ms * row[f"{part}_share"]
        if alone:
            row["alone_ms"] = _median(m.samples["alone"])
            row["alone_x_pass"] = row["alone_ms"] / base_ms
        if profile:
            m.refill()
            row["top_ops"] = _top_ops(m.exchange, device)
        rows.append(row)
    shapes = [tuple(g.shape) for _, g in named]
    return {"workload": kind, "tensors": len(named), "numel": sum(g.numel() for _, g in named),
            "shape": list(shapes[0]) if kind == "flat" else None, "baseline_ms": base_ms,
            "baseline_best_ms": min(base), "compile_wait_ms": compile_wait_ms,
            "baseline": "torch.add(x, 1.0, out=buf) over every tensor", "methods": rows}


def bench_dgc_selection(numel: int, device: torch.device, repeat: int, ratio: float = 0.001) -> dict:
    """DGC's sampled threshold selection against an exact top-k of |x| at the same density."""
    (_, x), = workload("flat", numel, device, seed=1)
    flat = x.reshape(-1)
    dgc = DGC(ratio=ratio, warmup_epochs=0)
    k = math.ceil(ratio * flat.numel())
    ctx = TensorContext(key="grad", shape=x.shape, dtype=x.dtype, step=0)
    sampled, exact, kept = [], [], []
    magnitudes = torch.empty_like(flat)  # both sides get |x| in a reused buffer: only selection is timed
    for step in range(repeat + 1):
        ctx.step = step  # a fresh random sample start every round
        t_exact = _timed(lambda: torch.topk(torch.abs(flat, out=magnitudes), k, sorted=False).indices, device)
        out = {}
        t_sampled = _timed(lambda: out.setdefault("idx", dgc.select(flat, ctx)), device)
        if step:  # the first round warms up (the workspace buffers are allocated there)
            exact.append(1e3 * t_exact)
            sampled.append(1e3 * t_sampled)
            kept.append(out["idx"].numel())
    s, e = _median(sampled), _median(exact)
    return {"numel": flat.numel(), "ratio": ratio, "k": k, "kept_median": int(_median(kept)),
            "sampled_ms": s, "exact_topk_ms": e, "speedup": e / s}


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(), "device": str(device),
            # PyTorch's opt-in: large CPU tensors on transparent huge pages (far fewer page faults).
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "")}
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu"], info["cores"] = names[0], len(names)
    except (OSError, IndexError):
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run(methods: Optional[Sequence[str]] = None, *, device: str = "cpu", repeat: int = 5,
        workloads: Sequence[str] = ("flat", "resnet50"), numel: int = 25_000_000, profile: bool = False,
        alone: bool = True, selection: bool = True, clock: str = "wall",
        progress: Optional[Callable[[str], None]] = None) -> dict:
    """Run the benchmark; returns a JSON-ready dict (see :func:`format_table`)."""
    global _clock
    if clock not in CLOCKS or (clock == "cpu" and torch.device(device).type != "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu' (cpu only with --device cpu), got {clock!r}")
    _clock = CLOCKS[clock]
    names = list(methods) if methods else compressors()
    unknown = [m for m in names if m not in compressors()]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; valid: {', '.join(compressors())}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    bad = [w for w in workloads if w not in ("flat", "resnet50")]
    if bad:
        raise ValueError(f"workload must be 'flat' or 'resnet50', got {', '.join(map(repr, bad))}")
    dev = torch.device(device)
    threads = torch.get_num_threads()
    if clock == "cpu":
        torch.set_num_threads(1)
    try:
        result = {"machine": machine(dev), "repeat": repeat, "clock": clock, "workloads": []}
        for kind in workloads:
            if progress:
                progress(f"workload {kind} ...")
            result["workloads"].append(bench_workload(kind, names, numel=numel, device=dev, repeat=repeat,
                                                      profile=profile, alone=alone))
        if selection:
            if progress:
                progress("DGC selection vs exact top-k ...")
            result["dgc_selection"] = bench_dgc_selection(numel, dev, repeat)
    finally:
        torch.set_num_threads(threads)
    return result


def format_table(result: dict) -> str:
    m = result["machine"]
    thp = ", THP_MEM_ALLOC_ENABLE=1" if m.get("THP_MEM_ALLOC_ENABLE") == "1" else ""
    lines = [f"gradzip kernel benchmark: {m['device']}, {m['cpu']}, {m.get('cores', '?')} cores, "
             f"torch {m['torch']} ({m['threads']} threads{thp}), median of {result['repeat']}, "
             f"{result.get('clock', 'wall')} clock"]
    for w in result["workloads"]:
        what = f"1 tensor {w['shape'][0]}x{w['shape'][1]}" if w["shape"] else f"{w['tensors']} tensors"
        lines.append("")
        lines.append(f"{w['workload']}: {what}, {w['numel']:,} fp32 elements; one memory pass "
                     f"(torch.add(x, 1, out=buf)) = {w['baseline_ms']:.1f} ms")
        if w.get("compile_wait_ms", 0) > 1:
            lines[-1] += f"; {w['compile_wait_ms'] / 1e3:.1f} s waited for kernels compiled ahead (untimed)"
        alone = "alone_ms" in (w["methods"][0] if w["methods"] else {})
        head = (f"{'method':10s} {'ms':>8s} {'x pass':>7s} {'best x':>7s} {'compress':>9s} {'decomp':>7s} "
                f"{'other':>6s} {'density':>8s}")
        if alone:
            head += f" {'alone ms':>9s} {'x pass':>7s}"
        if any("top_ops" in r for r in w["methods"]):
            head += "  top ops (self time share)"
        lines.append(head)
        for r in w["methods"]:
            line = (f"{r['method']:10s} {r['ms']:8.1f} {r['x_pass']:7.2f} {r['best_x_pass']:7.2f} "
                    f"{100 * r['compress_share']:8.0f}% {100 * r['decompress_share']:6.0f}% "
                    f"{100 * r['other_share']:5.0f}% {r['density']:8.4f}")
            if alone:
                line += f" {r['alone_ms']:9.1f} {r['alone_x_pass']:7.2f}"
            if "top_ops" in r:
                line += "  " + ", ".join(f"{o['op'].removeprefix('aten::')} {100 * o['share']:.0f}%"
                                         for o in r["top_ops"])
            lines.append(line)
    sel = result.get("dgc_selection")
    if sel:
        lines.append("")
        lines.append(f"DGC selection at {100 * sel['ratio']:g}% of {sel['numel']:,}: sampled {sel['sampled_ms']:.1f} ms "
                     f"(kept {sel['kept_median']:,} of k = {sel['k']:,}), exact torch.topk {sel['exact_topk_ms']:.1f} ms, "
                     f"speedup {sel['speedup']:.1f}x")
    lines.append("")
    lines.append("ms: one GradzipState.exchange of the gradients into themselves, as DDP's bucket (world size 1, LocalTransport: compress + decompress + error "
                 "feedback), median; x pass: median over the median pass; best x: fastest over fastest; "
                 "compress/decomp/other: shares of the exchange's wall time from ExchangeReport (feedback's own "
                 "arithmetic included; other: non-finite check, fusing requests into one buffer, commit); "
                 "density: elements sent / elements; alone: the compressor's exchange without feedback or state.")
    return "\n".join(lines)


def main(methods: Optional[Sequence[str]] = None, *, json_out: Optional[str] = None, echo=print, **kwargs) -> dict:
    result = run(methods, progress=lambda s: echo(s), **kwargs)
    report(result, format_table(result), json_out, echo)
    return result


def report(result: dict, table: str, json_out: Optional[str], echo) -> None:
    """Print a benchmark's table and write its result as JSON to ``json_out`` (when given)."""
    echo(table)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(result, f, indent=2)
        echo(f"wrote {json_out}")
