"""Quantisation: send every element, each in a few bits, with stochastic rounding that keeps E[Q(x)] = x.

All three methods here are unbiased, so they need no error feedback (``default_feedback = "none"``).
Their rounding noise comes from ``ctx.generator(shared=False)``: independent on every worker, so it
averages out across workers instead of adding up.  Codes are packed densely with :mod:`gradzip.bits`.

On the bucket route (``bucket_exchange``) the same per-tensor quantisers run on a whole bucket at once:
per-tensor (QSGD: per-chunk) scales by segmented reductions, draws by counter
(``BucketContext.uniforms(..., shared=False)``), and the bucket's codes packed together by tensor
operations (:func:`_pack_codes`, the layout of :func:`gradzip.bits.pack_bits`).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

from .. import devices, kernels
from ..bits import byte_table, lookup_codes, pack_bits, packed_nbytes, unpack_bits
from .base import (AllGather, AllReduce, Compressor, Exchanged, GatheredCompressor, TensorContext, chunked_sum, compare,
                   packed_codes, workspace)
from .bucket import segment_of, summed_in_rank_order
from .registry import register


def _round_up(p: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
    """Bernoulli(p) draws from this worker's private stream: True means "take the upper level".

    fp32 uniforms are multiples of 2^-24, so P(u < p) is exact for p on that grid (natural compression's
    mantissa fractions m / 2^23 are) and within 2^-24 of p otherwise.  The result is a reused buffer
    (see :func:`workspace`): use it before the next ``yield``.
    """
    n, device = p.numel(), p.device
    u = _uniforms(n, ctx, device)
    return compare("lt", u.view(p.shape), p, workspace("round_up", n, torch.bool, device).view(p.shape))


def _uniforms(n: int, ctx: TensorContext, device: torch.device) -> torch.Tensor:
    """n fp32 uniforms in [0, 1) from this worker's private stream (a reused buffer, as in _round_up)."""
    return torch.rand(n, generator=ctx.generator(device, shared=False), device=device,
                      out=workspace("uniform", n, torch.float32, device))


def _seed(ctx: TensorContext, device: torch.device) -> torch.Tensor:
    """A 0-d int32 seed for :func:`kernels.counter_uniforms` from this worker's private stream."""
    gen = ctx.generator(device, shared=False)
    return torch.randint(-2**31, 2**31, (), generator=gen, dtype=torch.int32, device=device)


def _kernel_draws(n: int, ctx: TensorContext, device: torch.device, drawn: Optional[int] = None) -> torch.Tensor:
    """What a fused kernel takes its n uniforms from (:func:`kernels.uniforms_from`): on CPUs a seed,
    the kernel making the draws in its loop (writing them with torch.rand costs some eight passes
    there); on GPUs, where torch.rand is cheap and the hash's integer arithmetic has not been
    tested, the first n of torch.rand's ``drawn`` (default n) draws, as the reference path takes them."""
    return _seed(ctx, device) if devices.draws_in_kernel(device) else _uniforms(drawn or n, ctx, device)[:n]
def _decodes_fused(n: int, world: int, device: torch.device) -> bool:
    """Whether a decoding kernel takes the mean of ``world`` payloads of n elements.  On CPUs the byte
    table's path costs one to three passes more, which repays a kernel's compile only from
    :data:`kernels.LARGE_NUMEL` elements; elsewhere the kernels are the fast path from ``MIN_NUMEL``."""
    return (kernels.enabled_over_ranks(n, world)
            and (not devices.decodes_by_table(device) or n >= kernels.LARGE_NUMEL))



def _table_decodes(packed: torch.Tensor, bits: int) -> bool:
    """Whether codes are decoded with :func:`gradzip.bits.lookup_codes`, eagerly: on CPUs Inductor's loop
    that unpacks codes stays scalar, and took three times as long (113 ms for QSGD's 25M codes
    against 42).  Elsewhere the fused kernels decode."""
    return devices.decodes_by_table(packed) and 8 % bits == 0


@functools.lru_cache(maxsize=64)
def _signed_levels(bits: int, device: torch.device) -> torch.Tensor:
    """sign * xi for every QSGD code (bit 0 = sign, bits above = xi); -0.0 for a negative zero level."""
    return torch.tensor([(-1.0 if c & 1 else 1.0) * (c >> 1) for c in range(2**bits)], device=device)


@functools.lru_cache(maxsize=64)
def _signed_level_bytes(bits: int, device: torch.device) -> torch.Tensor:
    return byte_table(_signed_levels(bits, device), bits)


@functools.lru_cache(maxsize=8)
def _ternary_bytes(device: torch.device) -> torch.Tensor:
    """t = code - 1 for TernGrad's 2-bit codes t + 1, by byte."""
    return byte_table(torch.arange(4, dtype=torch.float32, device=device) - 1, 2)


@functools.lru_cache(maxsize=8)
def _natural_values(device: torch.device) -> torch.Tensor:
    """The value of each of the 256 natural-compression codes: sign bit 7, 2^(e - 64) for e = bits 0..6 > 0,
    0 for e = 0, NaN for 0x80."""
    codes = torch.arange(256, dtype=torch.int32, device=device)
    e = codes & 0x7F
    magnitude = ((e + 63) << 23).view(torch.float32)  # 2^(e-64): biased fp32 exponent e - 64 + 127
    magnitude = torch.where(e > 0, magnitude, 0.0)
    value = torch.where((codes & 0x80) != 0, -magnitude, magnitude)
    return torch.where(codes == Natural._NONFINITE, math.nan, value)


def _check_int(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


@functools.lru_cache(maxsize=32)
def _code_shifts(bits: int, device: torch.device) -> torch.Tensor:
    """The shift of each of a byte's 8 // bits codes, first code lowest (uint8)."""
    return torch.arange(0, 8, bits, dtype=torch.uint8, device=device)


def _pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The flat integer ``codes`` (each below 2^bits) packed as :func:`gradzip.bits.pack_bits` packs them
    (code i in bits [i*bits, (i+1)*bits), little-endian), ceil(n * bits / 8) bytes, by tensor
    operations alone (no numpy, no host read): 8 // bits codes a byte where that divides, else a
    stream of single bits."""
    device = codes.device
    if 8 % bits:
        planes = torch.arange(bits, dtype=torch.int32, device=device)
        codes, bits = ((codes.to(torch.int32).unsqueeze(1) >> planes) & 1).view(-1), 1
    n, per = codes.numel(), 8 // bits
    padded = torch.zeros(-(-n // per) * per, dtype=torch.uint8, device=device)
    padded[:n] = codes
    return (padded.view(-1, per) << _code_shifts(bits, device)).sum(dim=1, dtype=torch.uint8)


def _unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack_codes`: the first n codes (uint8 where 8 % bits == 0, else int32)."""
    device = packed.device
    if 8 % bits == 0:
        return ((packed.unsqueeze(1) >> _code_shifts(bits, device)) & ((1 << bits) - 1)).view(-1)[:n]
    stream = ((packed.unsqueeze(1) >> _code_shifts(1, device)) & 1).view(-1)[:n * bits]
    planes = torch.arange(bits, dtype=torch.int32, device=device)
    return (stream.view(n, bits).to(torch.int32) << planes).sum(dim=1, dtype=torch.int32)


def qsgd_reference(x: torch.Tensor, s: int, u: torch.Tensor, bucket_size: int = 512,
                   norm: str = "l2") -> torch.Tensor:
    """QSGD's Q_s as the paper writes it, bucket by bucket, given one uniform u_i in [0, 1) per element.

    For a bucket v:  r_i = |v_i| s / ||v||,  l_i = floor(r_i),  xi_i = l_i + [u_i < r_i - l_i],
    Q(v_i) = ||v|| sign(v_i) xi_i / s.  The fast path (:class:`QSGD`) computes the same values in the
    same float order from the same draws (tested bit for bit).
    """
    flat, draws = x.reshape(-1).float(), u.reshape(-1)
    out = torch.zeros_like(flat)
    for start in range(0, flat.numel(), bucket_size):
        v, ub = flat[start:start + bucket_size], draws[start:start + bucket_size]
        # The norm of the bucket zero-padded to bucket_size: the same value, summed in the fast path's order.
        whole = torch.cat([v, v.new_zeros(bucket_size - v.numel())])
        scale = torch.linalg.vector_norm(whole) if norm == "l2" else whole.abs().max()
        if scale == 0:
            continue
        r = v.abs() * (s / scale)
        xi = (r.floor() + (ub < r - r.floor()).float()).clamp(0, s)
        out[start:start + bucket_size] = torch.sign(v) * xi * (scale / s)
    return out.reshape(x.shape)


def natural_reference(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Natural compression as the paper writes it, given one uniform u_i in [0, 1) per element.

    For |x| in [2^a, 2^(a+1)):  p = |x| / 2^a - 1,  C(x) = sign(x) 2^(a+1) if u < p else sign(x) 2^a.
    gradzip's wire adds a range: below 2^-63 the two levels are 0 and 2^-63 (p = |x| 2^63), from 2^63
    up the value is clamped to 2^63, and NaN/Inf decode to NaN.  The fast path (:class:`Natural`) reads p
    off the fp32 bit pattern; it is tested against this bit for bit.
    """
    flat, draws = x.reshape(-1).float(), u.reshape(-1)
    mantissa, exponent = torch.frexp(flat.abs())  # |x| = mantissa 2^exponent, mantissa in [0.5, 1)
    a = (exponent - 1).float()
    p = mantissa * 2 - 1
    tiny = flat.abs() < 2.0**-63
    a, p = torch.where(tiny, -64.0, a), torch.where(tiny, flat.abs() * 2.0**63, p)
    level = torch.exp2((a + (draws < p).float()).clamp(max=63))
    out = torch.where(level < 2.0**-63, 0.0, level) * torch.sign(flat)
    return torch.where(torch.isfinite(flat), out, float("nan")).reshape(x.shape)


def _qsgd_codes(flat, scale, draws, s: int, bs: int):
    """QSGD's codes: ratio = |v_i| * (s / ||v||), xi = floor(ratio) + [u < frac(ratio)] clamped to
    0..s, code = 2 xi + [v_i < 0] (as :meth:`QSGD.compress`, u from ``draws``), int32."""
    u = kernels.uniforms_from(flat, draws)
    ratio = flat.abs() * kernels.repeat_each(scale, bs, flat.shape[0])
    xi = torch.floor(ratio) + (u < torch.frac(ratio)).to(ratio.dtype)
    return xi.to(torch.int32).clamp(0, s) * 2 + (flat < 0).to(torch.int32)


@kernels.fused
def _qsgd_encode(flat, scale, draws, *, s: int, bs: int, bits: int):
    """QSGD's packed codes in one loop (GPUs; see :func:`gradzip.devices.packs_from_bytes`)."""
    return kernels.pack_codes(_qsgd_codes(flat, scale, draws, s, bs), bits)


@kernels.fused
def _qsgd_bucket_encode(p, scale, chunk_starts, seed, *, s: int, bits: int):
    """QSGD's packed codes of a whole bucket in one loop (:meth:`QSGD.bucket_exchange`): each element's
    chunk scale gathered by its chunk (``segment_of`` the layout's chunk starts), its uniform drawn from
    ``seed`` by counter."""
    ratio = p.abs() * scale.index_select(0, segment_of(p.shape[0], chunk_starts, p.device))
    u = kernels.counter_uniforms(p, seed)
    xi = torch.floor(ratio) + (u < torch.frac(ratio)).to(ratio.dtype)
    return kernels.pack_codes(xi.to(torch.int32).clamp(0, s) * 2 + (p < 0).to(torch.int32), bits)


def _spread(scale, starts, n, device):
    """Each of n elements' segment's ``scale`` (segments after the first starting at ``starts``)."""
    return scale.index_select(0, segment_of(n, starts, device))


@kernels.fused
def _bucket_residual(p, table, packed, scale, starts):
    """Error feedback's p - C(p) of this rank's own bucket payload, written into ``p``, for the codes
    whose value is their byte's entry of ``table`` times their segment's ``scale`` (segments starting
    at ``starts``): QSGD's sign * xi times its chunk's ||v|| / s (as :meth:`QSGD._bucket_decoded`),
    TernGrad's trit times its tensor's scaler; the reference paths' lookup and product, in one loop."""
    return p.sub_(lookup_codes(packed, table, p.shape[0]) * _spread(scale, starts, p.shape[0], p.device))


@kernels.fused
def _bucket_decoded(out, table, packed, scale, starts, *, add: bool):
    """One rank's payload decoded as :func:`_bucket_residual` reads it (QSGD's sign * xi * ||v|| / s),
    written into ``out`` or (``add``) added to it, the ranks in rank order: the reference path's
    lookup, spread, product and sum in one loop, where they are a bucket-sized gather each."""
    value = lookup_codes(packed, table, out.shape[0]) * _spread(scale, starts, out.shape[0], out.device)
    return out.add_(value) if add else out.copy_(value)


@kernels.fused
def _codes_summed(out, table, packed, *, add: bool):
    """One rank's code values (TernGrad's trits) written into ``out`` or (``add``) added to it: the
    ranks' exact sum, in one loop per rank."""
    value = lookup_codes(packed, table, out.shape[0])
    return out.add_(value) if add else out.copy_(value)


@kernels.fused
def _segments_scaled(out, scale, starts, *, world: int):
    """``out`` times its segment's ``scale``, over ``world``, in place (TernGrad's summed trits times
    each tensor's scaler, the mean): the reference path's spread, product and quotient in one loop."""
    return out.mul_(_spread(scale, starts, out.shape[0], out.device)).div_(world)


@kernels.fused
def _qsgd_code_bytes(flat, scale, draws, out, *, s: int, bs: int):
    """QSGD's codes a byte each into ``out``, for :func:`kernels.pack_bytes` (CPUs)."""
    return out.copy_(_qsgd_codes(flat, scale, draws, s, bs).to(torch.uint8))


@kernels.fused
def _qsgd_mean(out, steps, *packed, bits: int, per: int):
    """The mean over ranks of Q = (sign * xi) * (||v|| / s) for whole buckets, summed in rank order and
    divided as :meth:`GatheredCompressor.combine` does, into ``out`` laid out (bucket, word, code):
    ``packed[r]`` (buckets, words) holds rank r's codes in words of ``per`` codes (bytes, or pairs of
    bytes read as int16 where that gives 8 codes, a float32 vector's width), ``steps`` (ranks,
    buckets).  No element's word or bucket is found by a division (a flat layout's loop stays scalar
    on CPUs); the ranks' codes come as separate arguments, not as a stacked copy."""
    shifts = torch.arange(0, bits * per, bits, dtype=torch.int32, device=out.device)
    total = None
    for r, words in enumerate(packed):
        codes = (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
        value = (codes >> 1).to(torch.float32) * (1 - 2 * (codes & 1)).to(torch.float32)
        value = value * steps[r].view(-1, 1, 1)
        total = value if total is None else total + value
    return out.copy_(total / len(packed))


@register
class QSGD(GatheredCompressor):
    """QSGD (Alistarh et al., NeurIPS 2017), bucketed.

    The flattened tensor is cut into buckets v of ``bucket_size`` elements; per bucket,
    Q(v_i) = ||v|| * sign(v_i) * xi_i / s, with l = floor(|v_i| s / ||v||) and xi_i = l + 1 with
    probability |v_i| s / ||v|| - l, else l.  Unbiased, with variance <= min(d/s^2, sqrt(d)/s) ||v||^2 for
    a bucket of d elements (2-norm).  ``norm="max"`` uses max_i |v_i| instead (finer levels, same form).

    Wire (allgathered): one fp32 norm per bucket, then per element a code of ceil(log2(s+1)) + 1 bits
    (bit 0 = sign, the bits above = level xi in 0..s), packed:
    4 * ceil(n / bucket_size) + ceil(n * (ceil(log2(s+1)) + 1) / 8) bytes.
    """

    name = "qsgd"
    deterministic = False
    done_with_input_early = True
    decodes_into = True

    def __init__(self, levels: int = 1, bucket_size: int = 512, norm: str = "l2", feedback: Optional[str] = None):
        super().__init__(feedback)
        # pack_bits takes codes of at most 16 bits: 15 for the level, 1 for the sign.
        self.levels = _check_int("levels", levels, 1, 2**15 - 1)
        self.bucket_size = _check_int("bucket_size", bucket_size, 1)
        if norm not in ("l2", "max"):
            raise ValueError(f"norm must be 'l2' or 'max', got {norm!r}")
        self.norm = norm
        self._bits = self.levels.bit_length() + 1  # bit_length(s) == ceil(log2(s + 1))

    def _buckets(self, n: int) -> int:
        return math.ceil(n / self.bucket_size)

    def _fused(self, x: torch.Tensor) -> bool:
        return x.dtype == torch.float32 and 8 % self._bits == 0 and kernels.enabled(x.numel())

    def compress(self, x, ctx):
        if self._fused(x):
            fields = self._compress_fused(x.reshape(-1), ctx)
            if fields is not None:
                return fields
        s, flat, bs = self.levels, x.reshape(-1), self.bucket_size
        n = flat.numel()
        padded = self._buckets(n) * bs
        if padded == n:
            v = flat.reshape(-1, bs)
        else:  # zero padding changes neither norm, and the padded codes are never sent
            v = workspace("qsgd.v", padded, flat.dtype, flat.device)
            v[:n].copy_(flat)
            v[n:].zero_()
            v = v.view(-1, bs)
        ratio = torch.abs(v, out=workspace("qsgd.ratio", padded, v.dtype, v.device).view(v.shape))
        norms = torch.linalg.vector_norm(v, dim=1) if self.norm == "l2" else ratio.amax(dim=1)
        ratio.mul_(torch.where(norms > 0, s / norms, 0.0).unsqueeze(1))  # |v_i| s / ||v||, in [0, s]
        # xi = floor(ratio) + [u < ratio - floor(ratio)]  (ratio >= 0, so frac() is ratio - floor(ratio))
        up = _round_up(torch.frac(ratio, out=workspace("qsgd.frac", padded, v.dtype, v.device).view(v.shape)), ctx)
        xi = ratio.floor_().add_(up).reshape(-1)[:n]
        # Integer clamp: float rounding may push |v_i| s / ||v|| a hair above s (and NaN becomes 0 here).
        codes = workspace("qsgd.codes", n, torch.int32, flat.device).copy_(xi).clamp_(0, s)
        negative = compare("lt", flat, 0, workspace("round_up", n, torch.bool, flat.device))
        return norms.float(), pack_bits(codes.mul_(2).add_(negative), self._bits)

    def _compress_fused(self, flat: torch.Tensor, ctx: TensorContext) -> Optional[tuple]:
        """:meth:`compress` in one kernel after the norms: the same draws, norms and codes."""
        n, bs = flat.numel(), self.bucket_size
        full = n // bs
        whole = flat[: full * bs].view(full, bs)
        tail = workspace("qsgd.v", bs, flat.dtype, flat.device)[: bs * (full * bs < n)].view(-1, bs)
        if tail.numel():  # the last bucket, zero padded as in compress
            tail[0, : n - full * bs].copy_(flat[full * bs:])
            tail[0, n - full * bs:].zero_()
        if self.norm == "l2":
            norms = torch.cat([torch.linalg.vector_norm(whole, dim=1), torch.linalg.vector_norm(tail, dim=1)])
        else:
            norms = torch.cat([whole.abs().amax(dim=1), tail.abs().amax(dim=1)])
        scale = torch.where(norms > 0, self.levels / norms, 0.0)
        draws = _kernel_draws(n, ctx, flat.device, drawn=self._buckets(n) * bs)
        packed = packed_codes(n, self._bits, flat.device,
                              lambda: _qsgd_encode(flat, scale, draws, s=self.levels, bs=bs, bits=self._bits),
                              lambda out: _qsgd_code_bytes(flat, scale, draws, out, s=self.levels, bs=bs))
        return None if packed is None else (norms.float(), packed)

    def decompress(self, fields, ctx, out=None):
        norms, packed = fields
        n = ctx.shape.numel()
        if _table_decodes(packed, self._bits):
            value = torch.empty(n, device=packed.device) if out is None else out.view(-1)
            return self._table_decode(fields, value).view(ctx.shape)
        value = self._decoded_kernel([fields], ctx, None if out is None else out.view(-1))
        if value is not None:
            return value if out is None else out
        value = self._unpacked(fields, n)
        return value.reshape(ctx.shape) if out is None else out.copy_(value.reshape(ctx.shape))

    def _unpacked(self, fields, n: int) -> torch.Tensor:
        """Q of one payload's first n elements, unpacked code by code (the reference decoding)."""
        norms, packed = fields
        codes = unpack_bits(packed, self._bits, n)
        if self._bits <= 8:
            index = workspace("codes", n, torch.int32, codes.device).copy_(codes)
            return self._scaled(torch.index_select(_signed_levels(self._bits, codes.device), 0, index), norms)
        return self._scaled((codes >> 1).float().mul_(1.0 - 2.0 * (codes & 1).float()), norms)

    def _scaled(self, value: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        """Q = (||v|| / s) * (sign * xi), in place in ``value`` (sign * xi per element, flat): a code's
        sign * xi is looked up (0 with the sign bit is -0.0, as sign * 0), and (step * sign) * xi ==
        (sign * xi) * step since sign is +-1."""
        n, bs = value.numel(), self.bucket_size
        step = norms.float() / self.levels  # ||v|| / s per bucket
        full = n // bs
        value[: full * bs].view(full, bs).mul_(step[:full].unsqueeze(1))
        if full * bs < n:
            value[full * bs :].mul_(step[full])
        return value

    def _table_decode(self, fields, out: torch.Tensor) -> torch.Tensor:
        """Q of one payload into ``out`` (flat float32), by :func:`gradzip.bits.lookup_codes`."""
        norms, packed = fields
        index = workspace("codes", packed.numel(), torch.int32, packed.device)
        table = _signed_level_bytes(self._bits, packed.device)
        return self._scaled(lookup_codes(packed, table, out.numel(), out, index), norms)

    def decoded_mean(self, gathered, ctx):
        n, device = ctx.shape.numel(), gathered[0][1].device
        mean = self._decoded_kernel(gathered, ctx, ctx.buffer("aggregate", (n,), torch.float32, device))
        if mean is not None or not _table_decodes(gathered[0][1], self._bits):
            return mean
        return self.mean_decoded_into(gathered, ctx, self._table_decode)

    def aggregate_bound(self, gathered, ctx):
        # |Q_i| = (||v|| / s) xi with xi <= s: at most the bucket's norm; the sum over ranks, and so the
        # mean, at most the sum of each rank's largest norm
        if not gathered[0][0].numel():
            return None
        return torch.stack([fields[0].float().abs().max() for fields in gathered]).sum()

    def _decoded_kernel(self, gathered, ctx, aggregate: Optional[torch.Tensor] = None):
        """:meth:`combine`'s mean by :func:`_qsgd_mean` over the whole buckets, into ``aggregate`` (n
        float32 elements; a new tensor if None), the last, part-filled bucket decoded as the reference
        does; None where the kernel does not apply (codes that do not fill whole bytes of every bucket,
        no whole bucket)."""
        n, bs, world, bits = ctx.shape.numel(), self.bucket_size, len(gathered), self._bits
        per = 8 // bits if 8 % bits == 0 else 0
        full = n // bs
        if not per or bs % per or not full or not _decodes_fused(n, world, gathered[0][1].device):
            return None
        if per < 8 and bs % 8 == 0 and all(f[1].storage_offset() % 2 == 0 for f in gathered):
            per *= 2  # int16 words: a float32 vector's width of codes for 2-bit codes
        if aggregate is None:
            aggregate = torch.empty(n, device=gathered[0][1].device)
        nbytes = full * bs * bits // 8
        words = [f[1][:nbytes].view(torch.int16 if per * bits == 16 else torch.uint8).view(full, -1) for f in gathered]
        steps = torch.stack([f[0][:full].float() for f in gathered]) / self.levels
        if _qsgd_mean(aggregate[:full * bs].view(full, -1, per), steps, *words, bits=bits, per=per) is None:
            return None
        if full * bs < n:  # summed in rank order and divided, as combine() does
            tails = [(f[0][full:], f[1][nbytes:]) for f in gathered]
            tail = aggregate[full * bs:].copy_(self._unpacked(tails[0], n - full * bs))
            for fields in tails[1:]:
                tail += self._unpacked(fields, n - full * bs)
            tail.div_(world)
        return aggregate.view(ctx.shape)

    def payload_bytes(self, ctx, kept=None):
        n = ctx.shape.numel()
        return 4 * self._buckets(n) + packed_nbytes(n, self._bits)

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor, Q_s of :meth:`compress`: each tensor cut into chunks v of ``bucket_size`` elements
        (its last one shorter), ||v|| for every chunk of the bucket by one segmented reduction, then per
        element xi = floor(r) + [u < r - floor(r)] with r = |v_i| s / ||v|| and u drawn by counter,
        independently on each rank.  The aggregate is the mean over ranks of ||v|| sign(v_i) xi / s,
        summed in rank order.  Wire (allgathered): the bucket's chunk norms (fp32), then its n codes
        of ceil(log2(s+1)) + 1 bits (as :meth:`compress`'s) packed together:
        4 * chunks + ceil(n * bits / 8) bytes."""
        layout, s, n = b.layout, self.levels, b.layout.numel
        if self.norm == "l2":
            norms = layout.chunk_reduce(p.square(), "sum", self.bucket_size).sqrt_()
        else:
            norms = layout.chunk_reduce(p.abs(), "max", self.bucket_size)
        scale = torch.where(norms > 0, s / norms, 0.0)  # s / ||v|| per chunk
        packed = None
        if 8 % self._bits == 0 and _qsgd_bucket_encode.wanted(n, p):
            packed = _qsgd_bucket_encode.ahead(p, scale, layout.chunk_starts(self.bucket_size),
                                               b.kernel_seed(shared=False, salt="qsgd"), s=s, bits=self._bits)
        if packed is None:  # the kernel's reference path, one operation at a time
            ratio = p.abs().mul_(layout.per_chunk(scale, self.bucket_size))  # |v_i| s / ||v||, in [0, s]
            up = b.uniforms(n, shared=False, salt="qsgd") < torch.frac(ratio)
            # Integer clamp: float rounding may push the ratio a hair above s (and NaN becomes 0 here).
            codes = ratio.floor_().add_(up).to(torch.int32).clamp_(0, s).mul_(2).add_(p < 0)
            packed = _pack_codes(codes, self._bits)
            del ratio, up, codes  # bucket-sized: not to be held across the allgather and the decoding
        gathered = yield AllGather((norms, packed))
        total = self._bucket_total(gathered, layout)
        # |Q_i| <= ||v||: the mean is at most the sum over ranks of each one's largest norm
        bound = torch.stack([f[0].abs().amax() for f in gathered]).sum() if norms.numel() else None
        return Exchanged(total.div_(b.world_size), lambda: self._bucket_decoded((norms, packed), layout),
                         bound=bound, subtract_sent=self._residual_kernel(norms, packed, layout))

    def _residual_kernel(self, norms, packed, layout):
        """subtract_sent for error feedback: p - Q(p) by one kernel compiled ahead, where it is."""
        if 8 % self._bits or not _bucket_residual.wanted(layout.numel, layout.device):
            return None
        return lambda p: _bucket_residual.ahead(p, _signed_level_bytes(self._bits, p.device), packed,
                                                norms.float() / self.levels, layout.chunk_starts(self.bucket_size))

    def _bucket_total(self, gathered, layout) -> torch.Tensor:
        """The ranks' decoded payloads summed in rank order (the same floats on every rank), flat
        float32: a kernel per rank where :func:`_bucket_decoded` is compiled ahead, else
        :meth:`_bucket_decoded`'s operations (:func:`summed_in_rank_order`)."""
        # the layout's chunk index, made where the eager path first needs it: one spreads every rank's norms
        index = functools.cache(lambda: layout.chunk_index(self.bucket_size))
        decoded = lambda fields: self._bucket_decoded(fields, layout, index())  # noqa: E731
        fused = None
        if 8 % self._bits == 0 and _bucket_decoded.wanted(layout.numel, layout.device):
            table, starts = _signed_level_bytes(self._bits, layout.device), layout.chunk_starts(self.bucket_size)
            fused = lambda out, fields, add: _bucket_decoded.ahead(  # noqa: E731
                out, table, fields[1], fields[0].float() / self.levels, starts, add=add)
        return summed_in_rank_order(gathered, layout.numel, layout.device, fused, decoded)

    def _bucket_decoded(self, fields, layout, index=None) -> torch.Tensor:
        """Q of one rank's bucket payload: (sign * xi) * (||v|| / s), flat float32 (``index``: the
        layout's chunk index, if made already)."""
        norms, packed = fields
        if 8 % self._bits == 0:  # whole codes in each byte: the bytes' sign * xi looked up, 2 operations
            value = lookup_codes(packed, _signed_level_bytes(self._bits, packed.device), layout.numel)
        else:
            codes = _unpack_codes(packed, self._bits, layout.numel)
            value = (codes >> 1).float().mul_((codes & 1).float().mul_(-2).add_(1))  # 0 with the sign bit: -0.0
        return value.mul_(layout.per_chunk(norms.float() / self.levels, self.bucket_size, index))

    def bucket_payload_bytes(self, layout):
        chunks = sum(math.ceil(n / self.bucket_size) for n in layout.numels)
        return 4 * chunks + packed_nbytes(layout.numel, self._bits)


def _terngrad_codes(g, bound, s, draws):
    """TernGrad's codes t + 1 of clip(g) (as :meth:`TernGrad._codes`, u from ``draws``), int32."""
    u = kernels.uniforms_from(g, draws)
    g = torch.clamp(g, -bound, bound)
    up = u < g.abs() / s.clamp_min(torch.finfo(torch.float32).tiny)
    return ((g > 0) & up).to(torch.int32) * 2 + 1 - up.to(torch.int32)  # int32: see kernels.pack_codes


@kernels.fused
def _terngrad_encode(g, bound, s, draws):
    """TernGrad's packed codes in one loop (GPUs; see :func:`gradzip.devices.packs_from_bytes`)."""
    return kernels.pack_codes(_terngrad_codes(g, bound, s, draws), 2)


@kernels.fused
def _terngrad_bucket_encode(p, bound, s, tensor_starts, seed, *, clip: bool):
    """TernGrad's packed codes t + 1 of a whole bucket in one loop (:meth:`TernGrad.bucket_exchange`):
    ``p`` clipped to [-bound_i, bound_i] where ``clip`` (the reference path's two clamps), each
    element's bound and scaler gathered by its tensor (``segment_of`` the layout's tensor starts), its
    uniform drawn from ``seed`` by counter."""
    tensor = segment_of(p.shape[0], tensor_starts, p.device)
    g = p
    if clip:
        spread = bound.index_select(0, tensor)
        g = torch.clamp(p, max=spread).clamp(min=-spread)
    up = kernels.counter_uniforms(p, seed) < g.abs() / s.index_select(0, tensor)
    return kernels.pack_codes(((g > 0) & up).to(torch.int32) * 2 + 1 - up.to(torch.int32), 2)


@kernels.fused
def _terngrad_code_bytes(g, bound, s, draws, out):
    """TernGrad's codes a byte each into ``out``, for :func:`kernels.pack_bytes` (CPUs)."""
    return out.copy_(_terngrad_codes(g, bound, s, draws).to(torch.uint8))


@kernels.fused
def _terngrad_mean(out, s, *packed, per: int):
    """s * mean_r t_r into ``out`` viewed (words, ``per``): out[k, j] = (sum_r t_rkj) * s / world, where
    t_rkj + 1 is the 2-bit code j of the r-th ``packed``'s word k: bytes (``per`` 4) or pairs of bytes
    read as int16 (``per`` 8, the width of a CPU's float32 vector: 7.3 ms for 25M codes against 12.2).
    Sums of -1, 0 and 1 are exact, then the reference's two roundings.  No element's word is found by a
    division, which keeps the loop vectorised; the ranks' codes come as separate arguments, not as a
    stacked copy."""
    shifts = torch.arange(0, 2 * per, 2, dtype=torch.int32, device=out.device)
    total = None
    for codes in packed:
        t = ((codes.to(torch.int32).unsqueeze(-1) >> shifts) & 3).to(torch.float32) - 1
        total = t if total is None else total + t
    return out.copy_(total * s / len(packed))


def _ternary_mean(packed: list, s: torch.Tensor, n: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """s * mean_r (t_r) of the ranks' packed TernGrad codes t + 1, in rank order (into ``out``, n float32
    elements, where a kernel or the byte table decodes them and it is given)."""
    device = packed[0].device
    if _decodes_fused(n, len(packed), device):
        target = torch.empty(n, device=device) if out is None else out.view(-1)
        per = 8 if all(p.storage_offset() % 2 == 0 for p in packed) else 4  # int16 words need even offsets
        done = n // per * per
        words = [p[:done // 4].view(torch.int16) if per == 8 else p[:done // 4] for p in packed]
        if _terngrad_mean(target[:done].view(-1, per), s.reshape(()), *words, per=per) is not None:
            if n > done:  # the last codes (fewer than a word: no kernel), as the paths below decode them
                target[done:] = _ternary_mean([p[done // 4:] for p in packed], s, n - done)
            return target if out is None else out
    if _table_decodes(packed[0], 2):
        table, index = _ternary_bytes(device), workspace("codes", packed[0].numel(), torch.int32, device)
        total = lookup_codes(packed[0], table, n, torch.empty(n, device=device) if out is None else out, index)
        for codes in packed[1:]:  # sums of -1, 0 and 1: exact
            total += lookup_codes(codes, table, n, workspace("terngrad.decoded", n, torch.float32, device), index)
        return total.mul_(s).div_(len(packed))
    # (t + 1) - 1 is exact in float32 (and 1 - 1 is +0.0, as where(..., 0.0) gave).
    total = unpack_bits(packed[0], 2, n).float().sub_(1)
    for codes in packed[1:]:
        total += unpack_bits(codes, 2, n).float().sub_(1)
    return total.mul_(s).div_(len(packed))


@register
class TernGrad(Compressor):
    """TernGrad (Wen et al., NeurIPS 2017): ternary gradients with a scaler shared by all workers.

    Per tensor: clip g to [-c*sigma, c*sigma] (``clip`` = c; ``None`` disables clipping); s_local =
    max|g|; s = max over workers of s_local (one allreduce, "scaler sharing"); t_i in {-1, 0, 1} with
    P(t_i = sign(g_i)) = |g_i| / s, else 0.  Each worker sends s * t, which is unbiased for the clipped
    g; the aggregate is s * mean_r(t_r).

    sigma is the root mean square of g (its standard deviation about zero), which equals the paper's sigma
    for zero-mean gradients.  The standard deviation about the mean would be 0 for a 1-element or constant
    tensor and clip its whole gradient to zero on every step.

    Wire: the fp32 scaler (allreduced, 4 bytes), then t + 1 as 2-bit codes (allgathered):
    4 + ceil(n / 4) bytes.
    """

    name = "terngrad"
    deterministic = False
    done_with_input_early = True

    def __init__(self, clip: Optional[float] = 2.5, feedback: Optional[str] = None):
        super().__init__(feedback)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not 0 < clip < math.inf):
            raise ValueError(f"clip must be a finite number > 0 (a multiple of sigma) or None, got {clip!r}")
        self.clip = clip

    def exchange(self, x, ctx):
        g = x.reshape(-1).float()
        n = g.numel()
        fused = kernels.enabled(n)  # the fused kernel clips g itself: max|clip(g)| = clip(max|g|)
        bound = None
        if self.clip is not None and n:
            bound = self.clip * (chunked_sum(g, torch.square, "terngrad.square") / n).sqrt()
            g = g if fused else torch.clamp(g, -bound, bound)
        # max|g| from the two ends (one read, no |g| temporary): the same value, NaN included.
        if n:
            low, high = torch.aminmax(g)
            if fused and bound is not None:
                low, high = low.clamp(-bound, bound), high.clamp(-bound, bound)
            s_local = torch.maximum(low.abs(), high.abs()).reshape(1)
        else:
            s_local = g.new_zeros(1)
        s = yield AllReduce(s_local, op="max")
        clip = bound if bound is not None else torch.tensor(math.inf, device=g.device)
        packed = None
        if fused:
            draws = _kernel_draws(n, ctx, g.device)
            packed = packed_codes(n, 2, g.device, lambda: _terngrad_encode(g, clip, s, draws),
                                  lambda out: _terngrad_code_bytes(g, clip, s, draws, out))
        if packed is None:
            packed = pack_bits(self._codes(torch.clamp(g, -clip, clip) if fused else g, s, ctx), 2)
        gathered = yield AllGather((packed,), same_size=True)
        aggregate = _ternary_mean([f[0] for f in gathered], s, n,  # rank order: the same floats everywhere
                                  ctx.buffer("aggregate", (n,), torch.float32, g.device))
        # N trits in {-1, 0, 1} summed, times s: |sum| <= N s, and the mean is at most that
        return Exchanged(aggregate.reshape(ctx.shape), lambda: _ternary_mean([packed], s, n).reshape(ctx.shape),
                         bound=s.abs().reshape(()) * len(gathered))

    @staticmethod
    def _codes(g: torch.Tensor, s: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """t + 1 in {0, 1, 2} with P(t = sign(g_i)) = |g_i| / s, else t = 0."""
        n = g.numel()
        # s == 0 means g == 0 everywhere: the clamp turns 0/0 into probability 0 instead of NaN.
        p = torch.abs(g, out=workspace("terngrad.p", n, g.dtype, g.device)).div_(s.clamp_min(torch.finfo(torch.float32).tiny))
        up = _round_up(p, ctx)
        # t = sign(g) where rounded up, else 0, sent as t + 1 in {0, 1, 2}.  up implies |g| > 0 (u < 0 never
        # holds), so t + 1 = 1 + up * (2 [g > 0] - 1) = 1 - up + 2 (up and g > 0).
        positive = compare("gt", g, 0, workspace("terngrad.positive", n, torch.bool, g.device)).logical_and_(up)
        return positive.to(torch.uint8).mul_(2).add_(1).sub_(up.view(torch.uint8))

    def payload_bytes(self, ctx, kept=None):
        return 4 + packed_nbytes(ctx.shape.numel(), 2)

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor, as :meth:`exchange`: sigma_i (root mean square) by one segmented sum of squares,
        clip to [-c sigma_i, c sigma_i], s_local_i = max|clip(g_i)| by one segmented max; the bucket's
        scalers max-reduced in one allreduce; t with P(t = sign(g)) = |g| / s_i from counter draws,
        independent per rank; the aggregate s_i * mean_r(t_r), the ranks' trits summed in rank order.
        Wire: one fp32 scaler per tensor (allreduced), then the bucket's n codes t + 1, 2 bits each,
        packed together (allgathered): 4 * tensors + ceil(n / 4) bytes."""
        layout, n = b.layout, b.layout.numel
        bound = None  # per tensor, c sigma_i
        if self.clip is not None:
            bound = layout.segment_mean(p.square()).sqrt_().mul_(self.clip)
        # max |clip(g_i)| = min(max |g_i|, c sigma_i): no clipped copy of the bucket made for it
        s_local = layout.reduce(p.abs(), "max")
        if bound is not None:
            s_local = torch.minimum(s_local, bound)
        s = yield AllReduce(s_local, op="max")
        # s == 0 means g == 0 in that tensor: the clamp turns 0/0 into probability 0 instead of NaN (and
        # the trits there are 0, so the aggregate, t * tiny, is still 0).
        s = s.clamp_min(torch.finfo(torch.float32).tiny)
        packed = None
        if _terngrad_bucket_encode.wanted(n, p):
            packed = _terngrad_bucket_encode.ahead(p, s if bound is None else bound, s, layout.tensor_starts,
                                                   b.kernel_seed(shared=False, salt="terngrad"), clip=bound is not None)
        if packed is None:  # the kernel's reference path, one operation at a time
            g = p
            if bound is not None:
                spread = layout.per_element(bound)
                g = torch.clamp(p, max=spread).clamp_(min=spread.neg_())  # bound >= 0: clamp(p, -bound, bound)
                del spread
            positive = g > 0
            # |g| / s in g's memory where g is this exchange's own (the clip's), and the spread s freed
            # before the draws: bucket-sized temporaries one at a time, not four at once.
            ratio = (g.abs_() if g is not p else g.abs()).div_(layout.per_element(s))
            up = b.uniforms(n, shared=False, salt="terngrad") < ratio
            del ratio
            # t + 1 = 1 - up + 2 (up and g > 0), in {0, 1, 2}
            codes = positive.logical_and_(up).to(torch.uint8).mul_(2).add_(1).sub_(up.to(torch.uint8))
            packed = _pack_codes(codes, 2)
            del g, positive, up, codes  # bucket-sized: not to be held across the allgather and the decoding
        gathered = yield AllGather((packed,))
        table = _ternary_bytes(p.device)
        fused = None  # trits in {-1, 0, 1}: exact sums
        if _codes_summed.wanted(n, p):
            fused = lambda out, got, add: _codes_summed.ahead(out, table, got[0], add=add)  # noqa: E731
        total = summed_in_rank_order(gathered, n, p.device, fused, lambda got: lookup_codes(got[0], table, n))
        if _segments_scaled.ahead(total, s, layout.tensor_starts, world=b.world_size) is None:
            total.mul_(layout.per_element(s)).div_(b.world_size)
        # N trits summed, times s: |sum| <= N max_i s_i, and the mean is at most that
        residual = None
        if _bucket_residual.wanted(n, p):
            residual = lambda q: _bucket_residual.ahead(q, table, packed, s, layout.tensor_starts)  # noqa: E731
        return Exchanged(total, lambda: lookup_codes(packed, table, n).mul_(layout.per_element(s)),
                         bound=s.abs().amax() * b.world_size, subtract_sent=residual)

    def bucket_payload_bytes(self, layout):
        return 4 * len(layout) + packed_nbytes(layout.numel, 2)


@kernels.fused
def _natural_encode(flat, draws):
    """Natural compression's codes from the fp32 bit pattern (as :meth:`Natural.compress`, one loop, u
    from ``draws``)."""
    return _natural_codes(flat, kernels.uniforms_from(flat, draws))


def _natural_codes(flat, u):
    """Natural compression's uint8 codes of the contiguous float32 ``flat`` given a uniform u_i per
    element, read off the fp32 bit pattern: the same codes as :meth:`Natural.compress`."""
    # In place where it can be: run eagerly (the bucket route) each new temporary is a bucket's worth of
    # memory, so the exponent is int16 there (8 bits; e below stays under 2^8) and the mantissa converted
    # in its own memory, element by element.  Compiled, temporaries cost nothing, and that form doubled
    # the fused kernel's time (a CPU, 25M elements: the exchange 88 ms against 42 with the plain form).
    eager = not torch.compiler.is_compiling()
    bits = flat.view(torch.int32)
    biased = (bits >> 23).bitwise_and_(0xFF)
    biased = biased.to(torch.int16) if eager else biased
    tiny = biased < 64
    p = bits & 0x7FFFFF
    p = (p.view(torch.float32).copy_(p) if eager else p.to(torch.float32)).mul_(2.0**-23)
    torch.where(tiny, flat.abs().mul_(2.0**63), p, out=p)
    up = u < p
    del p, u, tiny
    e = (biased - 63).clamp_(min=0).add_(up).clamp_(max=127)
    e.bitwise_or_((bits < 0).logical_and_(e > 0).to(e.dtype).bitwise_left_shift_(7))
    return e.masked_fill_(biased == 0xFF, Natural._NONFINITE).to(torch.uint8)


@kernels.fused
def _natural_bucket_residual(p, values, codes):
    """Error feedback's p - C(p) of this rank's own bucket codes, written into ``p``."""
    return p.sub_(values.index_select(0, codes.to(torch.int32)))


@kernels.fused
def _natural_mean(out, *codes):
    """The mean over the ranks' ``codes`` of their values (as :func:`_natural_values`, computed instead
    of looked up), summed in rank order and divided as :meth:`GatheredCompressor.combine` does, into
    ``out``: one byte read per rank and element, where the byte table's path gathers, converts and
    divides in passes of their own (25M elements at world size 1: 3.2 ms against 18.7).  The ranks'
    codes come as separate arguments, not stacked: a stacked copy costs more than the decoding."""
    world = len(codes)
    total = None
    for r in range(world):
        c = codes[r].to(torch.int32)
        e = c & 0x7F
        magnitude = torch.where(e > 0, ((e + 63) << 23).view(torch.float32), 0.0)
        value = torch.where(c == Natural._NONFINITE, math.nan, torch.where((c & 0x80) != 0, -magnitude, magnitude))
        total = value if total is None else total + value
    return out.copy_(total / world)


@register
class Natural(GatheredCompressor):
    """Natural compression (Horvath et al., 2019): unbiased stochastic rounding to a power of two.

    For |x| in [2^a, 2^(a+1)): round up to 2^(a+1) with probability (|x| - 2^a) / 2^a, else down to 2^a.
    That probability is exactly the fp32 mantissa fraction, read from the bit pattern.

    Wire: one uint8 per element (n bytes, allgathered): bit 7 = sign, bits 0..6 = e; e = 0 is zero and
    e in 1..127 is 2^(e - 64), so exponents -63..63.  Magnitudes below 2^-63 round unbiasedly to 0 or 2^-63;
    finite magnitudes of 2^63 and above are clamped to 2^63 (the only biased case).  Code 0x80 ("negative
    zero", otherwise unused) marks a NaN or Inf input, which decodes to NaN so overflow is never hidden.
    """

    name = "natural"
    deterministic = False
    done_with_input_early = True
    carries_nonfinite = True  # a NaN or Inf is sent as 0x80 and decoded to NaN: the aggregate shows it
    _NONFINITE = 0x80

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        flat = x.reshape(-1).float().contiguous()
        n, device = flat.numel(), flat.device
        codes = _natural_encode(flat, _kernel_draws(n, ctx, device)) if kernels.enabled(n) else None
        if codes is not None:
            return (codes,)
        bits = flat.view(torch.int32)
        biased = torch.bitwise_right_shift(bits, 23, out=workspace("natural.exp", n, torch.int32, device))
        biased.bitwise_and_(0xFF)  # a + 127: |x| in [2^a, 2^(a+1)) for normal floats
        # Below 2^-63 (subnormals and zero included) the two candidates are 0 and 2^-63 instead.
        tiny = compare("lt", biased, 64, workspace("natural.tiny", n, torch.bool, device))
        # p = the mantissa fraction m / 2^23, or |x| 2^63 for tiny values.
        p = workspace("natural.p", n, torch.float32, device)
        p.copy_(torch.bitwise_and(bits, 0x7FFFFF, out=workspace("natural.work", n, torch.int32, device))).mul_(2.0**-23)
        scaled = torch.abs(flat, out=workspace("natural.work", n, torch.int32, device).view(torch.float32))
        # p = |x| 2^63 where tiny: b ^ ((a ^ b) & m) picks a's bits where the mask m is all ones (as
        # torch.where would, which is a slow scalar loop on CPUs), in place in the reused buffers.
        diff = scaled.mul_(2.0**63).view(torch.int32).bitwise_xor_(p.view(torch.int32))
        diff.bitwise_and_(workspace("natural.mask", n, torch.int32, device).copy_(tiny).neg_())
        p.view(torch.int32).bitwise_xor_(diff)
        nonfinite = compare("eq", biased, 0xFF, workspace("natural.nonfinite", n, torch.bool, device))
        # e = (0 if tiny else a + 64) + rounded up, at most 127; a + 64 = biased - 63 is <= 0 exactly
        # when tiny.
        e = biased.sub_(63).clamp_(min=0).add_(_round_up(p, ctx)).clamp_(max=127)
        codes = e.to(torch.uint8)
        # A value rounded to zero drops its sign: 0x80 is reserved for NaN and Inf.
        negative = compare("lt", bits, 0, workspace("natural.tiny", n, torch.bool, device)).logical_and_(codes > 0)
        codes.bitwise_or_(negative.view(torch.uint8) << 7)
        return (codes.masked_fill_(nonfinite, self._NONFINITE),)

    def decompress(self, fields, ctx):
        return self._table_decode(fields, torch.empty(ctx.shape.numel(), device=fields[0].device)).view(ctx.shape)

    @staticmethod
    def _table_decode(fields, out: torch.Tensor) -> torch.Tensor:
        """The codes' values into ``out`` (flat float32): a lookup in the 256 values."""
        (codes,) = fields
        index = workspace("codes", codes.numel(), torch.int32, codes.device)
        return lookup_codes(codes, _natural_values(codes.device).view(256, 1), out.numel(), out, index)

    def decoded_mean(self, gathered, ctx):
        n, world, device = ctx.shape.numel(), len(gathered), gathered[0][0].device
        if _decodes_fused(n, world, device):
            aggregate = ctx.buffer("aggregate", (n,), torch.float32, device)
            if _natural_mean(aggregate, *(f[0] for f in gathered)) is not None:
                return aggregate.view(ctx.shape)
        if _table_decodes(gathered[0][0], 8):
            return self.mean_decoded_into(gathered, ctx, self._table_decode)
        return None

    def aggregate_bound(self, gathered, ctx):
        # Every value, so the mean, is at most 2^63 in magnitude, unless a rank sent the code 0x80 (-128
        # as int8: a NaN or Inf input, decoded to NaN): one read of the codes, a byte per element,
        # instead of the aggregate's four.  The owner reads a bound only for CPU outputs.
        if not devices.reads_freely(gathered[0][0]):
            return None
        marked = any(bool(codes.view(torch.int8).min() == -128) for (codes,) in gathered if codes.numel())
        return torch.tensor(math.nan if marked else 2.0**63)

    def payload_bytes(self, ctx, kept=None):
        return ctx.shape.numel()

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per element, as :meth:`compress`: the bucket's codes from its fp32 bit patterns, u drawn by
        counter, independently on each rank; the aggregate the mean of the ranks' decoded values,
        summed in rank order (NaN where any rank sent 0x80).  Wire: the bucket's n codes, one byte
        each (allgathered): n bytes."""
        codes = None
        if _natural_encode.wanted(p.numel(), p):  # the per-tensor route's kernel: the same codes of the same draws
            codes = _natural_encode.ahead(p, b.kernel_seed(shared=False, salt="natural"))
        if codes is None:
            codes = _natural_codes(p, b.uniforms(p.numel(), shared=False, salt="natural"))
        gathered = yield AllGather((codes,))
        values = _natural_values(p.device)
        total = None
        for (got,) in gathered:
            value = torch.index_select(values, 0, got.to(torch.int32))
            total = value if total is None else total.add_(value)
        residual = None
        if _natural_bucket_residual.wanted(p.numel(), p):
            residual = lambda q: _natural_bucket_residual.ahead(q, values, codes)  # noqa: E731
        return Exchanged(total.div_(b.world_size), lambda: torch.index_select(values, 0, codes.to(torch.int32)),
                         subtract_sent=residual)

    def bucket_payload_bytes(self, layout):
        return layout.numel
