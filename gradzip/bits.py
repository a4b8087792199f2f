"""Bit codecs: pack small integer codes densely into bytes, and pick compact index dtypes.

Everything here is pure tensor code (no Python loop per element) and works on any device.
Bit order is little-endian inside a byte: code ``i`` occupies bits ``[i*b, (i+1)*b)`` of the stream.
On the CPU the bit stream is packed by numpy's ``packbits``/``unpackbits`` (SIMD C loops, tens of times
faster than shifting and summing bytes with tensor ops); the layout is the same on every device.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from . import devices

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "byte_table", "lookup_codes", "index_dtype", "select"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits each."""
    return math.ceil(n * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an integer in 1..16, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack a 1-D tensor of non-negative integer codes, each ``< 2**bits``, into a uint8 tensor."""
    _check_bits(bits)
    codes = codes.reshape(-1)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=codes.device)
    if devices.host_memory(codes):
        return torch.from_numpy(np.packbits(_bit_stream(codes, bits).numpy(), bitorder="little"))
    if 8 % bits == 0:
        # Fast path: an integral number of codes per byte, combined with shifts.
        per_byte = 8 // bits
        padded = torch.zeros(nbytes * per_byte, dtype=torch.uint8, device=codes.device)
        padded[:n] = codes.to(torch.uint8)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
        return (padded.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)
    # General path: expand into a bit stream, then regroup eight bits per byte.
    planes = torch.arange(bits, dtype=torch.int32, device=codes.device)
    stream = ((codes.to(torch.int32).unsqueeze(1) >> planes) & 1).reshape(-1)
    padded = torch.zeros(nbytes * 8, dtype=torch.uint8, device=codes.device)
    padded[: stream.numel()] = stream.to(torch.uint8)
    weights = torch.arange(8, dtype=torch.uint8, device=codes.device)
    return (padded.view(-1, 8) << weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` codes, as int64 (uint8 when ``bits <= 8``)."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed bits must be a uint8 tensor, got {packed.dtype}")
    if packed.numel() < packed_nbytes(n, bits):
        raise ValueError(f"{packed.numel()} bytes cannot hold {n} codes of {bits} bits")
    device = packed.device
    if devices.host_memory(device):
        stream = torch.from_numpy(np.unpackbits(packed.contiguous().numpy(), count=n * bits, bitorder="little"))
        return _from_bit_stream(stream, bits, n)
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=device)
        mask = (1 << bits) - 1
        codes = ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:n]
        return codes
    weights = torch.arange(8, dtype=torch.uint8, device=device)
    stream = ((packed.unsqueeze(1) >> weights) & 1).reshape(-1)[: n * bits]
    planes = torch.arange(bits, dtype=torch.int64, device=device)
    codes = (stream.view(n, bits).to(torch.int64) << planes).sum(dim=1)
    return codes.to(torch.uint8) if bits <= 8 else codes


def byte_table(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(256, 8 // bits): row b holds ``values[c]`` for each code c packed in byte b, first code first (the
    layout of :func:`pack_bits`, for ``8 % bits == 0``); :func:`lookup_codes` decodes with it."""
    shifts = torch.arange(0, 8, bits, device=values.device)
    return values[(torch.arange(256, device=values.device).unsqueeze(1) >> shifts) & ((1 << bits) - 1)]


def lookup_codes(packed: torch.Tensor, table: torch.Tensor, n: int, out: torch.Tensor = None,
                 index: torch.Tensor = None) -> torch.Tensor:
    """``table``'s values (a :func:`byte_table`) of the first ``n`` codes in ``packed``, written into ``out``
    (n elements, contiguous) and returned: one gather of a whole row per byte, where unpacking takes a
    shift, a mask and a lookup per code (on CPUs a third of the time of even a compiled loop, which
    stays scalar).  ``index``: int32 scratch of at least ``packed.numel()`` elements.  Without ``out``
    and ``index``: a new tensor, every byte's row gathered and the last byte's unused codes cut off
    (two operations, however n falls)."""
    if out is None and index is None:
        return table.index_select(0, packed.int()).view(-1)[:n]
    per = table.shape[1]
    whole = n // per
    nbytes = -(-n // per)
    idx = index[:nbytes].copy_(packed[:nbytes])  # int32: index_select reads it as it is
    if per == 1:  # a gather of single values: the 1-D index_select is three times as fast as by rows
        return torch.index_select(table.view(-1), 0, idx, out=out)
    torch.index_select(table, 0, idx[:whole], out=out[: whole * per].view(whole, per))
    if whole * per < n:
        out[whole * per :] = table[idx[whole].long(), : n - whole * per]
    return out


def _bit_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """One uint8 0/1 per bit, code after code, low bit first (what ``np.packbits`` packs)."""
    if bits == 1:
        return codes if codes.dtype in (torch.bool, torch.uint8) else codes.to(torch.uint8)
    small = codes.to(torch.uint8 if bits <= 8 else torch.int32)
    planes = torch.arange(bits, dtype=small.dtype)
    stream = torch.bitwise_right_shift(small.unsqueeze(1), planes).bitwise_and_(1)
    return stream.reshape(-1) if bits <= 8 else stream.to(torch.uint8).reshape(-1)


def _from_bit_stream(stream: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_bit_stream`: uint8 codes for ``bits <= 8``, int64 above."""
    if bits == 1:
        return stream
    planes = stream.view(n, bits) if bits <= 8 else stream.view(n, bits).to(torch.int64)
    codes = planes[:, 0].clone()
    for j in range(1, bits):
        codes.bitwise_or_(planes[:, j] << j)
    return codes


def index_dtype(numel: int) -> torch.dtype:
    """The smallest integer dtype that can address ``numel`` positions (int32 for large tensors)."""
    if numel <= 2**8:
        return torch.uint8
    if numel <= 2**15:
        return torch.int16
    return torch.int32


def as_index(positions: torch.Tensor) -> torch.Tensor:
    """Positions sent as :func:`index_dtype` as an index ``index_add_`` takes: int32 and int64 as they
    are (no copy), narrower ones widened."""
    return positions if positions.dtype in (torch.int32, torch.int64) else positions.long()


def _broadcast_shape(x, y) -> tuple:
    """The shape that ``x`` and ``y`` broadcast to (they must): ``torch.broadcast_shapes`` in plain
    Python, which costs about 50 us a call there (a tenth of a small tensor's whole 1-bit SGD exchange)."""
    rank = max(len(x), len(y))
    x, y = (1,) * (rank - len(x)) + tuple(x), (1,) * (rank - len(y)) + tuple(y)
    return tuple(b if a == 1 else a for a, b in zip(x, y))


def select(condition: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.where(condition, a, b)`` for float32 ``a`` and ``b`` broadcast to ``condition``'s shape,
    bit for bit.

    On CPUs ``torch.where`` runs a scalar loop, about ten times slower than one pass over memory; this
    picks the bits with integer masks instead: b ^ ((a ^ b) & m), with m all ones where ``condition``.
    ``out`` (float32) and ``scratch`` (int32), of ``condition``'s shape, are optional buffers to use.
    """
    if not devices.selects_by_bits(condition):
        return torch.where(condition, a, b)
    shape = condition.shape
    a, b = a.view(torch.int32), b.view(torch.int32)
    mask = torch.neg(condition.to(torch.int32) if scratch is None else scratch.copy_(condition), out=scratch)
    into = None if out is None else out.view(torch.int32)
    if _broadcast_shape(a.shape, b.shape) != tuple(shape):  # a ^ b once per distinct pair (1-bit SGD's columns)
        picked = torch.bitwise_and(torch.bitwise_xor(a, b).expand(shape), mask, out=into)
    else:
        picked = torch.bitwise_xor(a.expand(shape), b.expand(shape), out=into).bitwise_and_(mask)
    return picked.bitwise_xor_(b.expand(shape)).view(torch.float32)
