"""Sign methods: one sign per element, packed densely.

Two sign codes:

- one bit per element (``onebit``, ``efsignsgd``, and ``signsgd``/``signum`` with ``zeros="plus"``):
  bit = 1 where x >= 0, so sign(0) (and sign(-0.0)) is taken as +1; NaN compares false and becomes -1
  (non-finite steps are discarded by GradzipState anyway).  Packed with :func:`gradzip.bits.pack_bits`
  (little-endian inside a byte): ceil(n / 8) bytes (GRACE spends a whole byte per sign).
- ternary, sign(x) in {-1, 0, +1} (``signsgd``/``signum``, ``zeros="abstain"``): an exact zero (either
  sign) is 0; NaN's code is unspecified.  Codes c = sign(x) + 1 are packed five per byte in base 3 (3^5 = 243 <= 256), so n
  elements cost ceil(n / 5) bytes: 1.6 bits per element, against log2(3) = 1.58 for any exact ternary
  code and 2 bits for 2-bit codes.  Element i is digit i // m of byte i % m (m = ceil(n / 5)), so packing
  and unpacking work on five contiguous planes.

All payloads are allgathered: signs are not summable.  Every rank decodes the gathered payloads in
rank order, so all ranks compute bit-identical aggregates.

On the bucket route (``bucket_exchange``) a whole DDP bucket's codes travel as one field, packed as
above over the bucket's elements end to end, beside its per-tensor scales or column means.
"""
from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch

from .. import devices, kernels
from ..bits import pack_bits, packed_nbytes, select, unpack_bits
from .bucket import (SizeClass, bits_of, int32_columns, pack_signs, segment_of, signed_, strided_at,
                     summed_in_rank_order, unpack_signs)
from .base import (AllGather, Exchanged, GatheredCompressor, TensorContext, chunked_sum, column_counts, compare,
                   packed_codes, times_scale, workspace)
from .registry import register

#: How signSGD/Signum read an exact zero: "abstain" (sign 0, ternary code) or "plus" (sign +1, one bit).
ZEROS = ("abstain", "plus")
TRITS_PER_BYTE = 5


# -- fused kernels (gradzip.kernels) of the encoders below: the same codes, one loop each ----------------


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _pack_signs(flat):
    return kernels.pack_codes(flat >= 0, 1)


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _sign_bytes(flat, out):
    # Through int32: a comparison's bool stored as a byte runs some twenty times slower on CPUs.
    return out.copy_((flat >= 0).to(torch.int32).to(torch.uint8))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _pack_trits(flat, m: int):
    n = flat.shape[0]
    codes = 1 + (flat > 0).to(torch.int32) - (flat < 0).to(torch.int32)  # int32: see kernels.pack_codes
    last = TRITS_PER_BYTE - 1  # the only plane with padding codes (0), padded apart: see pack_codes
    packed = torch.nn.functional.pad(codes[last * m:], (0, TRITS_PER_BYTE * m - n))
    for j in range(last - 1, -1, -1):
        packed = packed * 3 + codes[j * m:(j + 1) * m]
    return packed.to(torch.uint8)


@kernels.fused
def _split_at_zero(M, positive, negative):
    # OneBit's two groups, torch.where's values (bit for bit, as bits.select), into the given buffers.
    # The comparison is made here: a bool tensor read in the loop would keep it scalar.
    positive.copy_(torch.where(M >= 0, M, 0.0))
    return negative.copy_(torch.where(M >= 0, 0.0, M))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _minus_scaled_signs(p, scale):
    # In place: p - (+scale where p >= 0, else -scale), exactly p minus its own decoded 1-bit signs.
    return p.sub_(torch.where(p >= 0, scale, -scale))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _minus_column_means(M, pos_mean, neg_mean):
    # In place: M - (a_j where M_ij >= 0, else b_j), exactly M minus its own decoded 1-bit SGD payload.
    return M.sub_(torch.where(M >= 0, pos_mean, neg_mean))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _mean_of_column_codes(out, means, *packed):
    """1-bit SGD's aggregate: out[i, j] = (sum_r (a_rj if bit_rij else b_rj)) / world in rank order, as
    the reference decodes each rank and adds; bit k of the flattened (row-major) matrix is bit k % 8 of
    byte k // 8 of a rank's ``packed``.  ``means``: (world, 2, columns), the ranks' a and b."""
    rows, cols = out.shape
    k = torch.arange(rows, device=out.device)[:, None] * cols + torch.arange(cols, device=out.device)[None, :]
    byte, shift = k >> 3, (k & 7).to(torch.int32)
    total = None
    for r in range(len(packed)):
        bit = (packed[r][byte].to(torch.int32) >> shift) & 1
        decoded = torch.where(bit != 0, means[r, 0], means[r, 1])
        total = decoded if total is None else total + decoded
    return out.copy_(total / len(packed))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _mean_of_scaled_signs(out, scales, *packed):
    """EF-signSGD's aggregate over whole bytes: out[k, j] = (sum_r scales[r] * sign_rkj) / world in rank
    order, sign_rkj = +-1 from bit j of the r-th ``packed``'s byte k: the reference's roundings (each
    product is exact).  ``out`` is viewed (bytes, 8), so that no element's byte is found by a division;
    the ranks' bytes come as separate arguments (a stacked copy would cost more than it saves)."""
    world = len(packed)
    shifts = torch.arange(8, dtype=torch.int32, device=out.device)
    total = None
    for r in range(world):
        bits = (packed[r].to(torch.int32).unsqueeze(-1) >> shifts) & 1
        term = scales[r] * (bits.to(torch.float32) * 2 - 1)
        total = term if total is None else total + term
    return out.copy_(total / world)


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _momentum(m, x, *, beta: float):
    return m * beta + x * (1 - beta)  # fp32, no fused multiply-add: the reference's roundings


def mean_abs(x: torch.Tensor) -> torch.Tensor:
    """||x||_1 / n as a 1-element float32 tensor (0 for an empty tensor)."""
    # Sum / max(n, 1) instead of mean(): an empty tensor gets scale 0, not NaN.
    n = x.numel()
    if not x.is_contiguous():  # x's own layout sets the order of the sum
        return (x.abs().sum(dtype=torch.float32) / max(n, 1)).reshape(1)
    return (chunked_sum(x.reshape(-1), torch.abs, "abs") / max(n, 1)).reshape(1)


def encode_signs(x: torch.Tensor) -> torch.Tensor:
    """Packed sign bits of ``x`` (bit 1 for x >= 0), ceil(numel / 8) uint8 bytes."""
    flat = x.reshape(-1)
    packed = packed_codes(flat.numel(), 1, flat.device, lambda: _pack_signs(flat),
                          lambda out: _sign_bytes(flat, out)) if kernels.enabled(flat.numel()) else None
    if packed is not None:
        return packed
    return pack_bits(compare("ge", flat, 0, workspace("signs", flat.numel(), torch.bool, flat.device)), 1)


def _as_float(values: torch.Tensor, shape, out: Optional[torch.Tensor]) -> torch.Tensor:
    """``values`` as float32 with ``shape``, in a fresh tensor or converted into ``out``."""
    return values.float().reshape(shape) if out is None else out.view(-1).copy_(values).view(shape)


def decode_signs(packed: torch.Tensor, shape, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Inverse of :func:`encode_signs`: +1.0 / -1.0 as float32 with ``shape`` (into ``out`` if given)."""
    bits = unpack_bits(packed, 1, math.prod(shape))
    # 2b - 1 in int8 (exact), then one conversion: the same values as float(b) * 2 - 1.
    return _as_float(bits.view(torch.int8).mul_(2).sub_(1), shape, out)


def majority_vote(signs: list) -> torch.Tensor:
    """sign(sum_r s_r) of +-1 tensors; a tie (even world size) gives 0.

    The sum of +-1 values is an exact integer in float32, so every rank gets the same vote.
    """
    total = signs[0].clone()
    for s in signs[1:]:
        total += s
    return total.sign_()


def vote_of_bits(gathered: list, shape, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`majority_vote` of the ranks' packed sign bits, counted as integers: with c the number of
    +1 votes among N, sum_r s_r = 2c - N exactly, so sign(2c - N) is the same vote (float32, into
    ``out`` if given)."""
    n, world = math.prod(shape), len(gathered)
    count = workspace("votes", n, torch.int16 if world < 2**14 else torch.int32, gathered[0][0].device)
    count.copy_(unpack_bits(gathered[0][0], 1, n))
    for (packed,) in gathered[1:]:
        count += unpack_bits(packed, 1, n)
    return _as_float(count.mul_(2).sub_(world).sign_(), shape, out)


def trits_nbytes(n: int) -> int:
    """Bytes of n ternary codes packed five per byte."""
    return -(-n // TRITS_PER_BYTE)


def encode_trits(x: torch.Tensor) -> torch.Tensor:
    """sign(x) in {-1, 0, +1} as base-3 digits c = sign + 1, five per byte: byte b holds the codes of
    elements b, b + m, ..., b + 4m (m = ceil(n / 5)) as sum_j 3^j c_{b + jm} <= 242."""
    flat = x.reshape(-1)
    n, device = flat.numel(), flat.device
    m = trits_nbytes(n)
    packed = _pack_trits(flat, m) if kernels.enabled(n) else None
    if packed is not None:
        return packed
    codes = workspace("trits", TRITS_PER_BYTE * m, torch.uint8, device)
    codes[n:].zero_()  # at most four padding codes, never read back
    # torch.sign and one conversion: twice as fast on CPUs as the two comparisons x > 0, x >= 0.
    signs = torch.sign(flat, out=workspace("trits.sign", n, flat.dtype, device))
    codes[:n].view(torch.int8).copy_(signs)
    codes[:n].add_(1)
    # sum_j 3^j c_j over the planes in two operations (c_j 3^j <= 162, the sum <= 242: exact in uint8)
    return codes.view(TRITS_PER_BYTE, m).mul(_powers_of_3(device)).sum(0, dtype=torch.uint8)


@functools.lru_cache(maxsize=16)
def _powers_of_3(device: torch.device) -> torch.Tensor:
    return torch.tensor([[3**j] for j in range(TRITS_PER_BYTE)], dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=16)
def _trit_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """table[j, b] = digit j of byte b in base 3, minus 1; bytes above 242 never occur."""
    return torch.tensor([[(b // 3**j) % 3 - 1 for b in range(256)] for j in range(TRITS_PER_BYTE)],
                        dtype=dtype, device=device)


def _add_trits(out: torch.Tensor, packed: torch.Tensor, add: bool) -> None:
    """Write (``add=False``) or add the decoded signs of ``packed`` into the integer ``out`` (5m elements):
    every byte's five digits, plane by plane, by one lookup along the table's columns."""
    planes = out.view(TRITS_PER_BYTE, -1)
    table, index = _trit_table(packed.device, out.dtype), packed.int()
    # (table, dim, target): all five planes at once, or digit by digit
    lookups = [(table, 1, planes)] if devices.looks_up_rows_at_once(packed) else \
        [(digits, 0, plane) for digits, plane in zip(table, planes)]
    for source, dim, target in lookups:
        if add:
            target.add_(torch.index_select(source, dim, index))
        else:
            torch.index_select(source, dim, index, out=target)


def decode_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`encode_trits`: the first n signs, int8 in {-1, 0, +1}."""
    out = torch.empty(TRITS_PER_BYTE * packed.numel(), dtype=torch.int8, device=packed.device)
    _add_trits(out, packed, add=False)
    return out[:n]


def vote_of_trits(gathered: list, shape, out: Optional[torch.Tensor] = None,
                  scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """sign(sum_r t_r) of the ranks' packed ternary codes, counted as integers, times ``scale`` (a 0-d
    float32) if given (float32, into ``out`` if given; ties 0)."""
    n, world = math.prod(shape), len(gathered)
    if out is not None and out.is_contiguous() and _fused_trit_vote(gathered, n, scale, out.view(-1)):
        return out.view(shape)
    dtype = torch.int8 if world < 2**7 else torch.int16 if world < 2**15 else torch.int32
    count = workspace("votes", TRITS_PER_BYTE * trits_nbytes(n), dtype, gathered[0].device)
    for r, packed in enumerate(gathered):
        _add_trits(count, packed, add=r > 0)
    vote = _as_float(count[:n].sign_(), shape, out)
    return vote if scale is None else vote.mul_(scale)


def _fused_trit_vote(gathered: list, n: int, scale: Optional[torch.Tensor], out: torch.Tensor) -> bool:
    """:func:`vote_of_trits` into the flat float32 ``out`` by :func:`_trit_vote_planes`: planes 0-3
    (whole) in one call, the last (the tail of ``out``) in a second (two compiles per world size);
    False where it does not apply."""
    world, m = len(gathered), gathered[0].numel()
    if not (kernels.enabled_over_ranks(n, world) and n >= _trit_vote_planes.min_numel):
        return False
    scale = torch.ones((), device=out.device) if scale is None else scale.reshape(())
    inv_powers = _inverse_powers_of_3(out.device)
    last = TRITS_PER_BYTE - 1
    tail = out[last * m:]
    return (_trit_vote_planes.run(out[:last * m].view(last, m), inv_powers[:last], scale, *gathered) is not None
            and _trit_vote_planes.run(tail.view(1, -1), inv_powers[last:], scale,
                                      *(packed[:tail.numel()] for packed in gathered)) is not None)


@functools.lru_cache(maxsize=16)
def _one(device: torch.device) -> torch.Tensor:
    """1.0 on the device, made once (a bound read, never written)."""
    return torch.ones((), device=device)


@functools.lru_cache(maxsize=16)
def _inverse_powers_of_3(device: torch.device) -> torch.Tensor:
    return torch.tensor([3.0 ** -j for j in range(TRITS_PER_BYTE)], device=device)


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _trit_vote_planes(out, inv_powers, scale, *packed):
    """out[j, b] = sign(sum_r t_rjb) * scale, where t_rjb = digit j (base 3) of the r-th ``packed``'s
    byte b, minus 1, and ``inv_powers[j]`` is that digit's 3^-j (the ranks' bytes as separate arguments:
    a stacked copy would cost more than it saves).  Float32 arithmetic, exact: floor((b + 1/2) 3^-j) is
    floor(b / 3^j) for a byte b (the 1/2 keeps the product at least 1/162 from an integer, far more than
    its rounding error), and a sum of ``world`` digits in {-1, 0, 1} is exact; the product with the
    scale is rounded once, as in the reference path's ``mul_``."""
    count = None
    for r in range(len(packed)):
        digits = _trit_digits(packed[r].to(torch.float32).unsqueeze(0), inv_powers.unsqueeze(1))
        count = digits if count is None else count + digits
    return out.copy_(torch.sign(count) * scale)


def _trit_digits(byte: torch.Tensor, inv_power: torch.Tensor) -> torch.Tensor:
    """For a kernel: digit j (base 3) of each byte (as float32) minus 1, ``inv_power`` its 3^-j, in
    float32 arithmetic, exactly (see :func:`_trit_vote_planes`)."""
    q = torch.floor((byte + 0.5) * inv_power)
    return q - 3 * torch.floor((q + 0.5) * (1 / 3)) - 1


@kernels.fused
def _bucket_trit_vote(out, inv_powers, scale, tensor_starts, *packed):
    """signSGD's scaled vote over a whole bucket in one loop: out_i = sign(sum_r t_ri) * s, s the scale
    of element i's tensor (``scale``, per tensor; the tensor found from ``tensor_starts`` by
    ``segment_of``), t_ri the r-th ``packed``'s ternary digit of element i, which is digit i // m of
    byte i mod m (m bytes), read as in :func:`_trit_vote_planes`.  The sum of digits is exact and the
    product rounded once: the reference path's vote, spread scales and product, bit for bit, without
    its int8 counts, float votes and spread scales over the bucket."""
    n, m = out.shape[0], packed[0].shape[0]
    i = torch.arange(n, device=out.device)
    plane = i // m
    at = i - plane * m
    inv = inv_powers.index_select(0, plane)
    count = None
    for r in range(len(packed)):
        digits = _trit_digits(packed[r].index_select(0, at).to(torch.float32), inv)
        count = digits if count is None else count + digits
    return out.copy_(torch.sign(count) * scale.index_select(0, segment_of(n, tensor_starts, out.device)))


# -- the bucket route's shared pieces ----------------------------------------------------------------------


def _scaled_signs(scales: torch.Tensor, packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One rank's per-tensor scale times the +-1 signs of its packed bits, over the whole bucket (flat),
    the scales spread by ``index`` (:meth:`BucketLayout.segment_index`)."""
    return signed_(scales.index_select(0, index), packed)


@kernels.fused
def _bucket_sign_bits(x):
    """:func:`pack_signs` of a whole bucket in one loop: bit 1 for x >= 0, little-endian in each byte."""
    return kernels.pack_codes((x >= 0).to(torch.int32), 1)


def _bucket_signs(x: torch.Tensor) -> torch.Tensor:
    """The bucket's sign bits: by a kernel compiled ahead where there is one, else :func:`pack_signs`."""
    packed = _bucket_sign_bits.ahead(x)
    return pack_signs(x) if packed is None else packed


@kernels.fused
def _ef_bucket_residual(p, scales, tensor_starts):
    """EF-signSGD's error feedback over a whole bucket, into ``p``: p - s_i sign(p) with s_i its tensor's
    scale and sign(p) = +1 where p >= 0 (as the bits sent say), as :func:`_scaled_signs` and the
    subtraction do it."""
    signs = torch.where(p >= 0, 1.0, -1.0)
    return p.sub_(scales.index_select(0, segment_of(p.shape[0], tensor_starts, p.device)) * signs)


@kernels.fused
def _ef_decoded(out, scales, packed, tensor_starts, *, add: bool):
    """One rank's EF-signSGD payload decoded into ``out`` or (``add``) added to it: s_i (+1 where the
    element's bit is 1, else -1), s_i the scale of its tensor (``segment_of`` ``tensor_starts``): the
    reference path's spread scales, unpacked bits and product in one loop, no index over the bucket."""
    n = out.shape[0]
    bit = _bits_at(packed, torch.arange(n, dtype=torch.int32, device=out.device))
    value = scales.index_select(0, segment_of(n, tensor_starts, out.device)) * (bit * 2 - 1).to(torch.float32)
    return out.add_(value) if add else out.copy_(value)


def _bits_at(packed: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """For a kernel: the bit of each position ``at`` (int32) in ``packed``, little-endian in each byte
    (as :func:`pack_signs` packs them), int32 0 or 1."""
    return (packed.index_select(0, at >> 3).to(torch.int32) >> (at & 7)) & 1


def _bucket_trit_codes(x: torch.Tensor) -> torch.Tensor:
    """The bucket's ternary codes: by a kernel compiled ahead where there is one, else :func:`encode_trits`."""
    codes = _bucket_trits.ahead(x)
    return encode_trits(x) if codes is None else codes


@kernels.fused
def _bucket_trits(x):
    """:func:`encode_trits` of a whole bucket in one loop (sign + 1 in base 3, five planes a byte)."""
    n = x.shape[0]
    m = (n + TRITS_PER_BYTE - 1) // TRITS_PER_BYTE
    codes = torch.nn.functional.pad((torch.sign(x) + 1).to(torch.int32), (0, TRITS_PER_BYTE * m - n))
    powers = torch.tensor([3**j for j in range(TRITS_PER_BYTE)], dtype=torch.int32, device=x.device)
    return (codes.view(TRITS_PER_BYTE, m) * powers.view(-1, 1)).sum(0).to(torch.uint8)


def _bits_bytes(ctx: TensorContext) -> int:
    return packed_nbytes(ctx.shape.numel(), 1)


@register
class OneBit(GatheredCompressor):
    """1-bit SGD (Seide et al., Interspeech 2014, "1-bit stochastic gradient descent and its application
    to data-parallel distributed training of speech DNNs").

    View x as a matrix M of shape (shape[0], prod(shape[1:])) (1-D: n x 1, 0-d: 1 x 1).  Quantise at 0;
    per column j send two reconstruction values, a_j = mean{M_ij : M_ij >= 0} and
    b_j = mean{M_ij : M_ij < 0} (0.0 for an empty group), and decode M_ij = a_j if bit else b_j.  The
    column sums are preserved (up to rounding); the paper needs error feedback (default ``residual``) because
    without it training diverges.  Wire: fp32 [a_1..a_m, b_1..b_m] + bits = 8 m + ceil(n / 8) bytes,
    allgathered; the aggregate is the mean of the decoded tensors.
    """

    name = "onebit"
    default_feedback = "residual"
    decodes_into = True

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    @staticmethod
    def matrix_shape(shape) -> tuple:
        # prod(shape[1:]) rather than numel / shape[0]: defined for shape[0] == 0 too.
        return (shape[0] if len(shape) else 1, math.prod(shape[1:]))

    def compress(self, x, ctx):
        M = x.reshape(self.matrix_shape(ctx.shape))
        rows, numel = M.shape[0], M.numel()
        zero = torch.zeros((), dtype=M.dtype, device=M.device)
        # A selection, not M * group: inf * 0 would turn a finite mean into NaN.  The column sums must add
        # in the order of M's own layout (as torch.where's outputs would), so reused (contiguous) buffers
        # are for contiguous M only.
        if M.dtype == torch.float32 and M.is_contiguous():
            pos = compare("ge", M, 0, workspace("onebit.pos", numel, torch.bool, M.device).view(M.shape))
            picked = workspace("onebit.picked", numel, torch.float32, M.device).view(M.shape)
            # The second group's buffer only where the kernel may run: the reference path reuses picked.
            other = None
            if kernels.enabled(numel):
                other = workspace("onebit.other", numel, torch.float32, M.device).view(M.shape)
            if other is not None and _split_at_zero(M, picked, other) is not None:
                pos_total, neg_total = picked.sum(dim=0), other.sum(dim=0)  # eager: the reference's order
            else:
                buffers = {"out": picked, "scratch": workspace("onebit.mask", numel, torch.int32, M.device).view(M.shape)}
                pos_total = select(pos, M, zero, **buffers).sum(dim=0)
                neg_total = select(pos, zero, M, **buffers).sum(dim=0)
        elif M.dtype == torch.float32:
            pos = M >= 0
            pos_total, neg_total = select(pos, M, zero).sum(dim=0), select(pos, zero, M).sum(dim=0)
        else:
            pos = M >= 0
            pos_total, neg_total = torch.where(pos, M, zero).sum(dim=0), torch.where(pos, zero, M).sum(dim=0)
        pos_count = column_counts(pos)  # exact, without an int64 copy of the mask
        means = torch.cat([pos_total / pos_count.clamp(min=1), neg_total / (rows - pos_count).clamp(min=1)]).float()
        return means, pack_bits(pos, 1)

    def decompress(self, fields, ctx, out: Optional[torch.Tensor] = None):
        means, packed = fields
        pos_mean, neg_mean = means.view(2, -1)
        shape = self.matrix_shape(ctx.shape)
        numel = math.prod(shape)
        bits = unpack_bits(packed, 1, numel).view(torch.bool).view(shape)
        scratch = workspace("onebit.mask", numel, torch.int32, bits.device).view(shape)
        into = None if out is None else out.view(shape)
        return select(bits, pos_mean, neg_mean, out=into, scratch=scratch).reshape(ctx.shape)

    def decoded_mean(self, gathered, ctx):
        # combine()'s sum in rank order, each payload decoded into reused memory (a fresh full-size
        # tensor per rank was page-faulted in on every exchange): the same floats.  Or all of it in
        # one kernel (25M elements, one rank: 13 ms against 54).
        n, shape = ctx.shape.numel(), self.matrix_shape(ctx.shape)
        if kernels.enabled_over_ranks(n, len(gathered)):
            aggregate = ctx.buffer("aggregate", (n,), torch.float32, gathered[0][0].device)
            means = torch.stack([fields[0].view(2, -1) for fields in gathered])
            if _mean_of_column_codes(aggregate.view(shape), means, *(fields[1] for fields in gathered)) is not None:
                return aggregate.view(ctx.shape)
        return self.mean_decoded_into(gathered, ctx, lambda fields, out: self.decompress(fields, ctx, out))

    def subtract_sent(self, fields, ctx):
        # p - D(C(p)) in one fused pass over p: its own bits are p >= 0, so they need not be unpacked
        # (decoding them by integer masks and subtracting took about five passes).
        if not kernels.enabled(ctx.shape.numel()):
            return None
        pos_mean, neg_mean = fields[0].view(2, -1)
        shape = self.matrix_shape(ctx.shape)
        return lambda p: None if _minus_column_means(p.view(shape), pos_mean, neg_mean) is None else p

    def payload_bytes(self, ctx, kept=None):
        return 8 * self.matrix_shape(ctx.shape)[1] + _bits_bytes(ctx)

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor, as :meth:`exchange`: M its matrix view, a_j and b_j the means of column j's
        elements >= 0 and < 0, computed for all tensors of one matrix shape at once (stacked, k x rows x
        cols); each element decodes to its column's a_j (bit 1) or b_j.  Wire: the bucket's a's, then its
        b's, fp32, 8 bytes per column of its non-empty tensors, and its bits together, ceil(n / 8)."""
        layout, world = b.layout, b.world_size
        groups, columns, plan = _columns(layout)
        # every group's column sums and counts written where they lie in the payload, a's of every group
        # then b's: both sides of a group at once, from the bucket's two planes [>= 0, not >= 0]
        means = p.new_empty(2 * columns)
        counts = torch.empty(2 * columns, dtype=torch.int32, device=p.device)
        planes = (p >= 0).unsqueeze(0) == plan.sides  # (2, n); NaN is on b's side
        at = 0
        for size, rows, cols in groups:
            M = layout.rows(p, size).view(-1, rows, cols)
            placed = slice(at, at + M.shape[0] * cols)
            sides = _group_planes(planes, layout, size, rows, cols)  # (2, matrices, rows, cols)
            torch.sum(sides, dim=2, dtype=torch.int32, out=counts.view(2, columns)[:, placed].view(2, -1, cols))
            torch.sum(torch.where(sides, M.unsqueeze(0), plan.zero), dim=2,
                      out=means.view(2, columns)[:, placed].view(2, -1, cols))
            at = placed.stop
        del planes
        if groups:
            means.div_(counts.clamp_(min=1))
        gathered = yield AllGather((means, _bucket_signs(p)))
        # 2 j + 1 for an element of column j: the eager path's index, made where it is first needed
        column_at = functools.cache(lambda: plan.column_index().mul_(2).add_(1))

        def decoded(fields):
            at = column_at()
            # One gather from the (a_j, b_j) pairs, at 2 j + 1 - bit: a bucket's floats once, not three
            # times; the bits taken off the index and put back, exactly, rather than a new index per rank.
            pairs = fields[0].view(2, columns).t().reshape(-1)
            bits = bits_of(fields[1], layout.numel)
            values = pairs.index_select(0, at.sub_(bits))
            at.add_(bits)
            return values
        fused = None
        if plan.table is not None and _onebit_decoded.wanted(layout.numel, p):
            fused = lambda out, fields, add: _onebit_decoded.ahead(  # noqa: E731
                out, fields[0], fields[1], layout.tensor_starts, *plan.table, add=add)

        def summed(ranks):  # rank order, as exchange() adds the decoded tensors
            return summed_in_rank_order(ranks, layout.numel, p.device, fused, decoded)
        own = gathered[b.rank]
        return Exchanged(summed(gathered).div_(world), lambda: summed([own]))

    def bucket_payload_bytes(self, layout):
        return 8 * _columns(layout)[1] + packed_nbytes(layout.numel, 1)


#: Per bucket layout, 1-bit SGD's columns (see :func:`_columns`), built once.
_COLUMNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _group_planes(planes: torch.Tensor, layout, size, rows: int, cols: int) -> torch.Tensor:
    """The matrices of one group (``size``'s members, rows x cols each) in both of the (2, n) bucket's
    ``planes``, as (2, members, rows, cols): a view where they lie at equal distances, else stacked."""
    one = strided_at(planes[0], [layout.offsets[i] for i in size.members], (size.numel,))
    if one is None:
        return torch.stack([layout.rows(plane, size) for plane in planes]).view(2, -1, rows, cols)
    return planes.as_strided((2, one.shape[0], rows, cols), (planes.stride(0), one.stride(0), cols, 1),
                             one.storage_offset())


def _columns(layout) -> tuple:
    """1-bit SGD's columns of a bucket: (groups, columns, plan).  ``groups``: the non-empty tensors of
    one matrix shape, as (SizeClass, rows, cols); ``columns``: their number of columns in all, in group
    order, a group's members one after another; ``plan``: a :class:`_ColumnIndex`, which gives each
    element of the bucket its column's place in that order.  Built by a loop over the tensors, once per
    layout."""
    cached = _COLUMNS.get(layout)
    if cached is not None:
        return cached
    groups, first_column, columns = [], {}, 0
    for size in layout.classes:
        shapes: dict = {}
        for i in size.members:
            shapes.setdefault(OneBit.matrix_shape(layout.shapes[i]), []).append(i)
        for (rows, cols), members in shapes.items():
            starts = torch.tensor([layout.offsets[i] for i in members], dtype=torch.int64, device=layout.device)
            groups.append((SizeClass(size.numel, tuple(members), starts), rows, cols))
            for j, i in enumerate(members):
                first_column[i] = (columns + j * cols, cols)
            columns += len(members) * cols
    cached = _COLUMNS[layout] = (tuple(groups), columns, _ColumnIndex(layout, first_column, columns))
    return cached


class _ColumnIndex:
    """Each element's column (int32 if the columns allow) over a bucket, rebuilt at every exchange from
    a description of O(rows) numbers rather than kept: a kept index would hold a copy of the bucket (in
    int32) for every bucket of the model.  Along the bucket an element's column is the previous one's
    plus 1 within a matrix's row, plus 0 within a vector (one column), and a jump at each row's first
    element; so the index is a cumulative sum of those steps, the steps themselves a cumulative sum of
    the step's changes at the tensors' starts, with the jumps written over them."""

    def __init__(self, layout, first_column: dict, columns: int):
        device = layout.device
        self.zero = torch.zeros((), device=device)  # what torch.where writes where a side does not hold
        self.sides = torch.tensor([True, False], device=device).view(2, 1)  # a_j's side, then b_j's
        self.numel, self.dtype = layout.numel, torch.int32 if columns < 2**31 else torch.int64
        changes_at, changes, jumps_at, jumps = [], [], [], []
        step, previous = 0, 0  # the step inside the tensor before, and the last element's column
        for i in sorted(first_column, key=lambda i: layout.offsets[i]):  # bucket order
            base, cols = first_column[i]
            offset, n = layout.offsets[i], layout.numels[i]
            inside = 1 if cols > 1 else 0
            if inside != step:
                changes_at.append(offset)
                changes.append(inside - step)
                step = inside
            if cols > 1:  # a row's first element: from the last column of the row before to this one's first
                starts = torch.arange(offset, offset + n, cols)
                jumps_at.append(starts)
                jumps.append(torch.cat([torch.tensor([base - previous]), torch.full((len(starts) - 1,), 1 - cols)]))
            else:
                jumps_at.append(torch.tensor([offset]))
                jumps.append(torch.tensor([base - previous]))
            previous = base + cols - 1
        self.changes_at = torch.tensor(changes_at, dtype=torch.int64, device=device)
        self.changes = torch.tensor(changes, dtype=self.dtype, device=device)
        self.jumps_at = torch.cat(jumps_at).to(device) if jumps_at else self.changes_at[:0]
        self.jumps = torch.cat(jumps).to(device=device, dtype=self.dtype) if jumps else self.changes[:0]

        # For a kernel (:func:`_onebit_decoded`): per tensor its offset, columns and first column, int32
        # (None where int32 does not hold them); an empty tensor's 1 column keeps the remainder defined.
        self.table = None
        if self.dtype == torch.int32 and layout.numel < 2**31:
            self.table = int32_columns([(offset, *first_column.get(i, (0, 1))[::-1])
                                        for i, offset in enumerate(layout.offsets)], 3, device)

    def column_index(self) -> torch.Tensor:
        steps = torch.zeros(self.numel, dtype=self.dtype, device=self.jumps.device)
        steps.index_put_((self.changes_at,), self.changes).cumsum_(0)
        return steps.index_put_((self.jumps_at,), self.jumps).cumsum_(0)


@kernels.fused
def _onebit_decoded(out, means, packed, tensor_starts, offsets, cols, bases, *, add: bool):
    """One rank's 1-bit SGD payload decoded into ``out`` or (``add``) added to it: element e of tensor t
    (its ``segment_of`` ``tensor_starts``) lies in column j = base_t + (e - offset_t) mod cols_t (per
    tensor ``offsets``, ``cols``, ``bases``), and decodes to a_j where its bit is 1, else b_j (``means``:
    the C a's, then the C b's, whole: a view of the b's would start unaligned for a GPU kernel, which
    would then copy it): the reference path's column index, bits and gather in one loop, no index over
    the bucket made."""
    n, columns = out.shape[0], means.shape[0] // 2
    at = torch.arange(n, dtype=torch.int32, device=out.device)
    tensor = segment_of(n, tensor_starts, out.device)
    offset, cols, base = (t.index_select(0, tensor) for t in (offsets, cols, bases))
    column = base + torch.remainder(at - offset, cols.clamp(min=1))  # >= 1 already; the compile's check passes 0s
    bit = _bits_at(packed, at)
    value = torch.where(bit == 1, means.index_select(0, column), means.index_select(0, column + columns))
    return out.add_(value) if add else out.copy_(value)


class _SignVote(GatheredCompressor):
    """signSGD's protocol: allgather each worker's signs (and scale), aggregate by majority vote.

    ``zeros="abstain"`` sends ternary codes, so an exact zero votes for neither sign; ``"plus"`` sends
    one bit, reading 0 as +1.  ``scaled=True`` multiplies the vote by s = mean_r ||y_r||_1 / n, where
    y_r is what rank r signs; each rank sends its ||y_r||_1 / n as one fp32 beside the codes.
    """

    done_with_input_early = True

    def __init__(self, scaled: bool = True, zeros: str = "abstain", feedback: Optional[str] = None):
        super().__init__(feedback)
        if not isinstance(scaled, bool):
            raise ValueError(f"scaled must be True or False, got {scaled!r}")
        if zeros not in ZEROS:
            raise ValueError(f"zeros must be one of {list(ZEROS)}, got {zeros!r}")
        self.scaled = scaled
        self.zeros = zeros

    @property
    def carries_nonfinite(self) -> bool:
        # Scaled, a NaN or Inf in any rank's input makes its ||y_r||_1 / n non-finite, hence the summed
        # scale on every rank, and the bound of s * V that the owner checks: the input need not be read.
        return self.scaled

    def signs_of(self, x: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """The tensor whose signs are sent (the input for signSGD, the momentum for Signum)."""
        return x

    @property
    def ternary(self) -> bool:
        return self.zeros == "abstain"

    def compress(self, x, ctx):
        y = self.signs_of(x, ctx)
        codes = encode_trits(y) if self.ternary else encode_signs(y)
        return (mean_abs(y), codes) if self.scaled else (codes,)

    def decompress(self, fields, ctx, out: Optional[torch.Tensor] = None):
        """One rank's contribution as the receivers read it: s_r * sign(y_r) (or sign(y_r) unscaled)."""
        n = ctx.shape.numel()
        if self.ternary:
            signs = _as_float(decode_trits(fields[-1], n), (n,), out)
        else:
            signs = decode_signs(fields[-1], (n,), out)
        return (signs.mul_(fields[0].reshape(())) if self.scaled else signs).reshape(ctx.shape)

    def exchange(self, x, ctx):
        # Vote on the codes directly; decode this rank's own signs only if error feedback asks for them.
        fields = self.compress(x, ctx)
        gathered = yield AllGather(tuple(fields), same_size=True)
        aggregate = ctx.buffer("aggregate", ctx.shape, torch.float32, x.device)
        scale = None
        if self.scaled:  # summed in rank order: the same float on every rank
            scale = gathered[0][0].clone()
            for fields_r in gathered[1:]:
                scale += fields_r[0]
            scale = scale.div_(len(gathered)).reshape(())
        if self.ternary:
            vote = vote_of_trits([f[-1] for f in gathered], ctx.shape, aggregate, scale)
        else:
            vote = vote_of_bits([f[-1:] for f in gathered], ctx.shape, aggregate)
            if scale is not None:
                vote.mul_(scale)
        own = gathered[ctx.rank]
        # Votes are -1, 0 or +1: |s V| <= |s|
        bound = scale.abs().reshape(()) if self.scaled else torch.ones(())
        return Exchanged(vote, lambda: self.decompress(own, ctx),
                         sent_into=lambda out: self.decompress(own, ctx, out.view(-1)), bound=bound)

    def payload_bytes(self, ctx, kept=None):
        n = ctx.shape.numel()
        return 4 * self.scaled + (trits_nbytes(n) if self.ternary else packed_nbytes(n, 1))

    bucketed = True

    def bucket_signs_of(self, p: torch.Tensor, b) -> torch.Tensor:
        """:meth:`signs_of` for a whole bucket (flat): the input itself for signSGD."""
        return p

    def bucket_exchange(self, p, b):
        """Per tensor i, as :meth:`exchange`: each rank r sends the signs of y_r (the input; Signum: its
        momentum) and, if ``scaled``, s_ri = ||y_ri||_1 / n_i by one segmented sum; the aggregate is
        V = sign(sum_r sign(y_r)) elementwise (ties 0), times s_i = mean_r s_ri over tensor i's elements.
        Wire: the bucket's codes in one field, ceil(n / 5) bytes (ternary) or ceil(n / 8) (one bit) for
        the bucket's n, plus 4 bytes per tensor if ``scaled``."""
        layout, n = b.layout, b.layout.numel
        y = self.bucket_signs_of(p, b)
        codes = _bucket_trit_codes(y) if self.ternary else _bucket_signs(y)
        scales = layout.segment_mean(y.abs()) if self.scaled else None
        gathered = yield AllGather((codes,) if scales is None else (scales, codes))
        own = gathered[b.rank]
        if scales is not None:  # spread over the elements before the vote exists: one bucket copy less at once
            ranks = [fields[0] for fields in gathered]
            # rank order, as exchange() sums the scales; the first sum (or the lone rank's mean) is new
            # memory, not the own field's
            s = torch.add(ranks[0], ranks[1]) if len(ranks) > 1 else ranks[0] / 1
            for scale in ranks[2:]:
                s += scale
            s.div_(b.world_size)
            bound = s.abs().amax()  # votes are -1, 0 or +1: |s V| <= max_i |s_i|; NaN poisons the step
            if self.ternary and _bucket_trit_vote.wanted(n, p):
                vote = _bucket_trit_vote.ahead(torch.empty(n, dtype=torch.float32, device=p.device),
                                               _inverse_powers_of_3(p.device), s, layout.tensor_starts,
                                               *(fields[-1] for fields in gathered))
                if vote is not None:
                    return Exchanged(vote, lambda: self._bucket_sent(own, layout), bound=bound)
            spread = layout.per_element(s)
        if self.ternary:
            vote = vote_of_trits([f[-1] for f in gathered], (n,), torch.empty(n, dtype=torch.float32, device=p.device))
        else:  # sum_r (+-1) is an exact integer: its sign is the majority
            vote = unpack_signs(gathered[0][-1], n)
            for fields in gathered[1:]:
                vote += unpack_signs(fields[-1], n)
            vote.sign_()
        if scales is not None:
            vote.mul_(spread)
        else:
            bound = _one(p.device)
        return Exchanged(vote, lambda: self._bucket_sent(own, layout), bound=bound)

    def _bucket_sent(self, fields, layout) -> torch.Tensor:
        """This rank's contribution as the receivers read it, s_ri * sign(y_r) (or sign(y_r)), flat."""
        codes, n = fields[-1], layout.numel
        if self.ternary:
            signs = decode_trits(codes, n).float()
            return signs.mul_(layout.per_element(fields[0])) if self.scaled else signs
        return signed_(layout.per_element(fields[0]), codes) if self.scaled else unpack_signs(codes, n)

    def bucket_payload_bytes(self, layout):
        n = layout.numel
        return 4 * self.scaled * len(layout) + (trits_nbytes(n) if self.ternary else packed_nbytes(n, 1))


@register
class SignSGD(_SignVote):
    """signSGD with majority vote (Bernstein et al., ICML 2018, "signSGD: compressed optimisation for
    non-convex problems").

    Each worker sends sign(x_r); the aggregate is V = sign(sum_r sign(x_r)) (ties give 0), times
    s = mean_r ||x_r||_1 / n by default.

    - ``scaled=True`` (default): aggregate s * V, so the step has the gradient's size and the learning
      rate of plain SGD works; the scale is EF-signSGD's ||x||_1 / n (Karimireddy et al., ICML 2019)
      averaged over workers.  ``scaled=False`` is the paper's update: V alone, the learning rate is the
      step length of every coordinate.
    - ``zeros="abstain"`` (default): sign(0) = 0, so a coordinate whose gradient is exactly zero on
      every rank (unused embedding rows, dead ReLU units) gets V = 0 and does not move.  ``zeros="plus"``
      is the paper's 1-bit code, sign(0) = +1: such a coordinate moves by the learning rate every step.

    Wire (allgathered): codes, ceil(n / 5) bytes (ternary, five per byte) or ceil(n / 8) bytes (one
    bit, ``zeros="plus"``), plus 4 bytes for the fp32 scale if ``scaled``.  Residual feedback keeps
    x - s_r sign(x_r) (x - sign(x) unscaled); ``efsignsgd`` is the method designed for it.
    """

    name = "signsgd"

    def __init__(self, scaled: bool = True, zeros: str = "abstain", feedback: Optional[str] = None):
        super().__init__(scaled, zeros, feedback)


@register
class Signum(_SignVote):
    """Signum with majority vote (Bernstein et al., ICML 2018, as ``signsgd``, on the momentum).

    m = beta * m + (1 - beta) * x, kept per tensor (staged in ``ctx``, committed only when the exchange
    succeeded); each worker sends sign(m_r); the aggregate is V = sign(sum_r sign(m_r)) (ties 0), times
    s = mean_r ||m_r||_1 / n when ``scaled`` (default).  ``scaled`` and ``zeros`` mean what they mean for
    ``signsgd``: ``scaled=False, zeros="plus"`` is the paper's update.  The momentum lives here, so the
    optimizer must use none of its own (``applies_momentum``: the integrations raise otherwise).  Wire:
    as ``signsgd``, ceil(n / 5) or ceil(n / 8) bytes, plus 4 if ``scaled``.
    """

    name = "signum"
    state_key = "signum_momentum"  # distinct from feedback.py's "momentum"

    def __init__(self, beta: float = 0.9, scaled: bool = True, zeros: str = "abstain",
                 feedback: Optional[str] = None):
        super().__init__(scaled, zeros, feedback)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"beta must be a number with 0 <= beta < 1, got {beta!r}")
        self.beta = float(beta)

    @property
    def applies_momentum(self) -> bool:
        """Signum's momentum is this compressor's state: the optimizer must add none."""
        return True

    def _momentum(self, m: torch.Tensor, x: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """beta * m + (1 - beta) * x, never in the committed m's memory (it may still be read): in its
        spare where the state keeps one, else in a fresh tensor (fused where that pays)."""
        fusable = all(t.dtype == torch.float32 and t.is_contiguous() for t in (m, x)) and ctx.scale is None
        if ctx.buffers is None and fusable and kernels.enabled(x.numel()):
            fused = _momentum(m, x, beta=self.beta)  # same layout, so mean_abs adds in the same order
            if fused is not None:
                return fused
        step = torch.mul(x, 1 - self.beta, out=workspace("signum", x.numel(), x.dtype, x.device).view(x.shape))
        out = ctx.spare(self.state_key, m) if m.is_contiguous() else None  # a spare is contiguous
        return torch.mul(m, times_scale(self.beta, ctx.scale), out=out).add_(step)

    def signs_of(self, x, ctx):
        m = ctx.get(self.state_key)
        if m is None:
            m = (1 - self.beta) * x
        else:  # beta * m + (1 - beta) * x, rounded as written
            m = self._momentum(m, x, ctx)
        ctx.set(self.state_key, m if ctx.scale is None else m / ctx.scale)  # kept unscaled (ctx.scale)
        return m

    bucket_state = (state_key,)

    def bucket_signs_of(self, p, b):
        """m = beta * m + (1 - beta) * p over the whole bucket (float32), rounded as :meth:`signs_of`."""
        m = b.get(self.state_key)
        if m is None:
            m = torch.mul(p, 1 - self.beta)
        else:
            m = torch.mul(m, times_scale(self.beta, b.scale)).add_(torch.mul(p, 1 - self.beta))
        b.set(self.state_key, m if b.scale is None else m / b.scale)  # kept unscaled (b.scale)
        return m


@register
class EFSignSGD(GatheredCompressor):
    """EF-signSGD (Karimireddy et al., ICML 2019, "Error feedback fixes SignSGD and other gradient
    compression schemes").

    delta = (||p||_1 / n) * sign(p), with p the error-compensated input and the residual e = p - delta
    kept by residual feedback (the default).  The paper forms p = lr * g + e; with a constant learning
    rate, running the same recursion on g and letting the optimizer multiply by lr is equivalent (the
    residual is e / lr); under a schedule the kept residual is not rescaled when lr changes.  An exact
    zero is sent as +scale (1 bit); the residual sends it back, so a coordinate whose gradient is always
    0 oscillates within about one step and does not drift.  Wire: fp32 scale + ceil(n / 8) bytes =
    4 + ceil(n / 8), allgathered; the aggregate is the mean over workers of their deltas.
    """

    name = "efsignsgd"
    default_feedback = "residual"
    decodes_into = True
    # Every tensor's ||p||_1 / n is sent: a NaN or Inf in any rank's p makes it non-finite, hence the
    # aggregate (and its bound) on every rank, which the owner checks: the input need not be read.
    carries_nonfinite = True

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        sums = ctx.precomputed  # ||x||_1's chunk sums, taken as residual feedback wrote x = g + e
        scale = mean_abs(x) if sums is None else (sums.sum() / max(x.numel(), 1)).reshape(1)
        return scale, encode_signs(x)

    def read_while_written(self, ctx):
        # mean_abs's chunk sums, each from its chunk of p = g + e while it is cached: the same chunks
        # (chunked_sum's are feedback's), the same sums, without reading p again.
        n, size = ctx.shape.numel(), kernels.CHECK_CHUNK
        sums = ctx.precomputed = torch.empty(-(-n // size), dtype=torch.float32)
        scratch = workspace("abs", size, torch.float32, torch.device("cpu"))

        def observe(p, start, stop):
            chunk = torch.abs(p[start:stop], out=scratch[:stop - start])
            torch.sum(chunk, 0, dtype=torch.float32, out=sums[start // size])

        return observe

    def decompress(self, fields, ctx, out: Optional[torch.Tensor] = None):
        return self._delta(fields, ctx.shape, out)

    @staticmethod
    def _delta(fields, shape, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One rank's scale * sign(p) of ``shape`` (into ``out`` if given)."""
        scale, packed = fields
        return decode_signs(packed, shape, out).mul_(scale.reshape(()))

    def subtract_sent(self, fields, ctx):
        # p - scale * sign(p) in one fused pass over p, instead of decoding the own signs (unpack,
        # convert, scale: about three passes) and subtracting them.
        if not kernels.enabled(ctx.shape.numel()):
            return None
        scale = fields[0].reshape(())
        return lambda p: None if _minus_scaled_signs(p.view(-1), scale) is None else p

    def aggregate_bound(self, gathered, ctx):
        # Every rank sends +-scale_r: the sum, and so the mean, is at most sum_r |scale_r|
        return torch.stack([fields[0].reshape(()).abs() for fields in gathered]).sum()

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor i of the bucket, scale_i = ||p_i||_1 / n_i by one segmented sum; the signs of the
        whole bucket packed together.  Wire: 4 bytes per tensor + ceil(n / 8) for the bucket's n."""
        layout = b.layout
        scales = layout.segment_mean(p.abs())
        gathered = yield AllGather((scales, _bucket_signs(p)))
        # each element's tensor, made where the eager path first needs it: one spreads every rank's scales
        index = functools.cache(layout.segment_index)
        decoded = lambda fields: _scaled_signs(*fields, index())  # noqa: E731
        fused = None
        if _ef_decoded.wanted(layout.numel, p):
            fused = lambda out, fields, add: _ef_decoded.ahead(out, *fields, layout.tensor_starts, add=add)  # noqa: E731
        total = summed_in_rank_order(gathered, layout.numel, p.device, fused, decoded)  # as exchange() sums the deltas
        own = gathered[b.rank]
        bound = torch.stack([scale.abs().amax() if scale.numel() else scale.new_zeros(()) for scale, _ in gathered]).sum()
        residual = None
        if _ef_bucket_residual.wanted(layout.numel, layout.device):
            residual = lambda q: _ef_bucket_residual.ahead(q, own[0], layout.tensor_starts)  # noqa: E731
        return Exchanged(total.div_(b.world_size), lambda: decoded(own), bound=bound, subtract_sent=residual)

    def bucket_payload_bytes(self, layout):
        return 4 * len(layout) + packed_nbytes(layout.numel, 1)

    def decoded_mean(self, gathered, ctx):
        n, world = ctx.shape.numel(), len(gathered)
        aggregate = ctx.buffer("aggregate", ctx.shape, torch.float32, gathered[0][1].device)
        whole = n // 8
        flat = aggregate.view(-1)
        if kernels.enabled_over_ranks(n, world) and _mean_of_scaled_signs(
                flat[:8 * whole].view(whole, 8), torch.cat([fields[0].reshape(1) for fields in gathered]),
                *(fields[1][:whole] for fields in gathered)) is not None:
            if n > 8 * whole:  # the last, partly used byte, as the reference decodes it
                flat[8 * whole:] = self._decoded_mean([(s, p[whole:]) for s, p in gathered], n - 8 * whole)
            return aggregate
        return self._decoded_mean(gathered, n, aggregate).view(ctx.shape)

    @staticmethod
    def _decoded_mean(gathered, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """combine()'s mean of the first n elements of the ranks' deltas, summed in rank order, each
        rank decoded as :meth:`decompress` does, into reused memory: the same floats (1-D)."""
        total = EFSignSGD._delta(gathered[0], (n,), out)
        for fields in gathered[1:]:
            total += EFSignSGD._delta(fields, (n,), workspace("decoded", n, torch.float32, total.device))
        return total.div_(len(gathered))

    def payload_bytes(self, ctx, kept=None):
        return 4 + _bits_bytes(ctx)
