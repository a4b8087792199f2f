"""``gradzip advise``: which method trains this model fastest on this link, and at what accuracy risk.

It measures what the cost model (gradzip/costmodel.py) needs — the model's compute time per step, the
link's alpha and beta (or takes a given bandwidth), each method's collectives and codec time — and ranks
the methods by projected step time at N workers, with the speedup over dense and a static accuracy-risk
rating from the literature (:func:`accuracy_risk`).
"""
from __future__ import annotations

import math
import os
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from . import costmodel as cost
from .compressors import make, parse_spec
from .costmodel import Link
from .feedback import NoFeedback, scheme_of

__all__ = ["advise", "accuracy_risk", "format_advice", "DEFAULT_METHODS"]

DEFAULT_METHODS = ("none", "fp16", "bf16", "powersgd:rank=2", "topk:ratio=0.01", "randomk:ratio=0.01",
                   "dgc:ratio=0.001", "qsgd:levels=1", "qsgd:levels=7", "terngrad", "natural", "efsignsgd",
                   "signsgd")

_GRACE = "biased, no error feedback: Top-k 1% got 42.5% top-1 without it, 73.0% with it (GRACE, ResNet-50)"
_SPARSE = ("medium", "biased sparsifier with error feedback: converges (Stich et al. 2018), may lose a little",
           "high", _GRACE)
_LEVELS = ("low", "medium", "high", "unknown")
_DILOCO = ("DiLoCo on 8 workers performed as well as fully synchronous training, communicating 500x less "
           "(Douillard et al. 2023, C4 language models)")
# method -> (risk with error feedback, why, risk without, why).  Sources: the papers cited in each reason.
_RULES = {
    "none": ("low", "exact average") * 2,
    "fp16": ("low", "16-bit rounding of the average (as PyTorch's fp16 hook)") * 2,
    "bf16": ("low", "8-bit-mantissa rounding of the average") * 2,
    "natural": ("low", "unbiased, variance at most 9/8 of the input's (Horvath et al. 2019)") * 2,
    "terngrad": ("medium", "unbiased 2-bit; small losses on AlexNet/GoogLeNet (Wen et al. 2017)") * 2,
    "powersgd": ("low", "rank 2 with error feedback matched SGD (Vogels et al. 2019)",
                 "high", "without error feedback the low-rank truncation error is dropped every step"),
    "topk": _SPARSE, "randomk": _SPARSE, "dropping": _SPARSE, "dgc": _SPARSE, "csc": _SPARSE,
    "threshold": ("medium", "biased sparsifier with error feedback; tau is static, hard to tune (Strom 2015)",
                  "high", _GRACE),
    "onebit": ("medium", "1-bit with error feedback (Seide et al. 2014)",
               "high", "1-bit SGD diverges without error feedback (Seide et al. 2014)"),
    "efsignsgd": ("medium", "error feedback fixes signSGD's bias (Karimireddy et al. 2019)", "high", _GRACE),
    "signsgd": ("high", "biased majority vote without error feedback (scaled to the mean |g| by default): can "
                        "fail to converge, generalises worse (Karimireddy et al. 2019)") * 2,
    "signum": ("high", "biased sign of momentum without error feedback, as signSGD (Karimireddy et al. 2019)") * 2,
    "sparseloco": ("medium", "chunked top-k with 2-bit values and decaying error feedback; made for the outer "
                             "loop, where it beat full-precision DiLoCo (Sarfi et al. 2025)") * 2,
    "adaptive_threshold": ("medium", "sparsifier sending one mean per sign with error feedback; close to SGD on "
                                     "small networks (Dryden et al. 2016)", "high", _GRACE),
    "sketch": ("medium", "count-sketch top-k with error feedback; near-SGD accuracy reported (Ivkin et al. 2019, "
                         "Rothchild et al. 2020)", "high", _GRACE),
}


def accuracy_risk(method: str, params: Optional[dict] = None, density: Optional[float] = None) -> tuple[str, str]:
    """(low | medium | high | unknown, why): a static rating from the literature, not a measurement.

    Error feedback decides most ratings (GRACE: it is what makes biased compressors work); QSGD is rated
    by its bits per element (4-bit QSGD matched full precision in Alistarh et al. 2017, 2-bit lost some);
    a sparsifier that sends under 0.01% of the elements (``density``, e.g. a threshold tau set too high)
    is rated high: its updates wait in the residual for many steps.
    """
    params = dict(params or {})
    if method == "auto":  # it may end up using any candidate: rate its riskiest one
        auto = make(method, **params)
        rated = [(accuracy_risk(name, {**p, "feedback": auto.feedback}), spec)
                 for spec in auto.candidates for name, p in [parse_spec(spec)]]
        (risk, why), spec = max(rated, key=lambda r: _LEVELS.index(r[0][0]))
        return risk, f"may choose {spec}: {why}"
    if method not in _RULES and method != "qsgd":
        return "unknown", "not in the rule table"
    feedback = not isinstance(scheme_of(make(method, **params)), NoFeedback)
    if method == "qsgd":
        bits = math.ceil(math.log2(params.get("levels", 1) + 1)) + 1
        if bits >= 4:
            return "low", f"unbiased {bits}-bit; 4-bit QSGD matched full precision (Alistarh et al. 2017)"
        return "medium", f"unbiased {bits}-bit; variance min(n/s^2, sqrt(n)/s) grows as levels shrink (Alistarh 2017)"
    if method in ("topk", "randomk", "threshold", "dropping", "dgc", "csc") and density is not None and density < 1e-4:
        return "high", f"sends {density:.1e} of the elements: updates wait in the residual for many steps"
    if method == "randomk" and params.get("unbiased") and not feedback:
        return "high", "unbiased, but the variance grows n/k-fold (100x at 1%) (Stich et al. 2018)"
    risk_ef, why_ef, risk, why = _RULES[method]
    return (risk_ef, why_ef) if feedback else (risk, why)


def torchrun_world_size() -> Optional[int]:
    """The job's world size when this process was started by torchrun (or torch.distributed.run), else None."""
    return int(os.environ["WORLD_SIZE"]) if "TORCHELASTIC_RUN_ID" in os.environ else None


def _measure_this_cluster() -> tuple[Link, int]:
    """(alpha and beta of the real links between this torchrun job's ranks, this rank)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        return cost.fit_link(cost.time_allreduces()), dist.get_rank()
    finally:
        if owned:
            dist.destroy_process_group()


def advise(model: str = "cnn", dataset: str = "fashion-mnist", *, netem: Optional[str] = None,
           bandwidth: Optional[str] = None, alpha: Optional[float] = None, workers: Optional[int] = None,
           methods: Optional[Iterable] = None, outer: Iterable[str] = (), batch_size: int = 32,
           overlap: Optional[float] = None, bucket_cap_mb: float = 25.0, data_dir: Optional[str] = None,
           echo: Optional[Callable[[str], object]] = print) -> list[dict]:
    """Rank ``methods`` for training ``model`` on ``dataset`` with ``workers`` workers; returns the rows.

    The link: ``bandwidth`` (e.g. "1gbit"; alpha = ``alpha`` seconds or :data:`gradzip.costmodel.DEFAULT_ALPHA`)
    needs nothing; under torchrun alpha and beta are fitted to allreduces between the job's ranks, i.e.
    the real cluster's links (every rank must call this; rank 0 prints); otherwise between 2 local
    processes, over an emulated ``netem`` link (e.g. "rate=100mbit", root) or over loopback.  ``workers``
    defaults to the torchrun job's size, else 2.  Compute and codec times are measured in this process.
    ``overlap``: None overlaps each bucket's exchange with the rest of backward
    from the measured moments its gradients are ready (the model's bucket timeline, as DDP does); a
    number is a fixed fraction of communication hidden (0: none).  Each row: label, method, params,
    step_s and its parts, speedup (vs the ``none`` method: dense DDP averaging), wire_bytes (per step),
    sync_every, risk, why.  ``outer``: DiLoCo specs (``"diloco:sync_every=50"``, as ``gradzip train --outer``);
    each adds a row per method, its exchange every sync_every steps (:func:`gradzip.costmodel.outer_step_time`).
    ``echo`` prints the table (None: quiet).
    """
    from .harness.trainer import parse_outer

    syncs = [parse_outer(spec)["sync_every"] for spec in outer]
    cluster = torchrun_world_size()
    if workers is None:
        workers = cluster or 2
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if netem is not None and bandwidth is not None:
        raise ValueError("give either netem (measure an emulated link) or bandwidth (assume one), not both")
    if alpha is not None and bandwidth is None:
        raise ValueError("alpha goes with bandwidth; a measured link has its own")
    if netem is not None and cluster is not None:
        raise ValueError("netem emulates a local cluster; under torchrun advise measures the real links instead")
    specs = [parse_spec(m) for m in (DEFAULT_METHODS if methods is None else methods)]
    if not any(name == "none" for name, _ in specs):
        specs.insert(0, ("none", {}))  # the dense baseline every speedup is relative to

    compute = cost.measure_compute(model, dataset, batch_size=batch_size, data_dir=data_dir)
    if bandwidth is not None:
        link, source = cost.Link.from_rate(bandwidth, alpha), f"given {bandwidth}"
    elif cluster is not None:
        link, rank = _measure_this_cluster()
        source = f"measured between the {cluster} ranks of this torchrun job"
        if rank != 0:
            echo = None
    else:
        link = cost.measure_link(2, netem)[0]
        source = f"measured on {netem}" if netem else "measured over loopback"
    profiles = [cost.profile_method(compute.grads, name, params, bucket_cap_mb=bucket_cap_mb)
                for name, params in specs]
    timing = {"timeline": compute.timeline} if overlap is None else {"overlap": overlap}
    dense = next(p for p in profiles if p.method == "none")
    base = cost.step_time(dense, compute.seconds, link, workers, **timing)["step_s"]
    rows = []
    for p in profiles:
        rows.append(_row(p, cost.step_time(p, compute.seconds, link, workers, **timing), base))
        rows += [_row(p, cost.outer_step_time(p, compute.seconds, link, workers, h), base, h) for h in syncs]
    rows.sort(key=lambda r: r["step_s"])
    if echo is not None:
        hidden = "bucket timeline" if overlap is None else f"{overlap:g} of communication"
        echo(f"{model} on {dataset}, batch {batch_size}, {workers} workers; link {link} ({source}); "
             f"compute {1e3 * compute.seconds:.1f} ms/step; overlap: {hidden}")
        echo(format_advice(rows))
    return rows


def _row(p: cost.MethodProfile, t: dict, base_s: float, sync_every: Optional[int] = None) -> dict:
    """One row of :func:`advise`: the method every step, or (``sync_every``) in DiLoCo's outer loop."""
    risk, why = accuracy_risk(p.method, p.params, p.density)
    label, h = p.label, sync_every or 1
    if sync_every is not None:
        label, risk = f"{p.label} diloco H={h}", max(risk, "medium", key=_LEVELS.index)
        why = f"{_DILOCO}; on the pseudo-gradient, {p.method}: {why}"
    return {"label": label, "method": p.method, "params": p.params, "sync_every": sync_every, **t,
            "speedup": base_s / t["step_s"], "wire_bytes": p.wire_bytes / h, "collectives": len(p.collectives) / h,
            "density": p.density, "risk": risk, "why": why}


def format_advice(rows: list[dict]) -> str:
    """A fixed-width table of :func:`advise`'s rows, fastest first."""
    head = f"{'#':>2}  {'method':34s} {'step ms':>9} {'speedup':>8} {'comm ms':>9} {'codec ms':>9} {'KB/step':>9}  risk"
    lines = [head, "-" * len(head)]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i:>2}  {r['label'][:34]:34s} {1e3 * r['step_s']:9.1f} {r['speedup']:7.2f}x "
                     f"{1e3 * r['comm_s']:9.1f} {1e3 * r['codec_s']:9.1f} {r['wire_bytes'] / 1e3:9.1f}  "
                     f"{r['risk']}: {r['why']}")
    return "\n".join(lines)
