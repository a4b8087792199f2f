"""The compressor registry: ``compressors()`` lists the names, ``make(name, **params)`` builds one.

Family modules decorate their classes with :func:`register`; importing :mod:`gradzip.compressors`
imports every family, so the registry is complete once the package is.  This module imports only
:mod:`.base`, so the families can import it while the package is still being built.
"""
from __future__ import annotations

import ast
import difflib
import inspect

from .base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"compressor name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def compressors() -> list[str]:
    """Names of every registered compression method, in registration order."""
    return list(_REGISTRY)


def compressor_class(name: str) -> type[Compressor]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown compressor {name!r}{did_you_mean(name, _REGISTRY)}; valid names: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def did_you_mean(given, valid) -> str:
    """``" (did you mean 'topk'?)"`` for the closest of ``valid`` to ``given``, or "" when none is close."""
    close = difflib.get_close_matches(given, list(valid), n=1) if isinstance(given, str) else []
    return f" (did you mean {close[0]!r}?)" if close else ""


# One line per built-in method for `gradzip methods`; a method registered elsewhere gets the first
# sentence of its docstring (or its class attribute ``summary``).
_SUMMARIES = {
    "none": "dense allreduce of g/N in the gradient's dtype (plain DDP)",
    "fp16": "dense allreduce in half precision: 16 bits per element",
    "bf16": "dense allreduce in bfloat16: 16 bits per element",
    "topk": "sparse: the ratio*n largest |g|, with error feedback",
    "randomk": "sparse: ratio*n random positions, with error feedback",
    "threshold": "sparse: every |g| > tau (variable size), error feedback",
    "dropping": "sparse: drops the drop_ratio smallest |g| (sampled)",
    "dgc": "Deep Gradient Compression: sparse, momentum correction",
    "csc": "sparse: the chunks of largest L1 norm, agreed by all ranks",
    "adaptive_threshold": "sparse: the largest of each sign, sent as its mean",
    "qsgd": "unbiased stochastic quantisation to `levels` levels",
    "terngrad": "unbiased ternary quantisation, 2 bits per element",
    "natural": "unbiased rounding to a power of two, 8 bits per element",
    "onebit": "1-bit SGD: a bit per element, column means, error feedback",
    "signsgd": "sign of each element with majority vote, no error feedback",
    "signum": "sign of the momentum with majority vote",
    "efsignsgd": "scaled sign of each element, with error feedback",
    "powersgd": "low rank: rank-r power iteration, warm-started",
    "auto": "times the candidates on your link, keeps the fastest",
    "sparseloco": "chunked Top-k, 2-bit values, decaying feedback (DiLoCo)",
    "sketch": "count sketch of the gradient, heavy hitters recovered",
}


def summary(name: str) -> str:
    """One line saying what method ``name`` does."""
    cls = compressor_class(name)
    own = cls.__dict__.get("summary") or _SUMMARIES.get(name)
    if own:
        return own
    doc = " ".join((cls.__doc__ or "").split())
    return doc.split(". ")[0].rstrip(".")


def parameters_of(name: str) -> dict:
    """The constructor parameters of a method with their defaults."""
    sig = inspect.signature(compressor_class(name).__init__)
    return {p.name: p.default for p in list(sig.parameters.values())[1:] if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}


def parse_value(raw: str):
    """A parameter value typed from text (command lines): true/false/none, Python literals, else the string."""
    raw = raw.strip()
    lowered = raw.lower()
    if lowered in ("true", "false", "none"):
        return {"true": True, "false": False, "none": None}[lowered]
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return raw


def parse_spec(spec) -> tuple[str, dict]:
    """``"topk:ratio=0.001,value_dtype=float16"`` -> ("topk", {"ratio": 0.001, "value_dtype": "float16"}).

    A ``(name, params)`` tuple passes through.  The method and its parameters are checked at once.
    """
    if isinstance(spec, tuple):
        name, params = spec
        params = dict(params)
    else:
        name, _, rest = spec.partition(":")
        params = {}
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, raw = item.partition("=")
            if not eq:
                raise ValueError(f"bad method parameter {item!r} in {spec!r}; expected NAME:KEY=VALUE,KEY=VALUE")
            params[key.strip()] = parse_value(raw)
    name = name.strip()
    make(name, **params)  # fail early on an unknown method or parameter
    return name, params


def make(name: str | Compressor, **params) -> Compressor:
    """Build the compressor ``name`` with ``params``; a ready :class:`Compressor` passes through."""
    if isinstance(name, Compressor):
        if params:
            raise ValueError("parameters cannot be given together with an already built compressor")
        return name
    valid = parameters_of(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        hint = did_you_mean(unknown[0], valid) if len(unknown) == 1 else ""
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)} for compressor {name!r}{hint}; "
                         f"valid: {', '.join(valid) or 'none'}")
    return compressor_class(name)(**params)


__all__ = ["register", "compressors", "compressor_class", "parameters_of", "make", "parse_value", "parse_spec",
           "summary", "did_you_mean"]
