"""Dense baselines: full precision, and the half-precision casts every study should compare against."""
from __future__ import annotations

import torch

from .. import kernels
from .base import AllReduce, Exchanged, SummableCompressor, TensorContext, saturation_limit, wire_cast, workspace
from .registry import register


def divided(x: torch.Tensor, ctx: TensorContext, dtype: torch.dtype, saturate: bool = False) -> torch.Tensor:
    """x / N in fp32, rounded once to ``dtype``, in the tensor's payload buffer.  Division and cast are
    two steps: on CPUs a division writing a 16-bit type directly takes twice as long as both.
    ``saturate``: beyond what N ranks' values can sum to in ``dtype``, sent saturated (:func:`wire_cast`)."""
    payload = ctx.buffer("payload", x.shape, dtype, x.device)
    limit = saturation_limit(dtype, ctx.world_size) if saturate else None
    if limit is not None:
        scratch = workspace("divided", x.numel(), x.dtype, x.device).view(x.shape)
        share = x if ctx.world_size == 1 else torch.div(x, ctx.world_size, out=scratch)
        return payload.copy_(torch.clamp(share, -limit, limit, out=scratch))
    if ctx.world_size == 1:  # x / 1 == x
        return payload.copy_(x)
    if dtype == x.dtype:
        return torch.div(x, ctx.world_size, out=payload)
    return payload.copy_(torch.div(x, ctx.world_size, out=workspace("divided", x.numel(), x.dtype, x.device).view(x.shape)))


@register
class NoCompression(SummableCompressor):
    """Plain data-parallel averaging: allreduce g / N in the gradient's own dtype.

    Dividing before the sum, as PyTorch's allreduce hook does, keeps a 16-bit sum from overflowing
    where the mean does not (two fp16 workers holding 40000 average to 40000, not inf).
    """

    name = "none"
    carries_nonfinite = True

    def __init__(self, feedback: str | None = None):
        super().__init__(feedback)

    def compresses(self, ctx):
        # Nothing is compressed, so integrations may use their own dense path (the DDP hook: DDP's
        # allreduce), which skips gradzip's fusion copies: the same average.
        return False

    def compress(self, x, ctx):
        return divided(x, ctx, ctx.dtype)

    def decompress(self, payload, ctx):
        return payload.float().mul_(ctx.world_size)

    def exchange(self, x, ctx):
        payload = self.compress(x, ctx)
        total = yield AllReduce(payload)
        return Exchanged(total.float(), lambda: self.decompress(payload, ctx))

    def payload_bytes(self, ctx, kept=None):
        return ctx.shape.numel() * ctx.dtype.itemsize

    def always_plain(self, dtype, world_size):
        return dtype if self.feedback == "none" else None

    bucketed = True

    def bucket_exchange(self, p, b):
        payload = p if b.world_size == 1 else torch.div(p, b.world_size)
        total = yield AllReduce(payload)
        return Exchanged(total, lambda: payload if b.world_size == 1 else payload * b.world_size)

    def bucket_payload_bytes(self, layout):
        return layout.numel * layout.dtype.itemsize


class _HalfCast(SummableCompressor):
    # Divide by N before the cast, as PyTorch's fp16 hook does, so the sum cannot overflow fp16.
    half_dtype: torch.dtype

    def __init__(self, feedback: str | None = None):
        super().__init__(feedback)

    @property
    def carries_nonfinite(self) -> bool:
        # A cast keeps NaN and Inf (and makes values above the half range Inf); with error feedback
        # fp16 values are sent saturated (wire_cast), which turns Inf finite: the owner checks the input.
        return not (self.saturates and saturation_limit(self.half_dtype) is not None)

    def compress(self, x, ctx):
        return divided(x, ctx, self.half_dtype, self.saturates)

    def decompress(self, payload, ctx):
        return payload.float().mul_(ctx.world_size)

    def payload_bytes(self, ctx: TensorContext, kept=None):
        return ctx.shape.numel() * 2

    def exchange(self, x, ctx):
        if ctx.world_size >= 2**13:
            return (yield from super().exchange(x, ctx))
        payload = self.compress(x, ctx)
        total = yield AllReduce(payload)
        # The mean decompress(total) / N = (float(total) * N) / N is float(total) itself: a half value
        # (11 significant bits in fp16, 8 in bf16) times N < 2^13 is exact in fp32, and so is dividing
        # it by N again.  So the half sum is the aggregate as it is: the owner's cast is exact.
        return Exchanged(total, lambda: self.decompress(payload, ctx))

    def always_plain(self, dtype, world_size):
        return self.allreduce_dtype(TensorContext(key="", shape=torch.Size(), dtype=dtype, world_size=world_size))

    def takes_bucket(self, world_size):
        return world_size < 2**13  # see exchange: the half sum is then the mean exactly

    bucketed = True

    def bucket_exchange(self, p, b):
        """x / N in fp32 (exact for N = 1), rounded once to the half type, as in exchange(); with error
        feedback (its only use of this route) the rounding and the residual p - N half(x / N) are a
        kernel each where they are compiled ahead."""
        world = b.world_size
        payload = None
        if _half_share.wanted(p.numel(), p):
            dtype = str(self.half_dtype).removeprefix("torch.")
            payload = _half_share.ahead(p, world=world, dtype=dtype, saturate=self.saturates)
        if payload is None:
            payload = _share_rounded(p, world, self.half_dtype, self.saturates)
        total = yield AllReduce(payload)
        residual = None
        if _half_residual.wanted(p.numel(), p):
            residual = lambda q: _half_residual.ahead(q, payload, world=world)  # noqa: E731
        return Exchanged(total, lambda: payload.float().mul_(world), subtract_sent=residual)

    def bucket_payload_bytes(self, layout):
        return layout.numel * 2

    def allreduce_dtype(self, ctx):
        # The exchange's mean is float(sum of half(x / N)) itself while N < 2^13 (FP16.exchange; bf16's
        # 8-bit significand times N is exact in fp32 too), which is what a plain half allreduce yields;
        # with error feedback the rounding error is kept, which only gradzip's exchange does.
        return self.half_dtype if self.feedback == "none" and ctx.world_size < 2**13 else None


def _share_rounded(p: torch.Tensor, world: int, half: torch.dtype, saturate: bool) -> torch.Tensor:
    """p / N in fp32 (p itself for N = 1), rounded once to ``half`` by :func:`wire_cast`."""
    share = p if world == 1 else torch.div(p, world)
    return wire_cast(share, half, saturate, summed=world)


@kernels.fused
def _half_share(p, *, world: int, dtype: str, saturate: bool):
    """:func:`_share_rounded` in one loop (``dtype``: float16 or bfloat16)."""
    return _share_rounded(p, world, getattr(torch, dtype), saturate)


@kernels.fused
def _half_residual(p, payload, *, world: int):
    """Error feedback's p - N float(payload), written into ``p``: the product and the difference
    rounded as the reference path's two steps."""
    return p.sub_(payload.float() * world)


@register
class FP16(_HalfCast):
    """Cast to IEEE half precision, allreduce, cast back (2 bytes per element; Micikevicius et al. 2018)."""

    name = "fp16"
    half_dtype = torch.float16


@register
class BF16(_HalfCast):
    """Cast to bfloat16 (fp32's range, 8-bit mantissa), allreduce, cast back (2 bytes per element)."""

    name = "bf16"
    half_dtype = torch.bfloat16
