"""Fused kernels: a compressor's per-element work compiled into one or two loops by ``torch.compile``.

The compressors' reference paths chain tensor operations, each a pass over memory; Inductor fuses a
whole chain into one vectorised C++/OpenMP loop on CPUs (Triton on GPUs).  A compressor writes the chain
once as a plain function of tensors, wraps it with :func:`fused`, and calls it only where
:func:`enabled` says so; the reference path stays the definition, and the fused one is tested against it
bit for bit (random draws come in as tensors, from the same private generators).

- Tensors under :data:`MIN_NUMEL` elements keep the reference path: compiling costs seconds, once per
  kernel and process (``dynamic=True``: one compile serves every size).
- ``GRADZIP_FUSED=0`` in the environment forces the reference path.
- If compiling or running a kernel fails (no C++ compiler, an Inductor error), gradzip warns once with
  the cause and uses the reference path for the rest of the process.

This module sits beside :mod:`gradzip.bits`: it imports only torch.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch

__all__ = ["MIN_NUMEL", "Kernel", "fused", "enabled", "pack_codes", "unpack_codes"]

#: The smallest tensor (elements) that takes a fused path.
MIN_NUMEL = 1 << 16

_failure: Optional[str] = None  # why fused kernels are off for this process, once they failed


def enabled(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements should take the fused path."""
    return numel >= MIN_NUMEL and _failure is None and os.environ.get("GRADZIP_FUSED", "1") != "0"


def _disable(exc: BaseException) -> None:
    global _failure
    lines = str(exc).strip().splitlines()
    _failure = f"{type(exc).__name__}: {lines[0] if lines else ''}"[:200]
    warnings.warn(f"gradzip: fused kernels are off for this process, using the reference path ({_failure})",
                  RuntimeWarning, stacklevel=3)


class Kernel:
    """A per-element function, compiled (``torch.compile(dynamic=True, fullgraph=True)``) on first call.

    Calling it returns the compiled function's result, or None once fused kernels have failed in this
    process: the caller then takes its reference path.
    """

    def __init__(self, fn: Callable):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self._compiled: Optional[Callable] = None

    def __call__(self, *args):
        if _failure is not None:
            return None
        try:
            if self._compiled is None:
                self._compiled = torch.compile(self.fn, dynamic=True, fullgraph=True)
            return self._compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: use the reference path
            _disable(exc)
            return None


def fused(fn: Callable) -> Kernel:
    """Decorator: ``fn``'s tensor operations become one compiled kernel (see :class:`Kernel`)."""
    return Kernel(fn)


# -- bit packing inside a kernel: the layout of gradzip.bits.pack_bits, for 8 % bits == 0 ---------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (1-D, each < 2**bits, ``8 % bits == 0``) packed little-endian into uint8, as ``pack_bits``."""
    per_byte = 8 // bits
    n = codes.shape[0]
    grouped = torch.nn.functional.pad(codes.to(torch.uint8), (0, (per_byte - n % per_byte) % per_byte))
    grouped = grouped.view(-1, per_byte)
    packed = grouped[:, 0]
    for j in range(1, per_byte):
        packed = packed | (grouped[:, j] << (j * bits))
    return packed


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes, uint8."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    planes = [(packed >> (j * bits)) & mask for j in range(per_byte)]
    return torch.stack(planes, dim=1).reshape(-1)[:n]
