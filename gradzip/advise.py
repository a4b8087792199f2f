"""``gradzip advise``: which method trains this model fastest on this link, and at what accuracy risk.

It measures what the cost model (gradzip/costmodel.py) needs — the model's compute time per step, the
link's alpha and beta (or takes a given bandwidth), each method's collectives and codec time — and ranks
the methods by projected step time at N workers, with the speedup over dense and a static accuracy-risk
rating from the literature (:func:`accuracy_risk`).

The model is a built-in one (``"cnn"``, ``"resnet20"``, ...; its dataset's batches and loss) or yours: a
``torch.nn.Module`` with one sample batch, and ``loss_fn(model, batch)`` or the loss :func:`default_loss`
infers from the batch.  On the command line, ``--model package.module:factory`` names a function that
returns the model, ``(model, batch)`` or ``(model, batch, loss_fn)`` (:func:`user_model`).
"""
from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Mapping
from typing import Callable, Iterable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import costmodel as cost
from .collectives import ProcessGroupTransport
from .compressors import make, parse_spec
from .costmodel import Link
from .feedback import NoFeedback, scheme_of

__all__ = ["advise", "accuracy_risk", "format_advice", "recommend", "default_loss", "user_model", "DEFAULT_METHODS"]

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


#: How often the links are measured before a fit that fails is reported.
_LINK_ATTEMPTS = 3


def _measure_this_cluster() -> tuple[Link, int]:
    """(alpha and beta of the real links between this torchrun job's ranks, this rank)."""
    owned = not dist.is_initialized()
    cuda = torch.cuda.is_available()
    if owned:
        if cuda:  # NCCL between the ranks' own GPUs: what a GPU job's gradients cross
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo")
    # where gradzip's own collectives would go in this group (the CPU under gloo)
    device = ProcessGroupTransport().device if cuda else None
    try:
        for attempt in range(_LINK_ATTEMPTS):
            # Every rank gets the same points (each size's slowest rank), so all of them fit alike, and
            # all measure again alike where a noisy moment made the times not grow with the size.
            try:
                return cost.fit_link(cost.time_allreduces(device=device)), dist.get_rank()
            except ValueError:
                if attempt + 1 == _LINK_ATTEMPTS:
                    raise
    finally:
        if owned:
            dist.destroy_process_group()


def advise(model: Union[str, nn.Module] = "cnn", data=None, *, loss_fn: Optional[Callable] = None,
           netem: Optional[str] = None, bandwidth: Optional[str] = None, alpha: Optional[float] = None,
           workers: Optional[int] = None, methods: Optional[Iterable] = None, outer: Iterable[str] = (),
           batch_size: Optional[int] = None, overlap: Optional[float] = None, bucket_cap_mb: float = 25.0,
           data_dir: Optional[str] = None, echo: Optional[Callable[[str], object]] = print) -> list[dict]:
    """Rank ``methods`` for training ``model`` with ``workers`` workers; returns the rows, fastest first.

    ``model``: a built-in name (cnn, mlp, resnet20, lstm, gpt) with ``data`` its dataset's name (default
    fashion-mnist), ``batch_size`` (default 32) and ``data_dir``; or your ``torch.nn.Module`` with ``data``
    one sample batch, exactly as your training loop feeds it, on the model's device, and ``loss_fn(model,
    batch) -> scalar loss`` (default: :func:`default_loss`).  Your model is timed on that batch (forward,
    loss, backward, an SGD step) and left as it was.

    The link: ``bandwidth`` (e.g. "1gbit"; alpha = ``alpha`` seconds or :data:`gradzip.costmodel.DEFAULT_ALPHA`)
    needs nothing; under torchrun alpha and beta are fitted to allreduces between the job's ranks, i.e.
    the real cluster's links (every rank must call this; rank 0 prints); otherwise between 2 local
    processes, over an emulated ``netem`` link (e.g. "rate=100mbit", root) or over loopback.  ``workers``
    defaults to the torchrun job's size, else 2.  Compute and codec times are measured in this process.
    ``overlap``: None overlaps each bucket's exchange with the rest of backward
    from the measured moments its gradients are ready (the model's bucket timeline, as DDP does); a
    number is a fixed fraction of communication hidden (0: none).  Each row: label, method, params,
    step_s and its parts, speedup (vs the ``none`` method: dense DDP averaging), wire_bytes (per step),
    sync_every, risk, why, and ``recommended`` (:func:`recommend`'s row).  ``outer``: DiLoCo specs
    (``"diloco:sync_every=50"``, as ``gradzip train --outer``); each adds a row per method, its exchange
    every sync_every steps (:func:`gradzip.costmodel.outer_step_time`).  ``echo`` prints the table, the
    model's parameter count and the recommendation (None: quiet).
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

    compute, title = _measure(model, data, loss_fn, batch_size, data_dir)
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
    best = recommend(rows)
    for r in rows:
        r["recommended"] = r is best
    if echo is not None:
        hidden = "bucket timeline" if overlap is None else f"{overlap:g} of communication"
        sizes = [g.numel() for _, g in compute.grads]
        echo(f"{title}: {sum(sizes):,} parameters in {len(sizes)} tensors, {workers} workers; link {link} "
             f"({source}); compute {1e3 * compute.seconds:.1f} ms/step; overlap: {hidden}")
        echo(format_advice(rows))
        echo(format_recommendation(best))
    return rows


def _measure(model, data, loss_fn, batch_size, data_dir) -> tuple:
    """(:class:`gradzip.costmodel.Compute`, a title) for a built-in model or the caller's own."""
    if isinstance(model, str):
        if loss_fn is not None:
            raise ValueError("loss_fn goes with your own model; a built-in model takes its dataset's loss")
        data = "fashion-mnist" if data is None else data
        if not isinstance(data, str):
            raise ValueError(f"with a built-in model, data is a dataset name, got {type(data).__name__}; "
                             "a sample batch goes with your own torch.nn.Module")
        batch_size = 32 if batch_size is None else batch_size
        compute = cost.measure_compute(model, data, batch_size=batch_size, data_dir=data_dir)
        return compute, f"{model} on {data}, batch {batch_size}"
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a built-in model's name or a torch.nn.Module, got {type(model).__name__}")
    if data is None or isinstance(data, str):
        raise ValueError("advise(model, sample_batch): give one batch of your model's input, as your training "
                         "loop feeds it")
    if batch_size is not None or data_dir is not None:
        raise ValueError("batch_size and data_dir are for the built-in models; your sample batch is the batch")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be a function (model, batch) -> scalar loss, got {type(loss_fn).__name__}")
    compute = cost.measure_compute_of(model, data, loss_fn or default_loss(data))
    return compute, f"{type(model).__name__} on your batch"


def default_loss(batch) -> Callable:
    """The loss :func:`advise` uses for your model without ``loss_fn``, from the sample batch's form:

    - a dict: ``model(**batch)``, whose output has ``loss`` (a Hugging Face model given ``labels``);
    - ``(inputs, targets)``: ``model(inputs)`` (its ``logits``, or the first element of a tuple), then
      cross-entropy over the last dimension for integer targets, else the mean squared error;
    - a tensor: ``model(batch)``, then the stand-in ``output.float().square().mean()``.  The step's time
      and the gradients' sizes are your model's; their values are not your training's, which only the
      data-dependent methods' sizes (threshold, dropping) depend on.

    Any other form needs ``loss_fn(model, batch)``."""
    if isinstance(batch, Mapping):
        return _dict_loss
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return _pair_loss
    if isinstance(batch, torch.Tensor):
        return lambda model, x: _logits(model(x)).float().square().mean()
    raise ValueError(f"a sample batch of type {type(batch).__name__} needs loss_fn(model, batch) -> scalar loss "
                     "(without it: a tensor, an (inputs, targets) pair, or a dict for model(**batch))")


def _dict_loss(model, batch):
    out = model(**batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise ValueError("model(**batch) returned no loss (put the labels in the batch, or pass loss_fn(model, batch))")
    return loss


def _pair_loss(model, batch):
    x, y = batch
    out = _logits(model(x))
    if not y.is_floating_point():
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    return torch.nn.functional.mse_loss(out, y)


def _logits(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "logits" in out:
        return out["logits"]
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise ValueError(f"the model returned a {type(out).__name__}, not a tensor; pass loss_fn(model, batch)")


def user_model(spec: str, batch: Optional[str] = None, loss: Optional[str] = None) -> tuple:
    """(model, sample batch, loss_fn or None) from ``--model package.module:factory``: ``factory()``
    returns the model (then ``batch`` names a function returning the sample batch), ``(model, batch)`` or
    ``(model, batch, loss_fn)``; ``loss`` names a ``loss_fn(model, batch)``.  Modules are imported from
    the current directory and ``PYTHONPATH``; a bad spec is a one-line ValueError."""
    made = load_function(spec, "--model")()
    if isinstance(made, nn.Module):
        made = (made,)
    if (not isinstance(made, tuple) or not 1 <= len(made) <= 3 or not isinstance(made[0], nn.Module)
            or (len(made) == 3 and made[2] is not None and not callable(made[2]))):
        raise ValueError(f"--model {spec!r} returned {_kind(made)}; expected a torch.nn.Module, (model, batch) or "
                         "(model, batch, loss_fn)")
    model, sample, loss_fn = made + (None,) * (3 - len(made))
    if batch is not None:
        if len(made) > 1:
            raise ValueError(f"--model {spec!r} returns a batch already; --batch is for a factory that returns the "
                             "model alone")
        sample = load_function(batch, "--batch")()
    elif len(made) == 1:
        raise ValueError(f"--model {spec!r} returns the model alone: give --batch package.module:function "
                         "returning one input batch, or return (model, batch)")
    if loss is not None:
        loss_fn = load_function(loss, "--loss")
    return model, sample, loss_fn


def _kind(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of ({', '.join(type(v).__name__ for v in value)})"
    return f"a {type(value).__name__}"


def load_function(spec: str, option: str) -> Callable:
    """The function ``package.module:name`` (``name`` may be dotted) names; a one-line ValueError if
    the spec, the module or the attribute is wrong, or the attribute is not callable."""
    module_name, colon, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not colon or not module_name.strip() or not attr.strip():
        raise ValueError(f"{option} {spec!r}: expected package.module:function")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: the user's own modules are found
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module was found; something it imports was not
        raise ValueError(f"{option} {spec!r}: no module named {exc.name!r} (in the current directory or on "
                         "PYTHONPATH)") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{option} {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{option} {spec!r}: {attr} is not a function but a value of type {type(obj).__name__}")
    return obj


def recommend(rows: list[dict]) -> dict:
    """The row to use: the fastest projected step among the methods rated low or medium risk (dense, the
    ``none`` row, when none of them beats it)."""
    safe = [r for r in rows if r["risk"] in ("low", "medium")]
    return min(safe or rows, key=lambda r: r["step_s"])


def format_recommendation(row: dict) -> str:
    """One sentence for :func:`recommend`'s row."""
    if row["method"] == "none" and row["sync_every"] is None:
        return ("Recommendation: none (plain DDP): no method rated low or medium risk projects a faster step "
                "on this link.")
    return (f"Recommendation: {row['label']}: {1e3 * row['step_s']:.1f} ms per step, {row['speedup']:.2f}x "
            f"dense's speed, accuracy risk {row['risk']}. On the real run, gradzip.register(ddp_model, \"auto\") "
            "times the candidates on your link instead.")


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
