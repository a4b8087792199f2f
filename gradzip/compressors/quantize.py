"""Quantisation: send every element, each in a few bits, with stochastic rounding that keeps E[Q(x)] = x.

All three methods here are unbiased, so they need no error feedback (``default_feedback = "none"``).
Their rounding noise comes from ``ctx.generator(shared=False)``: independent on every worker, so it
averages out across workers instead of adding up.  Codes are packed densely with :mod:`gradzip.bits`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..bits import pack_bits, packed_nbytes, unpack_bits
from . import register
from .base import AllGather, AllReduce, Compressor, Exchanged, GatheredCompressor, TensorContext


def _round_up(p: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
    """Bernoulli(p) draws from this worker's private stream: True means "take the upper level".

    fp32 uniforms are multiples of 2^-24, so P(u < p) is exact for p on that grid (natural compression's
    mantissa fractions m / 2^23 are) and within 2^-24 of p otherwise.
    """
    u = torch.rand(p.shape, generator=ctx.generator(p.device, shared=False), device=p.device)
    return u < p


def _check_int(name: str, value, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        allowed = f"an integer in {lo}..{hi}" if hi is not None else f"an integer >= {lo}"
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


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

    def compress(self, x, ctx):
        s, flat = self.levels, x.reshape(-1)
        n = flat.numel()
        # Zero padding changes neither norm, and the padded codes are never sent.
        v = torch.nn.functional.pad(flat, (0, self._buckets(n) * self.bucket_size - n)).view(-1, self.bucket_size)
        norms = torch.linalg.vector_norm(v, dim=1) if self.norm == "l2" else v.abs().amax(dim=1)
        ratio = v.abs() * torch.where(norms > 0, s / norms, 0.0).unsqueeze(1)  # |v_i| s / ||v||, in [0, s]
        lower = ratio.floor()
        xi = lower + _round_up(ratio - lower, ctx)
        # Integer clamp: float rounding may push |v_i| s / ||v|| a hair above s (and NaN becomes 0 here).
        xi = xi.reshape(-1)[:n].to(torch.int32).clamp(0, s)
        negative = (flat < 0).to(torch.int32)
        return norms.float(), pack_bits(xi * 2 + negative, self._bits)

    def decompress(self, fields, ctx):
        norms, packed = fields
        n = ctx.shape.numel()
        codes = unpack_bits(packed, self._bits, n).to(torch.int32)
        xi = (codes >> 1).float()
        sign = 1.0 - 2.0 * (codes & 1).float()
        step = torch.repeat_interleave(norms.float() / self.levels, self.bucket_size)[:n]  # ||v|| / s
        return (step * sign * xi).reshape(ctx.shape)

    def payload_bytes(self, ctx, kept=None):
        n = ctx.shape.numel()
        return 4 * self._buckets(n) + packed_nbytes(n, self._bits)


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

    def __init__(self, clip: Optional[float] = 2.5, feedback: Optional[str] = None):
        super().__init__(feedback)
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                                 or not 0 < clip < math.inf):
            raise ValueError(f"clip must be a finite number > 0 (a multiple of sigma) or None, got {clip!r}")
        self.clip = clip

    def exchange(self, x, ctx):
        g = x.reshape(-1).float()
        n = g.numel()
        if self.clip is not None and n:
            bound = self.clip * g.square().mean().sqrt()
            g = torch.clamp(g, -bound, bound)
        s_local = g.abs().amax().reshape(1) if n else g.new_zeros(1)
        s = yield AllReduce(s_local, op="max")
        # s == 0 means g == 0 everywhere: the clamp turns 0/0 into probability 0 instead of NaN.
        p = g.abs() / s.clamp_min(torch.finfo(torch.float32).tiny)
        t = torch.where(_round_up(p, ctx), g.sign(), 0.0)
        gathered = yield AllGather((pack_bits((t + 1).to(torch.uint8), 2),), same_size=True)
        total = torch.zeros(n, dtype=torch.float32, device=g.device)
        for (packed,) in gathered:  # rank order: identical float sums on every rank
            total += unpack_bits(packed, 2, n).float() - 1
        aggregate = s * total / ctx.world_size
        return Exchanged(aggregate.reshape(ctx.shape), (s * t).reshape(ctx.shape))

    def payload_bytes(self, ctx, kept=None):
        return 4 + packed_nbytes(ctx.shape.numel(), 2)


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
    _NONFINITE = 0x80

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        flat = x.reshape(-1).float().contiguous()
        bits = flat.view(torch.int32)
        a = ((bits >> 23) & 0xFF) - 127  # |x| in [2^a, 2^(a+1)) for normal floats
        # Below 2^-63 (subnormals and zero included) the two candidates are 0 and 2^-63 instead.
        tiny = a < -63
        p = torch.where(tiny, flat.abs() * 2.0**63, (bits & 0x7FFFFF).float() * 2.0**-23)  # mantissa fraction
        e = (torch.where(tiny, 0, a + 64) + _round_up(p, ctx).to(torch.int32)).clamp(max=127)
        sign = (bits < 0) & (e > 0)  # a value rounded to zero drops its sign: 0x80 is reserved
        codes = e | (sign.to(torch.int32) << 7)
        codes = torch.where(torch.isfinite(flat), codes, self._NONFINITE)
        return (codes.to(torch.uint8),)

    def decompress(self, fields, ctx):
        (codes,) = fields
        codes = codes.to(torch.int32)
        e = codes & 0x7F
        magnitude = ((e + 63) << 23).view(torch.float32)  # 2^(e-64): biased fp32 exponent e - 64 + 127
        magnitude = torch.where(e > 0, magnitude, 0.0)
        value = torch.where((codes & 0x80) != 0, -magnitude, magnitude)
        value = torch.where(codes == self._NONFINITE, math.nan, value)
        return value.reshape(ctx.shape)

    def payload_bytes(self, ctx, kept=None):
        return ctx.shape.numel()
