"""Step benchmark: what one whole DDP training step costs with each communication hook.

``gradzip bench step`` trains a GPT (``gradzip.harness.models.GPT`` on random tokens, AdamW, bf16
autocast on CUDA) under DDP with each contender in turn (each in a process of its own by default, see
below), from the same seed:

- ``ddp``: DDP with no hook (its C++ allreduce);
- PyTorch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks``): ``torch-allreduce``,
  ``torch-fp16``, ``torch-bf16``, ``torch-powersgd`` (rank 4, compressing from the third step on:
  ``start_powerSGD_iter=2``, the least PyTorch accepts with error feedback, which is on);
- two probes of a hook's own cost, run only when named: ``probe-cpp-hook`` (DDP's built-in C++
  allreduce hook: the reducer's hook path, no Python) and ``probe-python-hook`` (a Python hook that
  returns a future already done with the bucket as it is: the Python call and its future, no
  collective; world size 1 only).  Between ``ddp``, them and ``torch-allreduce`` lies where a Python
  hook's cost goes;
- every gradzip method, ``gradzip.register(ddp_model, name)`` with :data:`BENCH_PARAMS` (DGC and
  PowerSGD compress from the first step), or a method with parameters of its own as ``NAME:KEY=VALUE,...``
  (``powersgd:rank=4``: PyTorch's hook's rank; they override :data:`BENCH_PARAMS`, and the spec names
  its row); ``bucketed=true|false`` picks the route (default: the bucket route on CUDA, per tensor on
  a CPU).  Methods that apply momentum themselves (DGC, Signum) refuse AdamW and get plain SGD
  instead (the row says so).  A gradzip PowerSGD row also gives its ratio to ``torch-powersgd`` of the
  same repeat (``x_torch_powersgd``), whose rank the note names.

Per contender: ``first_ms``, the first step alone (DDP's first step builds buckets, a hook allocates
its state, CUDA loads kernels); then ``warmup`` untimed steps; then, where the bucket route's kernels
are still compiling on their background thread, a wait for them (``compile_wait_ms``) and one more
untimed step; then ``steps`` timed steps, each between
two synchronisations (so no step overlaps the next), whose median is ``ms``.  ``peak_mb`` is
``torch.cuda.max_memory_allocated`` over the whole run (CUDA only).  Then ``profile_steps`` more steps
run under ``torch.profiler`` on every thread (gradzip compresses on a thread of its own and CUDA
backward runs on autograd's device threads; without ``profile_all_threads``, where torch lacks it, only
the calling thread counts and ``all_threads`` is false).  Counted per step:

- ``launches`` (CUDA): runtime calls whose name starts with ``cudaLaunchKernel`` or ``cuLaunchKernel``;
- ``syncs`` (CUDA): host-blocking runtime calls ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize`` and synchronous ``cudaMemcpy`` (``.item()``, ``nonzero`` and ``.tolist()``
  of a CUDA tensor each end in one of these);
- ``aten_ops``: every ``aten::`` event, nested ones included (an op calling another counts twice); on a
  CPU, which launches nothing, this is the measure of how many operations a step dispatches;
- ``host_reads``: operations whose result the host must read before it can go on:
  ``aten::_local_scalar_dense`` (what ``.item()``, ``bool()``, ``int()`` of a tensor reach; ``aten::item``
  itself is not counted again), ``aten::nonzero``, ``aten::masked_select``, ``aten::unique*``.  Reads of
  CPU tensors count too (AdamW reads its CPU step counters, one per parameter), so on CUDA ``syncs``, not
  this, says how often the host waited for the GPU.

Alone (world size 1) each contender runs by default in a Python process of its own (``isolate``:
``python -m gradzip bench step --methods NAME --no-isolate --json FILE`` with the same options and
environment), so that no contender's peak memory, allocator cache or warm kernels reach the next; a child
that fails is a row with the last line of its stderr.  ``repeats`` > 1 runs the whole list again, in the
same order, that many times: a row gives the median over repeats of each number (``peak_mb`` their
maximum), ``ms_lo``/``ms_hi`` the fastest and slowest repeat's ``ms``, ``spread`` = ms_hi / ms_lo - 1,
and the ratios ``x_ddp`` (ms over DDP's) and ``x_fp16`` (over ``torch-fp16``'s) are taken within each
repeat, then their median; ``runs`` in the result keeps every repeat's row.

Under torchrun (WORLD_SIZE > 1) every rank runs the same contenders in its own process (no isolation)
and rank 0 reports its own numbers; alone without isolation, the command makes a one-process group
itself (gloo on CPU, NCCL on CUDA, FileStore).  A contender that raises is a row with its error; the
others still run.  In each process an untimed plain-DDP run comes first, so that the process's own first
steps (CUDA context, kernel loading, thread pools) count for nobody.
"""
from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from collections import Counter
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from .. import kernels
from ..compressors.registry import parse_spec, parse_value
from ..harness.data import DatasetInfo
from ..harness.models import GPT
from .kernels import BENCH_PARAMS, machine, report

__all__ = ["BASELINES", "PROBES", "defaults", "run", "format_table", "main"]

BASELINES = ("ddp", "torch-allreduce", "torch-fp16", "torch-bf16", "torch-powersgd")
PROBES = ("probe-cpp-hook", "probe-python-hook")

#: Defaults per device: a 109M-parameter GPT on a GPU (13 buckets of 25 MB), a 0.4M one on a CPU.
DEFAULTS = {
    "cuda": dict(width=1024, depth=8, context=256, batch=16, vocab=8192, steps=20, warmup=3, amp="bf16"),
    "cpu": dict(width=128, depth=2, context=64, batch=4, vocab=256, steps=5, warmup=1, amp="none"),
}
LAUNCH_PREFIXES = ("cudaLaunchKernel", "cuLaunchKernel")
SYNC_NAMES = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
READ_NAMES = frozenset({"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select"})


def split_methods(text: str) -> list:
    """A comma-separated list of contenders, where a method's own parameters are comma-separated too:
    an item with ``=`` and no ``:`` before it continues the spec before it (``"ddp,powersgd:rank=4,
    dense_steps=2,topk"`` -> ``["ddp", "powersgd:rank=4,dense_steps=2", "topk"]``)."""
    names: list = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if names and ":" in names[-1] and "=" in item and ":" not in item.partition("=")[0]:
            names[-1] += "," + item
        else:
            names.append(item)
    return names


#: Contender keys that are the state's, not the compressor's (``topk:bucketed=true``: Top-k on the bucket
#: route on a CPU too, beside ``topk`` on the default route).
STATE_KEYS = ("bucketed",)


def _spec(name: str) -> tuple:
    """(method, parameters) of gradzip contender ``name``: :data:`BENCH_PARAMS` updated by its own."""
    method, _, rest = name.partition(":")
    items = [item for item in (part.strip() for part in rest.split(",")) if item]
    state = {key.strip(): parse_value(raw) for key, _, raw in (item.partition("=") for item in items)
             if key.strip() in STATE_KEYS}
    compressor = [item for item in items if item.partition("=")[0].strip() not in STATE_KEYS]
    method, own = parse_spec(method + (":" + ",".join(compressor) if compressor else ""))
    if "bucketed" in state and not (state["bucketed"] is None or isinstance(state["bucketed"], bool)):
        raise ValueError(f"bucketed must be true, false or none in {name!r}, got {state['bucketed']!r}")
    return method, {**BENCH_PARAMS.get(method, {}), **own, **state}


def defaults(device: str) -> dict:
    return dict(DEFAULTS["cuda" if device.startswith("cuda") else "cpu"])


def _model(cfg: dict) -> GPT:
    """The benchmark's GPT: heads of 64 channels (one head below width 64); random tokens need no dataset."""
    info = DatasetInfo("random tokens", (cfg["context"],), cfg["vocab"], "language_model")
    return GPT(info, layers=cfg["depth"], width=cfg["width"], heads=max(1, cfg["width"] // 64))


def _all_threads_config():
    """The profiler's all-threads switch where this torch has it (else None: the calling thread only)."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError, RuntimeError):
        return None


def _init_group(device: torch.device) -> bool:
    """Join torchrun's group, or make a one-process one; True if this call made it (and must destroy it)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group(backend)  # torchrun's env:// rendezvous
    else:
        path = tempfile.mkstemp(prefix="gradzip_step_")[1]
        os.unlink(path)  # FileStore creates it; a stale file from an earlier run would confuse it
        dist.init_process_group(backend, store=dist.FileStore(path, 1), rank=0, world_size=1)
    return True


def _attach(name: str, ddp: DDP):
    """Install contender ``name`` on ``ddp``; returns gradzip's state (or None) and a note for the row."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name == "ddp":
        return None, ""
    hooks = {"torch-allreduce": default_hooks.allreduce_hook, "torch-fp16": default_hooks.fp16_compress_hook,
             "torch-bf16": default_hooks.bf16_compress_hook}
    if name in hooks:
        ddp.register_comm_hook(None, hooks[name])
        return None, ""
    if name == "probe-cpp-hook":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        return None, "C++ allreduce hook"
    if name == "probe-python-hook":
        if dist.get_world_size() > 1:
            raise ValueError("probe-python-hook averages nothing: it runs at world size 1 only")
        ddp.register_comm_hook(None, _done_hook)
        return None, "no collective"
    if name == "torch-powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None, "rank 4"
    method, params = _spec(name)
    note = ",".join(f"{k}={v}" for k, v in params.items())
    return gradzip.register(ddp, method, **params), note


def _done_hook(state, bucket):  # unannotated: DDP refuses an annotation that is a string (this module's)
    """A Python communication hook at its least: the bucket as it is, in a future already done."""
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _count(events, all_threads: bool, steps: int) -> dict:
    names = Counter(e.name for e in events)
    per = lambda n: n / steps  # noqa: E731
    return {"launches": per(sum(c for n, c in names.items() if n.startswith(LAUNCH_PREFIXES))),
            "syncs": per(sum(c for n, c in names.items() if n in SYNC_NAMES)),
            "aten_ops": per(sum(c for n, c in names.items() if n.startswith("aten::"))),
            "host_reads": per(sum(c for n, c in names.items() if n in READ_NAMES or n.startswith("aten::unique"))),
            "all_threads": all_threads}


def _contender(name: str, cfg: dict, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Build a fresh model, DDP and optimizer, install ``name`` and measure; raises what the step raises."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    snapshot = cfg.get("memory_snapshot") if cuda else None
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    torch.manual_seed(cfg["seed"])
    model = _model(cfg).to(device)
    ddp = DDP(model, device_ids=[device.index] if cuda else None, bucket_cap_mb=cfg["bucket_mb"])
    state, note = _attach(name, ddp)
    momentum = state is not None and state.compressor.applies_momentum
    opt = (torch.optim.SGD(model.parameters(), lr=1e-3) if momentum
           else torch.optim.AdamW(model.parameters(), lr=3e-4))
    if momentum:
        note = ",".join(filter(None, [note, "SGD"]))
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["amp"] == "bf16")

    def step():
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = F.cross_entropy(ddp(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()

    def timed() -> float:
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        return 1e3 * (time.perf_counter() - start)

    try:
        first = timed()
        for _ in range(cfg["warmup"]):
            step()
        # Kernels the bucket route compiles ahead, on a thread of its own, may still be compiling: waited
        # for, so that the timed steps run them (a user's steps take the reference path meanwhile).
        start = time.perf_counter()
        kernels.settle()
        compile_wait = 1e3 * (time.perf_counter() - start)
        if compile_wait > 1:
            step()
        if snapshot:  # the history's stack captures would slow the timed steps: it stops here
            os.makedirs(snapshot, exist_ok=True)
            torch.cuda.memory._dump_snapshot(os.path.join(snapshot, f"{name}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
        times = [timed() for _ in range(cfg["steps"])]
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        config = _all_threads_config()
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        if cuda:
            torch.cuda.synchronize(device)
        with warnings.catch_warnings():  # "Profiler clears events at the end of each cycle": one cycle here
            warnings.filterwarnings("ignore", message=".*Profiler clears events")
            with torch.profiler.profile(activities=activities, experimental_config=config) as prof:
                for _ in range(cfg["profile_steps"]):
                    step()
        if cuda:
            torch.cuda.synchronize(device)
        counts = _count(prof.events(), config is not None, cfg["profile_steps"])
    finally:
        if state is not None:
            state.close()
    return {"ms": statistics.median(times), "min_ms": min(times), "first_ms": first, "peak_mb": peak,
            "compile_wait_ms": compile_wait, "note": note, "pid": os.getpid(), **counts}


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


#: A repeat's own numbers for one contender (what a child process hands back).
RUN_KEYS = ("method", "repeat", "pid", "error", "ms", "min_ms", "first_ms", "peak_mb", "compile_wait_ms", "note",
            "launches", "syncs", "aten_ops", "host_reads", "all_threads")


def _child_argv(name: str, cfg: dict, device: torch.device, json_path: str) -> list:
    """The command line that measures contender ``name`` alone in a fresh process."""
    argv = [sys.executable, "-m", "gradzip", "bench", "step", "--no-isolate", "--repeats", "1",
            "--device", str(device), "--methods", name, "--json", json_path, "--seed", str(cfg["seed"]),
            "--bucket-mb", repr(cfg["bucket_mb"]), "--profile-steps", str(cfg["profile_steps"])]
    if cfg.get("memory_snapshot"):
        argv += ["--memory-snapshot", cfg["memory_snapshot"]]
    for key in ("width", "depth", "context", "batch", "vocab", "steps", "warmup", "amp"):
        argv += [f"--{key}", str(cfg[key])]
    return argv


def _child(name: str, cfg: dict, device: torch.device) -> tuple:
    """Run ``name`` in a child process; returns (its row, its env or None).  A child that exits non-zero or
    writes no row is an error row with the last line of its stderr."""
    fd, path = tempfile.mkstemp(prefix="gradzip_step_", suffix=".json")
    os.close(fd)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(gradzip.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))  # this very gradzip
    try:
        proc = subprocess.run(_child_argv(name, cfg, device, path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
        data = None
        if proc.returncode == 0:
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = None
        runs = (data or {}).get("runs") or []
        if runs:
            return {k: v for k, v in runs[0].items() if k in RUN_KEYS}, data.get("env")
        last = next((line.strip() for line in reversed(proc.stderr.splitlines()) if line.strip()), "no output")
        return {"method": name, "error": f"child exited {proc.returncode}: {last}"[:200]}, None
    finally:
        os.unlink(path)


def _ratios(mine: list, base: dict) -> list:
    """Per repeat, this contender's ms over the baseline's in the same repeat (where both ran)."""
    return [r["ms"] / base[r["repeat"]] for r in mine if base.get(r["repeat"])]


def _aggregate(runs: list, names: Sequence[str]) -> list:
    """One row per contender from every repeat's rows: medians, range, spread and per-repeat ratios."""
    def baseline(name):
        return {r["repeat"]: r["ms"] for r in runs if r["method"] == name and "ms" in r}

    dense, fp16, powersgd = baseline("ddp"), baseline("torch-fp16"), baseline("torch-powersgd")
    rows = []
    for name in names:
        mine = [r for r in runs if r["method"] == name]
        failed = [r for r in mine if "error" in r]
        if failed:
            error = failed[0]["error"] + (f" ({len(failed)} of {len(mine)} repeats)" if len(mine) > 1 else "")
            rows.append({"method": name, "error": error})
            continue

        def median(key):
            values = [r.get(key) for r in mine]
            return None if None in values else statistics.median(values)

        ms = [r["ms"] for r in mine]
        peaks = [r["peak_mb"] for r in mine]
        x_ddp, x_fp16 = _ratios(mine, dense), _ratios(mine, fp16)
        x_powersgd = _ratios(mine, powersgd) if name.partition(":")[0] == "powersgd" else []
        rows.append({"method": name, "ms": statistics.median(ms), "min_ms": min(r["min_ms"] for r in mine),
                     "first_ms": median("first_ms"), "compile_wait_ms": median("compile_wait_ms"), "peak_mb": None if None in peaks else max(peaks),
                     "note": mine[0]["note"], **{k: median(k) for k in ("launches", "syncs", "aten_ops", "host_reads")},
                     "all_threads": all(r["all_threads"] for r in mine),
                     "x_ddp": statistics.median(x_ddp) if x_ddp else None,
                     "x_fp16": statistics.median(x_fp16) if x_fp16 else None,
                     **({"x_torch_powersgd": statistics.median(x_powersgd)} if x_powersgd else {}),
                     "repeats": len(mine), "ms_lo": min(ms), "ms_hi": max(ms), "spread": max(ms) / min(ms) - 1})
    return rows


def _checked_config(device_type: str, options: dict, profile_steps: int, memory_snapshot=None) -> dict:
    """:data:`DEFAULTS` for the device overridden by ``options``, or a one-line ValueError."""
    if memory_snapshot and device_type != "cuda":
        raise ValueError("--memory-snapshot records the CUDA allocator's history: it needs --device cuda")
    cfg = {**defaults(device_type), **{k: v for k, v in options.items() if v is not None}}
    unknown = set(cfg) - set(DEFAULTS["cpu"])
    if unknown:
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))}")
    if cfg["amp"] not in ("bf16", "none"):
        raise ValueError(f"amp must be 'bf16' or 'none', got {cfg['amp']!r}")
    for key in ("width", "depth", "context", "batch", "vocab", "steps", "profile_steps"):
        value = profile_steps if key == "profile_steps" else cfg[key]
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    if not isinstance(cfg["warmup"], int) or cfg["warmup"] < 0:
        raise ValueError(f"warmup must be an integer >= 0, got {cfg['warmup']!r}")
    return {**cfg, "memory_snapshot": memory_snapshot}


def _checked_names(methods: Optional[Sequence[str]]) -> list:
    """The contenders (default: every one but the probes), or a one-line ValueError for a bad one."""
    valid = list(BASELINES) + list(PROBES) + gradzip.compressors()
    names = list(methods) if methods else [m for m in valid if m not in PROBES]
    bad = [m for m in names if m.partition(":")[0] not in valid]
    if bad:
        raise ValueError(f"unknown method(s) {', '.join(bad)}; valid: {', '.join(valid)}")
    for name in names:
        if ":" in name:
            if name.partition(":")[0] not in gradzip.compressors():
                raise ValueError(f"{name}: only gradzip's methods take parameters (NAME:KEY=VALUE,...)")
            _spec(name)  # an unknown parameter or a bad value: refused now, not as a row
    if len(set(names)) < len(names):
        raise ValueError(f"a contender is named twice in {', '.join(names)}")
    return names


def run(methods: Optional[Sequence[str]] = None, *, device: Optional[str] = None, seed: int = 0,
        bucket_mb: float = 25.0, profile_steps: int = 2, repeats: int = 1, isolate: Optional[bool] = None,
        memory_snapshot: Optional[str] = None, progress: Optional[Callable[[str], None]] = None, **options) -> dict:
    """Run every contender ``repeats`` times in turn; returns a JSON-ready dict (see :func:`format_table`).
    ``isolate`` (default: at world size 1) runs each contender in a process of its own.  ``options``
    override :data:`DEFAULTS` (width, depth, context, batch, vocab, steps, warmup, amp).  ``memory_snapshot``
    (CUDA): a folder for each contender's allocator history of its first and warm-up steps (NAME.pickle)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if isolate is None:
        isolate = _world_size() == 1
    if isolate and _world_size() > 1:
        raise ValueError("--isolate runs at world size 1 only (under torchrun use --no-isolate)")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch sees no CUDA GPU")
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", dev.index or 0)))
        if not isolate:  # the parent of isolated runs touches no GPU memory
            torch.cuda.set_device(dev)
    cfg = _checked_config(dev.type, options, profile_steps, memory_snapshot)
    cfg.update(seed=seed, bucket_mb=bucket_mb, profile_steps=profile_steps)
    names = _checked_names(methods)

    def tell(name, repeat):
        if progress and (isolate or dist.get_rank() == 0):
            progress(f"{name} ..." if repeats == 1 else f"{name} (repeat {repeat + 1} of {repeats}) ...")

    runs, env = [], None
    if isolate:
        for repeat in range(repeats):
            for name in names:
                tell(name, repeat)
                row, child_env = _child(name, cfg, dev)
                runs.append({**row, "repeat": repeat})
                if progress:  # as each arrives: a run cut short by a timeout still shows what it measured
                    said = row.get("error") or ", ".join(
                        f"{k} {row[k]:.1f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                        for k in ("ms", "min_ms", "first_ms", "compile_wait_ms", "peak_mb", "launches", "syncs", "host_reads")
                        if row.get(k) is not None)
                    progress(textwrap.fill(said, WIDTH, initial_indent="  ", subsequent_indent="    ",
                                           break_on_hyphens=False))
                env = env or child_env
        env = {**(env or {**machine(dev), "world_size": 1, "backend": "nccl" if dev.type == "cuda" else "gloo"})}
    else:
        owned = _init_group(dev)
        try:
            gen = torch.Generator().manual_seed(seed)
            tokens = torch.randint(cfg["vocab"], (cfg["batch"], cfg["context"] + 1), generator=gen).to(dev)
            x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
            # The process's own first steps (thread pools, CUDA context and kernels, allocator) would
            # otherwise land on the first contender: an untimed plain-DDP run takes them.
            _contender("ddp", {**cfg, "steps": 1, "warmup": 1, "profile_steps": 1, "memory_snapshot": None}, dev, x, y)
            for repeat in range(repeats):
                for name in names:
                    tell(name, repeat)
                    try:
                        row = {"method": name, "repeat": repeat, **_contender(name, cfg, dev, x, y)}
                    except Exception as exc:  # a broken contender is a row, not the end of the table
                        msg = (str(exc).strip().splitlines() or [""])[0]
                        row = {"method": name, "repeat": repeat, "error": f"{type(exc).__name__}: {msg}"[:200]}
                    runs.append(row)
                    gc.collect()
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
            env = {**machine(dev), "world_size": dist.get_world_size(), "backend": dist.get_backend()}
        finally:
            if owned:
                dist.destroy_process_group()
    env["command"] = " ".join(getattr(sys, "orig_argv", sys.argv))
    with torch.device("meta"):
        params = sum(p.numel() for p in _model(cfg).parameters())
    config = {**cfg, "parameters": params, "repeats": repeats, "isolate": isolate}
    return {"env": env, "config": config, "rows": _aggregate(runs, names), "runs": runs}


def _fmt(value, spec: str) -> str:
    """``value`` in ``spec`` (a width first), or a right-aligned "-" of that width for None."""
    return format(value, spec) if value is not None else "-".rjust(int(spec.split(".")[0]))


def _count_text(value: float, width: int) -> str:
    """A per-step count: whole where it is (most are), else with one decimal (0.5: once in two steps)."""
    return f"{value:{width}.0f}" if value == int(value) else f"{value:{width}.1f}"


#: The table's width in columns (header, rows and legend wrap or break to fit).
WIDTH = 100


def _spread(row: dict) -> str:
    return f"{100 * row['spread']:5.1f}%" if row.get("repeats", 1) > 1 else "-".rjust(6)


def format_table(result: dict) -> str:
    env, c = result["env"], result["config"]
    cuda = env["device"].startswith("cuda")
    repeats = c.get("repeats", 1)
    how = ("each contender in a process of its own" if c.get("isolate") else "all contenders in one process")
    lines = [f"gradzip step benchmark: {env.get('gpu') or env['cpu']}, torch {env['torch']}, world size "
             f"{env['world_size']} ({env['backend']}); GPT {c['parameters']:,} parameters (width "
             f"{c['width']}, depth {c['depth']}, context {c['context']}, vocab {c['vocab']}), batch {c['batch']}, "
             f"amp {c['amp']}, buckets {c['bucket_mb']:g} MB; median of {c['steps']} steps after "
             f"{c['warmup']} + 1 warm-up"
             + (f"; median of {repeats} repeats (ratios within each repeat)" if repeats > 1 else "")
             + f"; {how}"]
    lines = textwrap.wrap(lines[0], WIDTH, break_on_hyphens=False) + [""]
    count = (("launches", 8), ("syncs", 6)) if cuda else (("aten_ops", 8),)
    w = max([16] + [len(r["method"]) for r in result["rows"]])
    head = (f"{'method':{w}s} {'ms/step':>8s} {'spread':>6s} {'x DDP':>6s} {'x fp16':>6s} {'first ms':>8s} "
            f"{'peak MB':>7s}")
    head += "".join(f" {h:>{n}s}" for h, n in count) + f" {'reads':>5s}  note"
    lines.append(head)
    for r in result["rows"]:
        if "error" in r:
            lines += textwrap.wrap(f"{r['method']:{w}s} error: {r['error']}", WIDTH, subsequent_indent=" " * (w + 1),
                                   break_on_hyphens=False)
            continue
        line = (f"{r['method']:{w}s} {r['ms']:8.2f} {_spread(r)} {_fmt(r['x_ddp'], '6.2f')} "
                f"{_fmt(r.get('x_fp16'), '6.2f')} {r['first_ms']:8.1f} {_fmt(r['peak_mb'], '7.0f')}")
        line += "".join(" " + _count_text(r[k], n) for k, n in count) + f" {_count_text(r['host_reads'], 5)}"
        if r.get("x_torch_powersgd") is not None:
            r = {**r, "note": "; ".join(filter(None, [r["note"], f"{r['x_torch_powersgd']:.2f}x torch-powersgd"]))}
        if len(line) + 2 + len(r["note"]) <= WIDTH:
            lines.append(f"{line}  {r['note']}".rstrip())
        else:  # a long note (DGC's parameters) on a line of its own, keeping the table in WIDTH columns
            lines += [line, " " * (w + 1) + f"note: {r['note']}"]
    all_threads = all(r.get("all_threads", True) for r in result["rows"])
    lines += ["", "ms/step: median of the timed steps, each between two synchronisations"
              + (f", then the median over {repeats} repeats; spread: slowest repeat over fastest - 1; x DDP, "
                 "x fp16 (over torch-fp16): ratios within each repeat, then their median" if repeats > 1 else
                 "; x fp16: over torch-fp16")
              + (" (a PowerSGD row's note: over torch-powersgd)" if any("x_torch_powersgd" in r for r in result["rows"])
                 else "")
              + "; first ms: the first step; peak MB: max_memory_allocated; per step, from torch.profiler over "
              f"{c['profile_steps']} steps ({'all threads' if all_threads else 'the calling thread only'}): "
              + ("launches: cuda*LaunchKernel* calls, syncs: stream/device/event synchronize and synchronous "
                 "memcpy calls" if cuda else "aten_ops: aten:: operations, nested included")
              + "; reads: _local_scalar_dense (item, bool), nonzero, masked_select, unique*"]
    lines[-1:] = textwrap.wrap(lines[-1], WIDTH, break_on_hyphens=False)
    return "\n".join(lines)


def main(methods: Optional[Sequence[str]] = None, *, json_out: Optional[str] = None, echo=print, **kwargs) -> dict:
    result = run(methods, progress=echo, **kwargs)
    if result["env"]["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        report(result, format_table(result), json_out, echo)
    return result
