"""SparseLoCo's outer compressor: chunked Top-k of a decaying error-feedback accumulator, 2-bit values."""
from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch

from ..bits import index_dtype, pack_bits, packed_nbytes, unpack_bits
from .base import AllGather, Compressor, Exchanged, TensorContext, times_scale, unscale_, workspace, zeroed
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
    owed_state = (state_key,)

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
            level, code, local = self.encode_rows(flat[start:start + rows * width].view(rows, width), k)
            levels.append(level)
            codes.append(code)
            positions.append(local.reshape(-1))
        idx = torch.cat(positions).to(self.index_dtype(flat.numel()))
        return torch.cat(levels).float(), pack_bits(torch.cat(codes), 2), idx

    @staticmethod
    def encode_rows(block: torch.Tensor, k: int) -> tuple:
        """C of each row of ``block`` (rows, width), a chunk each, keeping k: (levels lo, hi per row
        (flat), the rows' 2-bit codes one per byte (flat), the kept chunk-local indices (rows, k))."""
        rows, width = block.shape
        magnitudes = workspace("sparseloco.abs", block.numel(), block.dtype, block.device).view(rows, width)
        local = torch.topk(torch.abs(block, out=magnitudes), k, dim=1, sorted=False).indices
        return (*SparseLoCo.encode_values(block.gather(1, local), k), local)

    @staticmethod
    def encode_values(values: torch.Tensor, k, unkept: Optional[torch.Tensor] = None) -> tuple:
        """The levels (lo, hi per row, flat) and 2-bit codes (one per byte, flat) of each row's k kept
        values (rows, k); ``k`` an int or, per row, an int64 tensor (rows,) with ``unkept`` the entries
        past each row's own k (bool, as ``values``: no sum counts them, and their codes mean nothing).
        Both groups' sums and sizes come from one (rows, 2, k) selection: the small group's magnitudes
        in its first plane, the large group's in its second."""
        magnitude = values.abs()
        if unkept is None:
            large = magnitude > magnitude.sum(dim=1, keepdim=True) / max(k, 1)
        else:
            large = magnitude.masked_fill_(unkept, 0.0) > magnitude.sum(dim=1, keepdim=True) / k.clamp(min=1).view(-1, 1)
        is_large, zero = _sides(values.device)
        grouped = large.unsqueeze(1) == is_large  # (rows, 2, k): [small, large]
        # A selection, not magnitude * grouped: inf * 0 would be NaN.
        sums = torch.where(grouped, magnitude.unsqueeze(1), zero).sum(dim=2)
        sizes = grouped.sum(dim=2)
        if unkept is not None:  # an unkept entry is in no group, though its magnitude (0) is small
            torch.sub(k, sizes[:, 1], out=sizes[:, 0])
        codes = torch.bitwise_or(large.view(torch.uint8) << 1, (values < 0).view(torch.uint8))  # 2 large + negative
        return sums.div_(sizes.clamp_(min=1)).reshape(-1), codes.reshape(-1)

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
            e = torch.mul(old, times_scale(self.decay, ctx.scale), out=ctx.spare(self.state_key, old)).add_(x)
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
        ctx.set(self.state_key, unscale_(e, ctx.scale))  # kept unscaled (ctx.scale)
        return Exchanged(total.div_(len(gathered)).view(ctx.shape), sparse=own)

    # -- the bucket route ---------------------------------------------------------------------------------
    bucketed = True
    bucket_state = (state_key,)

    def bucket_plan(self, layout) -> "_ChunkPlan":
        """The bucket's chunks as two blocks of rows, built once per layout (:class:`_ChunkPlan`)."""
        cached = _PLANS.setdefault(layout, {})
        if (self.chunk, self.density) not in cached:
            cached[(self.chunk, self.density)] = _ChunkPlan(layout, self.chunk, self.kept_of)
        return cached[(self.chunk, self.density)]

    def bucket_index_dtype(self, layout) -> torch.dtype:
        return index_dtype(min(self.chunk, max(layout.numels, default=0)))

    def bucket_exchange(self, p, b):
        """e = beta e + p and C(e) as in :meth:`exchange`, each chunk of each tensor a row: one ``topk``
        for every full chunk of the bucket and one for all the tensors' last, shorter ones, padded to
        the longest (:class:`_ChunkPlan`); decoding is the same few operations whatever the bucket holds.
        Wire: the bucket's chunks' levels (fp32 lo, hi each), its K codes packed four per byte by tensor
        operations, and K chunk-local indices in the smallest dtype that addresses min(chunk, the
        largest tensor's n) positions."""
        layout = b.layout
        old = b.get(self.state_key)
        e = torch.clone(p) if old is None else torch.mul(old, times_scale(self.decay, b.scale)).add_(p)
        plan = self.bucket_plan(layout)
        levels, codes, local = plan.encode(e)
        gathered = yield AllGather((levels, _pack2(codes), local.to(self.bucket_index_dtype(layout))))
        total = torch.zeros(layout.numel, dtype=torch.float32, device=p.device)
        own = None
        for rank, fields in enumerate(gathered):  # rank order: identical float sums on every rank
            idx, values = plan.decode(fields)
            total.index_add_(0, idx, values)
            if rank == b.rank:
                own = (idx, values)
        e.index_add_(0, own[0], own[1], alpha=-1)  # e = e - D(C(e)), only where something was sent
        b.set(self.state_key, unscale_(e, b.scale))
        return Exchanged(total.div_(b.world_size), sparse=own)

    def bucket_payload_bytes(self, layout):
        chunks = sum(-(-n // self.chunk) for n in layout.numels)
        k = sum(self.kept(n) for n in layout.numels)
        return 8 * chunks + packed_nbytes(k, 2) + k * self.bucket_index_dtype(layout).itemsize


class _ChunkPlan:
    """SparseLoCo's chunks of a bucket as rows, with device tensors built once per layout, chunk and
    density: every full chunk of every tensor a row of one block (``full_starts``: each row's start),
    and every tensor's last, shorter chunk a row of a second block padded to W, the longest of them or
    ``columns`` if more (``short_positions``: each row's W elements' positions, a pad pointing at its
    row's start; ``pad``).  A padded row ranks its pads at -1, below every |e|, and sorts what it
    keeps, so a row's first k are its k largest: one ``topk`` for all short chunks, however many widths
    they have.  Both blocks' kept values then form one (rows, ``columns``) block for the quantiser:
    ``k``, each row's k (an int where every row is a full chunk, else int64 per row); ``unkept``, the
    entries past a row's k, and ``keep``, the flat positions of the others among the short rows' (None
    where none is past).

    Per kept entry, in wire order (the full chunks' rows, then the short ones', k entries each):
    ``entry_code``, four times its chunk's row (int32 where that holds: its value is entry ``entry_code
    + code`` of the chunks' signed levels lo, -lo, hi, -hi end to end, its position its index plus
    entry ``entry_code`` of ``row_starts``, each chunk's start four times over).  ``kept``: K, in all.
    Four bytes per kept entry, a fiftieth of the bucket at the default density.
    """

    def __init__(self, layout, chunk: int, kept_of):
        # Built on the host by tensor operations (a bucket of a billion elements has twenty million kept
        # entries at the default density: too many for Python lists), then moved to the device.
        full, short, widths = [], [], []
        for offset, n in zip(layout.offsets, layout.numels):
            whole, rest = divmod(n, chunk)
            if whole:
                full.append(torch.arange(offset, offset + whole * chunk, chunk))
            if rest:
                short.append(offset + whole * chunk)
                widths.append(rest)
        device, int64 = layout.device, torch.int64
        full = torch.cat(full) if full else torch.empty(0, dtype=int64)
        starts = torch.cat([full, torch.tensor(short, dtype=int64)])  # every row's, full ones first
        ks = torch.tensor([kept_of(chunk)] * len(full) + [kept_of(w) for w in widths], dtype=int64)
        self.chunk = chunk
        self.columns = int(ks.max()) if len(ks) else 0  # a full chunk's k where there is one: no short one keeps more
        self.full_starts = full.to(device).view(-1, 1) if len(full) else None
        self.short_positions = None
        if short:
            within = torch.arange(max(self.columns, *widths))
            pad = within >= torch.tensor(widths).view(-1, 1)
            self.short_positions = (starts[len(full):].view(-1, 1) + within.masked_fill(pad, 0)).view(-1).to(device)
            self.pad = pad.to(device)
        kept = torch.arange(self.columns) < ks.view(-1, 1)
        if bool(kept.all()):
            self.k, self.unkept, self.keep = (int(ks[0]) if len(ks) else 0), None, None
        else:
            self.k, self.unkept = ks.to(device), (~kept).to(device)
            self.keep = kept[len(full):].reshape(-1).nonzero().view(-1).to(device)  # every full row keeps all
        self.kept = int(ks.sum())
        self.row_starts = starts.repeat_interleave(4).to(device)
        code_dtype = torch.int32 if 4 * len(ks) < 2**31 else torch.int64
        self.entry_code = torch.arange(0, 4 * len(ks), 4, dtype=code_dtype).repeat_interleave(ks).to(device)
        self.empty = torch.empty(0, device=device)

    def encode(self, e: torch.Tensor) -> tuple:
        """(the chunks' fp32 levels, lo and hi each; the K 2-bit codes, one per byte; the K chunk-local
        indices, int64) of the flat bucket ``e``."""
        if not self.kept:
            return self.empty, self.empty.to(torch.uint8), self.empty.long()
        # both blocks' rows, the full chunks' then the short ones', written where they lie in one
        # (rows, columns) block of values and one of indices
        full = 0 if self.full_starts is None else self.full_starts.numel()
        short = 0 if self.short_positions is None else self.pad.shape[0]
        values = torch.empty(full + short, self.columns, dtype=e.dtype, device=e.device)
        local = torch.empty(full + short, self.columns, dtype=torch.int64, device=e.device)
        if full:  # each full chunk's row copied out (one gather), |e| taken in place
            rows = e.unfold(0, self.chunk, 1).index_select(0, self.full_starts.view(-1))
            torch.topk(rows.abs_(), self.columns, dim=1, sorted=False, out=(values[:full], local[:full]))
            torch.index_select(e, 0, local[:full].add(self.full_starts).view(-1), out=values[:full].view(-1))
        if short:
            rows = e.index_select(0, self.short_positions).view(self.pad.shape)  # a pad: a copy of its row's first
            torch.topk(rows.abs().masked_fill_(self.pad, -1.0), self.columns, dim=1, out=(values[full:], local[full:]))
            torch.gather(rows, 1, local[full:], out=values[full:])  # sorted: its first k are a row's k largest, pads after
        levels, codes = SparseLoCo.encode_values(values, self.k, self.unkept)
        if self.keep is None:
            return levels, codes, local.view(-1)
        return levels, self._kept(codes), self._kept(local.view(-1))

    def _kept(self, entries: torch.Tensor) -> torch.Tensor:
        """Of the block's (rows, columns) ``entries`` (flat), those within their row's k."""
        full = 0 if self.full_starts is None else self.full_starts.numel() * self.columns
        short = entries[full:].index_select(0, self.keep)
        return torch.cat([entries[:full], short]) if full else short

    def decode(self, fields: tuple) -> tuple:
        """(unique int64 positions in the bucket, float32 values) of one rank's bucket payload."""
        levels, packed, idx = fields
        signed = torch.stack([levels, levels.neg()], dim=1).view(-1)  # each chunk's lo, -lo, hi, -hi
        values = signed.index_select(0, self.entry_code + _unpack2(packed, self.kept))  # code: 2 large + negative
        return torch.add(self.row_starts.index_select(0, self.entry_code), idx), values


def _pack2(codes: torch.Tensor) -> torch.Tensor:
    """2-bit codes (uint8, < 4) packed four per byte, the first in the lowest bits (as
    :func:`gradzip.bits.pack_bits`), by tensor operations alone."""
    pad = -codes.numel() % 4
    if pad:
        codes = torch.cat([codes, _three_zeros(codes.device)[:pad]])
    return (codes.view(-1, 4) << _shifts2(codes.device)).sum(dim=1, dtype=torch.uint8)


def _unpack2(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`_pack2`: the first n codes (uint8)."""
    return ((packed.unsqueeze(1) >> _shifts2(packed.device)) & 3).view(-1)[:n]


#: Per bucket layout: SparseLoCo's plans by (chunk, density) (see SparseLoCo.bucket_plan).
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=8)
def _sides(device: torch.device) -> tuple:
    """(whether each group [small, large] is the large one, a (2, 1) bool; a float32 0) on ``device``,
    made once (read only)."""
    return torch.tensor([[False], [True]], device=device), torch.zeros((), device=device)


@functools.lru_cache(maxsize=8)
def _three_zeros(device: torch.device) -> torch.Tensor:
    """Three uint8 zeros on ``device`` (the most a last byte of codes is padded with), made once (read only)."""
    return torch.zeros(3, dtype=torch.uint8, device=device)


@functools.lru_cache(maxsize=8)
def _shifts2(device: torch.device) -> torch.Tensor:
    return torch.arange(0, 8, 2, dtype=torch.uint8, device=device)
