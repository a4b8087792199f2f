"""The cost model: projected step time of data-parallel training with any gradzip method, for any N.

Alpha-beta (Hockney, Parallel Computing 1994) costs of ring collectives over N workers, with latency
alpha (seconds per message) and bandwidth beta (bytes/s) per link (Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005; Patarasuk & Yuan, JPDC 2009
for the bandwidth-optimal ring)::

    allreduce of B bytes:                         2(N-1)·alpha + 2(N-1)/N · B/beta
    allgather, every worker contributing B bytes: (N-1)·alpha + (N-1) · B/beta
    N = 1:                                        0

One training step of a method::

    T(N) = T_compute + T_codec(N) + (1 - overlap) · sum over buckets and their collectives of T_coll(N)

The collectives are not hand-written formulas: :func:`profile_method` runs real exchanges of the model's
gradients through :class:`~gradzip.state.GradzipState` with a :class:`RecordingTransport`, which logs
every fused collective gradzip issues (size headers and the non-finite flag included, multi-phase
protocols phase by phase), one lockstep exchange per DDP bucket (:func:`ddp_buckets`).  ``T_codec`` is
gradzip's own time per step (compression, decoding, error feedback, fusion copies, the non-finite scan),
measured at world size 1 and, for methods that allgather, again with N_ref mirrored payloads: decoding N
payloads grows linearly in N.  ``overlap`` is the fraction of communication hidden behind backward
(default 0: none).

Calibration: :func:`measure_link` fits alpha and beta (:func:`fit_link`) to timed allreduces over a
real process group (an emulated cluster when given a netem spec); :func:`measure_compute` times the
model's forward/backward/step in this process.

Not modelled: algorithms other than the ring (NCCL and gloo switch to trees or halving-doubling for small
messages or many ranks, with log N latency, so latency-bound projections at large N are pessimistic);
the padding of uneven allgathers to the largest rank's payload (data-dependent methods); congestion
between hosts; stragglers.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .collectives import LocalTransport
from .launcher import run_workers
from .state import GradzipState

__all__ = ["Link", "fit_link", "Collective", "RecordingTransport", "ddp_buckets", "MethodProfile",
           "profile_method", "Timeline", "step_time", "outer_step_time", "project", "format_projection",
           "fit_overlap", "Compute", "measure_compute", "measure_compute_of",
           "time_allreduces", "measure_link", "DEFAULT_ALPHA", "WORKER_COUNTS"]

#: Per-message latency used when only a bandwidth is given.  gloo over TCP between two idle processes
#: measured 25-140 us here (loopback, emulated 1 Gbit/s link); LANs add tens of microseconds at most.
DEFAULT_ALPHA = 100e-6
#: Worker counts of the projection tables.
WORKER_COUNTS = tuple(2**i for i in range(1, 11))
#: Step and epoch at which methods are profiled: past every warm-up (PowerSGD's dense steps, DGC's epochs).
STEADY_STEP = 1_000_000
#: Link calibration: allreduce sizes in bytes (from latency- to bandwidth-dominated on 100 Mbit/s-10 Gbit/s).
LINK_SIZES = (4 << 10, 64 << 10, 512 << 10, 2 << 20, 4 << 20)


# ---------------------------------------------------------------------------------------- the link


@dataclass(frozen=True)
class Link:
    """One worker's link: ``alpha`` seconds per message, ``beta`` bytes per second."""

    alpha: float
    beta: float

    def __post_init__(self):
        if not (math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0 (seconds), got {self.alpha!r}")
        if not (self.beta > 0):
            raise ValueError(f"beta must be > 0 (bytes/s), got {self.beta!r}")

    @classmethod
    def from_rate(cls, rate, alpha: Optional[float] = None) -> "Link":
        """``Link.from_rate("1gbit")`` (netem rate syntax) or bits/s; alpha defaults to :data:`DEFAULT_ALPHA`."""
        if isinstance(rate, str):
            from .netem import parse_netem

            bps = parse_netem(f"rate={rate}").rate_bps
            if bps is None:
                raise ValueError(f"bandwidth must be finite, e.g. '1gbit', got {rate!r}")
        else:
            bps = float(rate)
        return cls(DEFAULT_ALPHA if alpha is None else float(alpha), bps / 8)

    def allreduce(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * nbytes / self.beta

    def allgather(self, nbytes: float, n: int) -> float:
        if n <= 1:
            return 0.0
        return (n - 1) * self.alpha + (n - 1) * nbytes / self.beta

    def cost(self, collectives: Iterable["Collective"], n: int) -> float:
        """Seconds for these collectives, one after the other."""
        return sum(self.allreduce(c.nbytes, n) if c.kind == "allreduce" else self.allgather(c.nbytes, n)
                   for c in collectives)

    def __str__(self) -> str:
        return f"alpha={self.alpha * 1e6:.0f} us, beta={self.beta * 8 / 1e6:.4g} Mbit/s"


def fit_link(points: Iterable[tuple[int, float, float]]) -> Link:
    """Weighted least-squares alpha and beta from timed allreduces ``(workers, bytes, seconds)``.

    The model is linear in (alpha, 1/beta): t = 2(N-1)·alpha + 2(N-1)/N·B · (1/beta).  Rows are weighted
    by 1/sqrt(t), between absolute errors (the largest transfer alone would decide alpha) and relative
    ones (small, latency-bound messages, the noisiest on a shared machine, would decide beta).  A
    negative alpha (small messages beating the line rate, e.g. in a token bucket's burst) is clamped to
    0 and beta refitted.
    """
    rows = [(2 * (n - 1), 2 * (n - 1) / n * b, t) for n, b, t in points if n > 1]
    if len(rows) < 2 or len({r[1] for r in rows}) < 2:
        raise ValueError("fit_link needs timings of at least two sizes with more than one worker")
    x = np.array([r[:2] for r in rows], dtype=float)
    t = np.array([r[2] for r in rows], dtype=float)
    if not (np.all(np.isfinite(t)) and np.all(t > 0)):
        raise ValueError("fit_link needs positive finite times")
    w = 1 / np.sqrt(t)
    xw, tw = x * w[:, None], t * w
    alpha, inv_beta = np.linalg.lstsq(xw, tw, rcond=None)[0]
    if alpha < 0:
        alpha, inv_beta = 0.0, float(xw[:, 1] @ tw / (xw[:, 1] @ xw[:, 1]))
    if not inv_beta > 0:
        raise ValueError("the timings do not grow with the size: use larger sizes to measure bandwidth")
    return Link(float(alpha), float(1 / inv_beta))


# --------------------------------------------------------------------- what gradzip puts on the wire


class Collective(NamedTuple):
    """One fused collective: ``kind`` is "allreduce" or "allgather", ``nbytes`` what each worker hands in."""

    kind: str
    nbytes: int


class RecordingTransport(LocalTransport):
    """Logs every fused collective's kind and size; with ``world_size`` > 1, mirrors this worker's data.

    Mirroring (the allreduce returns N times the input, the allgather N copies) lets a single process
    time decoding and combining N workers' payloads exactly as a real rank does.
    """

    def __init__(self, world_size: int = 1):
        self.world_size = int(world_size)
        self.log: list[Collective] = []

    def allreduce(self, flat, op):
        self.log.append(Collective("allreduce", flat.numel() * flat.element_size()))
        return flat * self.world_size if op == "sum" and self.world_size > 1 else flat

    def allgather(self, flat):
        self.log.append(Collective("allgather", flat.numel() * flat.element_size()))
        return [flat] * self.world_size


def ddp_buckets(named_sizes: Sequence[tuple[str, int]], bucket_cap_mb: float = 25.0,
                first_bucket_mb: Optional[float] = 1.0) -> list[list[str]]:
    """DDP's gradient buckets after its first-iteration rebuild: names per bucket, in launch order.

    ``named_sizes``: (name, gradient bytes) in parameter order.  DDP fills buckets in the order gradients
    become ready (it assumes the reverse of parameter order) and closes one as soon as it reaches its cap:
    1 MiB for the first (``dist._DEFAULT_FIRST_BUCKET_BYTES``, only when DDP's ``bucket_cap_mb`` is left at
    its default), ``bucket_cap_mb`` MiB after (torch/csrc/distributed/c10d/reducer.cpp,
    compute_bucket_assignment_by_size).  gradzip's hook issues one lockstep exchange per bucket.
    """
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    caps = [int(first_bucket_mb * 2**20)] if first_bucket_mb else []
    caps.append(int(bucket_cap_mb * 2**20))
    buckets, current, size = [], [], 0
    for name, nbytes in reversed(list(named_sizes)):
        current.append(name)
        size += nbytes
        if size >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass
class MethodProfile:
    """One method on one model: its collectives and its own (codec) time, per bucket, per step.

    ``buckets``: the collectives of each bucket's exchange at steady state; ``bucket_names``: the
    gradients in each bucket.  ``bucket_codec_s``: gradzip's time per bucket at world size 1 (the
    exchange's wall time minus its collectives); ``bucket_codec_per_worker_s``: the extra time per
    additional worker (decoding allgathered payloads; 0 for allreduce-only methods).
    """

    method: str
    params: dict
    buckets: list[list[Collective]]
    bucket_names: list[list[str]]
    dense_bytes: int
    bucket_codec_s: list[float]
    bucket_codec_per_worker_s: list[float]
    density: float = float("nan")
    label: str = ""

    def __post_init__(self):
        if not self.label:
            args = ",".join(f"{k}={v}" for k, v in self.params.items())
            self.label = f"{self.method}({args})" if args else self.method

    @property
    def collectives(self) -> list[Collective]:
        return [c for bucket in self.buckets for c in bucket]

    @property
    def wire_bytes(self) -> int:
        return sum(c.nbytes for c in self.collectives)

    @property
    def gathers(self) -> bool:
        return any(c.kind == "allgather" for c in self.collectives)

    @property
    def codec_s(self) -> float:
        return sum(self.bucket_codec_s)

    @property
    def codec_per_worker_s(self) -> float:
        return sum(self.bucket_codec_per_worker_s)

    def comm_s(self, link: Link, n: int) -> float:
        return link.cost(self.collectives, n)

    def codec(self, n: int) -> list[float]:
        """Codec seconds of each bucket with ``n`` workers."""
        return [c + w * max(n - 1, 0) for c, w in zip(self.bucket_codec_s, self.bucket_codec_per_worker_s)]


def _exchange_all(state: GradzipState, bucket_grads: list) -> tuple[list[float], list[list[Collective]], float]:
    """One step: every bucket's exchange.  Returns (codec seconds and collectives per bucket, density)."""
    log = state.transport.log
    before = state.stats()
    codec, per_bucket = [], []
    for named in bucket_grads:
        log.clear()
        start = time.perf_counter()
        state.exchange(named)
        codec.append(time.perf_counter() - start - state.last_report.communicate_s)
        per_bucket.append(list(log))
    after = state.stats()
    elements = after["elements"] - before["elements"]
    density = (after["elements_sent"] - before["elements_sent"]) / elements if elements else float("nan")
    return codec, per_bucket, density


def profile_method(named_grads: Sequence[tuple[str, torch.Tensor]], method: str = "none",
                   params: Optional[dict] = None, *, bucket_cap_mb: float = 25.0,
                   first_bucket_mb: Optional[float] = 1.0, repeats: int = 3, reference_workers: int = 16,
                   seed: int = 0, label: str = "") -> MethodProfile:
    """Record and time one training step of ``method`` on these gradients (parameter order).

    The state starts at step and epoch :data:`STEADY_STEP`, past PowerSGD's dense steps and DGC's warm-up;
    a first step fills residuals and bases, then ``repeats`` steps are timed; the fastest counts, as in
    ``timeit``: on a shared machine the others are slower only by what other processes took.  Data-dependent
    sizes (threshold, DGC, dropping) are those of these gradients; a real N-worker allgather pads to the
    largest rank's payload, which this single-worker recording does not see.  Methods that allgather are
    timed again with ``reference_workers`` mirrored payloads: the difference, per extra worker, is the
    cost of decoding one more payload.
    """
    params = dict(params or {})
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    grads = {name: g.detach() for name, g in named_grads}
    buckets = ddp_buckets([(n, g.numel() * g.element_size()) for n, g in grads.items()], bucket_cap_mb,
                          first_bucket_mb)
    bucket_grads = [[(name, grads[name]) for name in bucket] for bucket in buckets]

    def timed_steps(world: int):
        state = GradzipState(method, transport=RecordingTransport(world), seed=seed, **params)
        state.set_epoch(STEADY_STEP)
        state.steps = dict.fromkeys(grads, STEADY_STEP)
        _exchange_all(state, bucket_grads)  # warm-up: residuals, bases, workspaces
        runs = [_exchange_all(state, bucket_grads) for _ in range(repeats)]
        return [min(r[0][b] for r in runs) for b in range(len(buckets))], runs[-1]

    codec1, (_, per_bucket, density) = timed_steps(1)
    per_worker = [0.0] * len(buckets)
    if any(c.kind == "allgather" for b in per_bucket for c in b) and reference_workers > 1:
        codec_ref, _ = timed_steps(reference_workers)
        per_worker = [max(0.0, (r - c) / (reference_workers - 1)) for r, c in zip(codec_ref, codec1)]
    return MethodProfile(method, params, per_bucket, buckets, sum(g.numel() * g.element_size() for g in grads.values()),
                         codec1, per_worker, density=density, label=label)


# ------------------------------------------------------------------------------------- projection


@dataclass(frozen=True)
class Timeline:
    """When, within one local step, each gradient is ready: fractions of the step time, by parameter name.

    DDP hands a bucket to gradzip when its last gradient is ready; the optimizer step waits for every
    bucket after ``backward_end``.
    """

    ready: dict
    backward_end: float

    def bucket_ready(self, names: Sequence[str]) -> float:
        return max((self.ready.get(n, self.backward_end) for n in names), default=self.backward_end)


def step_time(profile: MethodProfile, compute_s: float, link: Link, n: int, overlap: float = 0.0,
              codec_scale: float = 1.0, timeline: Optional[Timeline] = None) -> dict:
    """One step's time and its parts (seconds).

    Without ``timeline``: T = T_compute + T_codec + (1 - overlap)·T_comm.  With it, each bucket's
    communication overlaps the rest of backward: the wire is a FIFO queue where bucket i arrives when its
    gradients are ready (r_i, from the timeline), finish_i = max(r_i, finish_{i-1}) + comm_i, and the step
    ends at max(backward end, finish_last) + the optimizer step + T_codec.  gradzip's own work (codec)
    stays on the critical path: it needs a core, and the workers this models have none to spare.
    ``codec_scale`` stretches the codec time, e.g. by N / cores when N workers share one machine.
    ``hidden_s`` is the communication that overlapped with backward.
    """
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be a fraction in [0, 1], got {overlap!r}")
    codec = sum(profile.codec(n)) * codec_scale
    comms = [link.cost(b, n) for b in profile.buckets]
    comm = sum(comms)
    if timeline is None:
        step = compute_s + codec + (1 - overlap) * comm
    else:
        free = 0.0
        for names, c_comm in zip(profile.bucket_names, comms):
            free = max(free, compute_s * timeline.bucket_ready(names)) + c_comm
        end = compute_s * timeline.backward_end
        step = max(end, free) + compute_s - end + codec
    return {"compute_s": compute_s, "codec_s": codec, "comm_s": comm, "step_s": step,
            "hidden_s": compute_s + codec + comm - step}


def outer_step_time(profile: MethodProfile, compute_s: float, link: Link, n: int, sync_every: int) -> dict:
    """DiLoCo's mean inner step (:class:`gradzip.DiLoCo`): the local step, plus one exchange of the whole
    model through the method (its collectives and codec, as profiled on gradients) every ``sync_every``
    steps.  A sync runs on the caller's thread between steps, so none of it is hidden.  Fragments send
    1/F of the model F times as often: the same bytes per step, F times the latency (not modelled)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    sync = step_time(profile, 0.0, link, n)  # no compute, no overlap: one exchange's codec and communication
    codec, comm = sync["codec_s"] / sync_every, sync["comm_s"] / sync_every
    return {"compute_s": compute_s, "codec_s": codec, "comm_s": comm, "step_s": compute_s + codec + comm,
            "hidden_s": 0.0}


def project(profiles: Sequence[MethodProfile], compute_s: float, link: Link,
            workers: Iterable[int] = WORKER_COUNTS, overlap: float = 0.0,
            timeline: Optional[Timeline] = None) -> list[dict]:
    """One row per (method, N): the step time's parts and the speedup over dense (the ``none`` profile)."""
    dense = next((p for p in profiles if p.method == "none"), None)
    if dense is None:
        raise ValueError("project() needs the dense baseline: include a profile of method 'none'")
    rows = []
    for n in workers:
        base = step_time(dense, compute_s, link, n, overlap, timeline=timeline)["step_s"]
        for p in profiles:
            t = step_time(p, compute_s, link, n, overlap, timeline=timeline)
            rows.append({"label": p.label, "method": p.method, "workers": n, "wire_bytes": p.wire_bytes,
                         "collectives": len(p.collectives), **t, "speedup": base / t["step_s"]})
    return rows


def format_projection(rows: Sequence[dict]) -> str:
    """Markdown: one line per method, one column per N, cells "step ms (speedup vs dense)"."""
    ns = sorted({r["workers"] for r in rows})
    labels = list(dict.fromkeys(r["label"] for r in rows))
    cell = {(r["label"], r["workers"]): r for r in rows}
    lines = ["| method | " + " | ".join(f"N={n}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for label in labels:
        cells = [f"{1e3 * cell[label, n]['step_s']:.0f} ms ({cell[label, n]['speedup']:.2f}x)" for n in ns]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fit_overlap(measured: Sequence[float], without_comm: Sequence[float], comm: Sequence[float]) -> float:
    """Least-squares overlap o in measured = without_comm + (1 - o)·comm, clamped to [0, 1]."""
    rest = np.asarray(measured, float) - np.asarray(without_comm, float)
    comm = np.asarray(comm, float)
    if not comm.size or not comm @ comm > 0:
        raise ValueError("fit_overlap needs runs with communication")
    return float(min(1.0, max(0.0, 1 - rest @ comm / (comm @ comm))))


# ----------------------------------------------------------------------------------- calibration


@dataclass
class Compute:
    """:func:`measure_compute`'s result: seconds per local step, when its gradients are ready, the gradients."""

    seconds: float
    timeline: Timeline
    grads: list


def measure_compute(model: str = "cnn", dataset: str = "fashion-mnist", *, batch_size: int = 32, steps: int = 10,
                    warmup: int = 3, data_dir: Optional[str] = None, seed: int = 0, **model_options) -> Compute:
    """Time local steps (zero_grad, forward, backward, SGD step; no communication) of ``model`` on batches
    of ``dataset`` in this process, with its thread count.

    The fastest of ``steps`` timed steps counts (see :func:`profile_method`), with the moments its
    gradients became ready (post-accumulate-grad hooks) as its :class:`Timeline`; the gradients of the
    last step come along for profiling.
    """
    from .harness.data import load_dataset
    from .harness.models import build_model

    _check_steps(steps, warmup)
    data, info = load_dataset(dataset, train=True, data_dir=data_dir)
    torch.manual_seed(seed)
    net = build_model(model, info, **model_options)
    language_model = info.task == "language_model"

    def batch(i):
        lo = (i * batch_size) % max(1, len(data) - batch_size)
        return data[lo: lo + batch_size]

    def loss(net, batch):
        x, y = batch
        out = net(x)
        if language_model:
            out, y = out.reshape(-1, out.shape[-1]), y.reshape(-1)
        return torch.nn.functional.cross_entropy(out, y)

    return _time_steps(net, batch, loss, steps, warmup)


def measure_compute_of(net: torch.nn.Module, batch, loss_fn, *, steps: int = 10, warmup: int = 3) -> Compute:
    """:func:`measure_compute` for any model: ``loss_fn(net, batch)`` (forward and loss) on the same
    ``batch`` every step, where ``net``'s parameters are (CUDA steps are synchronised before they are
    read).  ``net`` is left as it was: parameters, buffers, gradients and train/eval mode."""
    _check_steps(steps, warmup)
    saved = {k: v.detach().clone() for k, v in net.state_dict().items()}
    grads = {p: p.grad for p in net.parameters()}
    training = net.training
    try:
        net.train()
        return _time_steps(net, lambda i: batch, loss_fn, steps, warmup)
    finally:
        net.load_state_dict(saved)
        for p, g in grads.items():
            p.grad = g
        net.train(training)


def _check_steps(steps, warmup) -> None:
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps!r}, warmup={warmup!r}")


def _time_steps(net: torch.nn.Module, batch_at, loss_of, steps: int, warmup: int) -> Compute:
    """The fastest of ``steps`` local SGD steps (after ``warmup``) of ``loss_of(net, batch_at(i))``.  On
    CUDA the moments are CUDA events (the host runs ahead of the device), read once the step is done."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    device = next((p.device for p in net.parameters()), torch.device("cpu"))
    clock, since, sync = _clock(device)
    stamps: dict = {}
    hooks = [p.register_post_accumulate_grad_hook(lambda p, name=name: stamps.__setitem__(name, clock()))
             for name, p in net.named_parameters() if p.requires_grad]
    best = None
    try:
        for i in range(warmup + steps):
            batch = batch_at(i)
            sync()
            start = clock()
            opt.zero_grad()
            loss_of(net, batch).backward()
            backward_end = clock()
            opt.step()
            end = clock()
            sync()
            total = since(start, end)
            if i >= warmup and (best is None or total < best.seconds):
                ready = {name: since(start, t) / total for name, t in stamps.items()}
                best = Compute(total, Timeline(ready, since(start, backward_end) / total), [])
    finally:
        for h in hooks:
            h.remove()
    best.grads = [(name, p.grad.detach().clone()) for name, p in net.named_parameters() if p.grad is not None]
    return best


def _clock(device: torch.device):
    """(now, seconds between two nows, wait for the device) on ``device``."""
    if device.type != "cuda":
        return time.perf_counter, lambda a, b: b - a, lambda: None

    def now():  # on the model's device's stream: the thread's current device may be another GPU
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    return now, lambda a, b: a.elapsed_time(b) / 1e3, lambda: torch.cuda.synchronize(device)


def _wait(t: torch.Tensor) -> None:
    """Until ``t``'s device has done what is queued on it: NCCL returns before the bytes have moved."""
    if t.is_cuda:
        torch.cuda.synchronize(t.device)


def time_allreduces(sizes: Sequence[int] = LINK_SIZES, repeats: int = 3, min_time: float = 0.05,
                    group: Optional[dist.ProcessGroup] = None,
                    device: Optional[torch.device] = None) -> list[tuple[int, int, float]]:
    """Run inside every worker: ``(workers, bytes, seconds)`` per size, identical on every rank, with
    tensors on ``device`` (default: the CPU; a group of NCCL alone takes CUDA tensors only).

    Each size is timed at least ``repeats`` times and, for small ones, until about ``min_time`` seconds
    (at most 30 times): small messages are the noisiest and the cheapest to repeat.  The time of a size is
    the slowest rank's median.  The repeat count comes from the first (untimed) run's slowest rank, so
    every rank issues the same number of collectives.
    """
    world = dist.get_world_size(group)
    points = []
    for nbytes in sizes:
        buf = torch.zeros(max(1, int(nbytes) // 4), device=device)
        dist.barrier(group=group)
        start = time.perf_counter()
        dist.all_reduce(buf, group=group)
        _wait(buf)
        first = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
        count = min(30, max(repeats, math.ceil(min_time / max(float(first), 1e-6))))
        times = []
        for _ in range(count):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            _wait(buf)
            times.append(time.perf_counter() - start)
        slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        points.append((world, buf.numel() * 4, float(slowest)))
    return points


def _link_worker(rank, world, sizes, repeats):
    return time_allreduces(sizes, repeats)


def measure_link(workers: int = 2, netem: Optional[str] = None, sizes: Sequence[int] = LINK_SIZES,
                 repeats: int = 3, timeout: float = 180.0) -> tuple[Link, list]:
    """Fit alpha and beta to allreduces between ``workers`` local processes: over an emulated cluster
    when ``netem`` is given (e.g. "rate=100mbit"; needs root), else over loopback.  Returns (link, points)."""
    if workers < 2:
        raise ValueError(f"measuring a link needs workers >= 2, got {workers!r}")
    points = run_workers(_link_worker, workers, tuple(sizes), repeats, netem=netem, timeout=timeout)
    return fit_link(points), points
