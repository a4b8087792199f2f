"""The compressor registry: ``compressors()`` lists the names, ``make(name, **params)`` builds one.

Family modules decorate their classes with :func:`register`; importing :mod:`gradzip.compressors`
imports every family, so the registry is complete once the package is.  This module imports only
:mod:`.base`, so the families can import it while the package is still being built.
"""
from __future__ import annotations

import ast
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
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


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
        raise ValueError(
            f"unknown parameter(s) {', '.join(unknown)} for compressor {name!r}; valid: {', '.join(valid) or 'none'}"
        )
    return compressor_class(name)(**params)


__all__ = ["register", "compressors", "compressor_class", "parameters_of", "make", "parse_value", "parse_spec"]
