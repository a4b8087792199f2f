"""SparseLoCo's outer compressor: chunked Top-k of a decaying error-feedback accumulator, 2-bit values."""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..bits import index_dtype, pack_bits, packed_nbytes, unpack_bits
from .base import AllGather, Compressor, Exchanged, TensorContext, workspace, zeroed
from .registry import register
from .sparse import _check_int, _check_number


@register
class SparseLoCo(Compressor):
    r"""SparseLoCo (Sarfi, Thérien, Lidin & Belilovsky 2025, "Communication Efficient LLM Pre-training with
    SparseLoCo"): error feedback with a decaying accumulator in place of DiLoCo's outer momentum.

    Each worker keeps its own accumulator e (this compressor's per-tensor state, staged in ``ctx`` and
    committed only when the exchange succeeded on every rank) and, for its input Δ (a pseudo-gradient or a
    gradient)::

        e ← β e + Δ                     β = ``decay``
        send C(e)                       chunked Top-k, 2-bit values
        e ← e − D(C(e))                 nothing is lost: D(C(e)) + new e == β e + Δ
        aggregate = mean over ranks of D(C(e_r)), summed in rank order (bit-identical on every rank)

    C: the flattened tensor is cut into chunks of ``chunk`` elements (the last one shorter); in a chunk of m
    elements the k = ceil(density · m) largest |e_i| are kept.  Their values are coded in 2 bits each,
    sign and one of two magnitudes: with s the chunk's mean |kept|, the kept values with |v| > s form the
    large group and decode to ±hi = ± their mean |v|, the others to ±lo = ± the mean |v| of the small
    group (0 for an empty group).  Code = 2 · large + (v < 0), packed four per byte.

    Wire (allgathered, the same size on every rank): per chunk two fp32 levels (lo, hi), then the
    ceil(2 K / 8) bytes of codes and K chunk-local indices in the smallest dtype addressing
    min(chunk, n) positions; K = sum over chunks of ceil(density · m).  Its only feedback is "none":
    the accumulator is its own (residual feedback cannot decay).
    """

    name = "sparseloco"
    feedbacks = ("none",)
    deterministic = True
    state_key = "sparseloco_error"  # distinct from feedback.py's "residual"

    def __init__(self, density: float = 0.02, chunk: int = 4096, decay: float = 0.95,
                 feedback: Optional[str] = None):
        super().__init__(feedback)
        self.density = _check_number("density", density, lambda d: 0 < d <= 1, "a number with 0 < density <= 1")
        self.chunk = _check_int("chunk", chunk, 1)
        self.decay = _check_number("decay", decay, lambda b: 0 <= b <= 1, "a number with 0 <= decay <= 1")

    # -- layout: full chunks as one (rows, chunk) block, then the shorter last chunk -------------------------
    def blocks(self, n: int) -> list:
        """(start, rows, width, k) of the full chunks and of the last, shorter one (rows 0 if absent)."""
        full, rest = divmod(n, self.chunk)
        return [(0, full, self.chunk, self.kept_of(self.chunk)),
                (full * self.chunk, int(rest > 0), rest, self.kept_of(rest))]

    def kept_of(self, m: int) -> int:
        return min(m, math.ceil(self.density * m))

    def kept(self, n: int) -> int:
        return sum(rows * k for _, rows, _, k in self.blocks(n))

    def index_dtype(self, n: int) -> torch.dtype:
        return index_dtype(min(self.chunk, n))

    def payload_bytes(self, ctx, kept=None):
        n = ctx.shape.numel()
        k = self.kept(n)
        return 8 * -(-n // self.chunk) + packed_nbytes(k, 2) + k * self.index_dtype(n).itemsize

    # -- codec ------------------------------------------------------------------------------------------------
    def encode(self, flat: torch.Tensor) -> tuple:
        """(fp32 levels [lo, hi per chunk], packed 2-bit codes, chunk-local indices) of the flat fp32 ``flat``."""
        levels, codes, positions = [], [], []
        for start, rows, width, k in self.blocks(flat.numel()):
            block = flat[start:start + rows * width].view(rows, width)
            magnitudes = workspace("sparseloco.abs", block.numel(), block.dtype, block.device).view(rows, width)
            local = torch.topk(torch.abs(block, out=magnitudes), k, dim=1, sorted=False).indices
            values = block.gather(1, local)
            magnitude = values.abs()
            large = magnitude > magnitude.sum(dim=1, keepdim=True) / max(k, 1)
            zero = magnitude.new_zeros(())
            n_large = large.sum(dim=1)
            # A selection, not magnitude * large: inf * 0 would be NaN.
            hi = torch.where(large, magnitude, zero).sum(dim=1) / n_large.clamp(min=1)
            lo = torch.where(large, zero, magnitude).sum(dim=1) / (k - n_large).clamp(min=1)
            levels.append(torch.stack([lo, hi], dim=1).reshape(-1))
            codes.append((large.to(torch.uint8) * 2 + (values < 0)).reshape(-1))
            positions.append(local.reshape(-1))
        idx = torch.cat(positions).to(self.index_dtype(flat.numel()))
        return torch.cat(levels).float(), pack_bits(torch.cat(codes), 2), idx

    def decode(self, fields: tuple, n: int) -> tuple:
        """(unique int64 positions in the flattened tensor, float32 values) of one rank's payload."""
        levels, packed, idx = fields
        codes = unpack_bits(packed, 2, self.kept(n)).long()
        levels = levels.view(-1, 2)
        positions, values = [], []
        row = at = 0
        for start, rows, width, k in self.blocks(n):
            c = codes[at:at + rows * k].view(rows, k)
            magnitude = levels[row:row + rows].gather(1, c >> 1)
            values.append(torch.where((c & 1).bool(), -magnitude, magnitude).reshape(-1))
            offsets = start + width * torch.arange(rows, device=idx.device)
            positions.append((idx[at:at + rows * k].view(rows, k).long() + offsets.unsqueeze(1)).reshape(-1))
            row, at = row + rows, at + rows * k
        return torch.cat(positions), torch.cat(values)

    def exchange(self, x: torch.Tensor, ctx: TensorContext):
        old = ctx.get(self.state_key)
        # e = beta * e + x, rounded as written, in memory of its own (x may be the caller's): after the
        # first step the spare that the last commit retired (double buffering: no fresh page faults).
        if old is None:
            e = torch.clone(x, memory_format=torch.contiguous_format)
        else:
            e = torch.mul(old, self.decay, out=ctx.spare(self.state_key, old)).add_(x)
        flat = e.view(-1)
        gathered = yield AllGather(self.encode(flat), same_size=True)
        n = flat.numel()
        total = zeroed(ctx.buffer("aggregate", (n,), torch.float32, x.device))
        own = None
        for rank, fields in enumerate(gathered):  # rank order: identical float sums on every rank
            idx, values = self.decode(fields, n)
            total.index_add_(0, idx, values)
            if rank == ctx.rank:
                own = (idx, values)
        flat.index_add_(0, own[0], own[1], alpha=-1)  # e = e - D(C(e)), only where something was sent
        ctx.set(self.state_key, e)
        return Exchanged(total.div_(len(gathered)).view(ctx.shape), sparse=own)
