"""Dense baselines: full precision, and the half-precision casts every study should compare against."""
from __future__ import annotations

import torch

from . import register
from .base import SummableCompressor, TensorContext


@register
class NoCompression(SummableCompressor):
    """Plain data-parallel averaging: allreduce the gradient in its own dtype, divide by N."""

    name = "none"

    def __init__(self, feedback: str | None = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        return x.to(ctx.dtype)

    def decompress(self, payload, ctx):
        return payload.float()

    def payload_bytes(self, ctx, kept=None):
        return ctx.shape.numel() * ctx.dtype.itemsize


class _HalfCast(SummableCompressor):
    # Divide by N before the cast, as PyTorch's fp16 hook does, so the sum cannot overflow fp16.
    half_dtype: torch.dtype

    def __init__(self, feedback: str | None = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        return (x / ctx.world_size).to(self.half_dtype)

    def decompress(self, payload, ctx):
        return payload.float() * ctx.world_size

    def payload_bytes(self, ctx: TensorContext, kept=None):
        return ctx.shape.numel() * 2


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
