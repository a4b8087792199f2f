"""Sparsification: send a few (value, index) pairs instead of the whole gradient.

Workers pick different positions, so the pairs are allgathered and scatter-added (except Random-k, whose
positions are shared and whose values can therefore be allreduced).  Indices use the smallest integer
dtype that addresses the tensor (uint8 / int16 / int32); values use ``value_dtype`` (default: the
gradient's own dtype).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..bits import index_dtype
from . import register
from .base import AllGather, Exchanged, GatheredCompressor, TensorContext, check_ratio, value_dtype


class Sparsifier(GatheredCompressor):
    """Shared machinery: subclasses only say which positions to send (:meth:`select`)."""

    default_feedback = "residual"

    def __init__(self, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.value_dtype = value_dtype
        self._vdtype = globals()["value_dtype"](value_dtype)

    def select(self, flat: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """Indices (int64, 1-D, unique) of the elements to send."""
        raise NotImplementedError

    def values_dtype(self, ctx: TensorContext) -> torch.dtype:
        return self._vdtype or ctx.dtype

    def compress(self, x, ctx):
        flat = x.reshape(-1)
        idx = self.select(flat, ctx)
        return flat[idx].to(self.values_dtype(ctx)), idx.to(index_dtype(flat.numel()))

    def decompress(self, fields, ctx):
        values, idx = fields
        out = torch.zeros(ctx.shape.numel(), dtype=torch.float32, device=values.device)
        out[idx.long()] = values.float()
        return out.view(ctx.shape)

    def exchange(self, x, ctx):
        fields = self.compress(x, ctx)
        gathered = yield AllGather(fields, same_size=self.same_size)
        total = torch.zeros(ctx.shape.numel(), dtype=torch.float32, device=x.device)
        for values, idx in gathered:  # rank order: identical float sums on every rank
            total.index_add_(0, idx.long(), values.float())
        sent = self.decompress(gathered[ctx.rank], ctx)
        mask = torch.zeros(ctx.shape.numel(), dtype=torch.bool, device=x.device)
        mask[fields[1].long()] = True
        return Exchanged((total / ctx.world_size).view(ctx.shape), sent, mask.view(ctx.shape))

    def payload_bytes(self, ctx, kept=None):
        if kept is None:
            kept = self.kept(ctx)
        return kept * (self.values_dtype(ctx).itemsize + index_dtype(ctx.shape.numel()).itemsize)

    def kept(self, ctx: TensorContext) -> int:
        raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")


@register
class TopK(Sparsifier):
    """Top-k (Aji & Heafield 2017; Stich et al. 2018): send the k = ceil(ratio * n) largest |x_i|.

    Wire: k * (value bytes + index bytes) per worker, allgathered.  Use with residual error feedback;
    without it accuracy drops sharply (ALGORITHMS.md, GRACE's ResNet-50 numbers).
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio)

    def kept(self, ctx):
        return math.ceil(self.ratio * ctx.shape.numel())

    def select(self, flat, ctx):
        return torch.topk(flat.abs(), self.kept(ctx), sorted=False).indices
