"""Compression methods, one module per family, and the registry: ``compressors()`` lists the names,
``make(name, **params)`` builds one.

Adding a method takes one class in the module of its family and one ``@register`` line; the shared
test matrix iterates over this registry, so the new method is tested without further wiring.
"""
from .base import Compressor
from .registry import compressor_class, compressors, make, parameters_of, parse_spec, parse_value, register, summary

# Importing the family modules registers their classes (order = listing order).
from . import dense, sparse, quantize, sign, lowrank, auto  # noqa: F401
from . import sparseloco  # noqa: F401
from . import sketch  # noqa: F401

__all__ = ["Compressor", "register", "compressors", "compressor_class", "parameters_of", "make", "parse_value", "parse_spec",
           "summary"]
