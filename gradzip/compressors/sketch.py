"""Count sketches: a fixed-size linear summary of the gradient, summed by one allreduce."""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from .. import kernels
from .base import AllReduce, Compressor, Exchanged, TensorContext, _stable_hash, check_ratio, workspace, zeroed
from .bucket import plus_minus_one
from .registry import register
from .sparse import top_k


#: Up to this many rows the sorting network below is the faster (2x at 16 rows; its cost grows as rows^2).
_NETWORK_ROWS = 16


def median_of_rows(a: torch.Tensor) -> torch.Tensor:
    """``a.median(dim=0).values`` of a 2-D ``a`` (the lower median for an even row count, NaN where a
    column holds one), overwriting ``a``.

    ``torch.median`` along the short first dimension of a (rows, n) tensor works column by column,
    slowly on CPUs (0.2 s for 5 x 2M).  Odd-even transposition sort (Knuth, TAOCP vol. 3, 5.3.4) sorts
    every column at once with elementwise minimum / maximum over whole rows, 7x faster for 5 rows.
    minimum and maximum return one of their inputs, so the median is the same value, and they propagate
    NaN, which spreads through the network to the median position as in ``torch.median`` (tested).
    """
    rows = a.shape[0]
    if rows > _NETWORK_ROWS:
        return a.median(dim=0).values
    # One scratch for every round, reused across calls: a fresh full-size one costs more in page faults
    # than the arithmetic done in it (5 x 25M: 133 ms for the first round against 25).
    scratch = workspace("median", (rows // 2) * math.prod(a.shape[1:]), a.dtype, a.device).view(rows // 2, *a.shape[1:])
    for r in range(rows):
        lo, hi = a[r % 2 : rows - 1 : 2], a[r % 2 + 1 : rows : 2]
        if lo.shape[0]:
            smaller = torch.minimum(lo, hi, out=scratch[: lo.shape[0]])
            torch.maximum(lo, hi, out=hi)
            lo.copy_(smaller)
    return a[(rows - 1) // 2]


#: Seeds are folded as in :meth:`BucketContext.draw_seed`: v = (v * _MIX + part) mod _PRIME.
_MIX, _PRIME = 1_000_003, 2**31 - 1


def row_seeds(seed: int, crcs: torch.Tensor, step: int, rows: int) -> torch.Tensor:
    """int32 seeds (rows, *crcs.shape) of the hash rows of the tensors whose key hashes are ``crcs``
    (int64, on the device): (seed, key, step, row) folded on the device, so that a bucket's tensors get
    theirs without a copy from the host."""
    v = (crcs + (seed % _PRIME) * _MIX) % _PRIME
    v = (v * _MIX + step % _PRIME) % _PRIME
    j = torch.arange(1, rows + 1, dtype=torch.int64, device=crcs.device).view(-1, *([1] * crcs.dim()))
    return ((v * _MIX + j) % _PRIME).to(torch.int32)


def sketch_draws(positions: torch.Tensor, seeds: torch.Tensor, cols, buffer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket hashes h (int64, in [0, cols)) and signs s (float32, +-1) of the int32 ``positions`` in
    their tensor under the int32 ``seeds`` (broadcast against them: one per hash row): the top 24 bits
    of lowbias32(i xor seed) (:func:`gradzip.kernels.lowbias32_`, as in ``counter_uniforms``) scaled to
    [0, cols), and its lowest bit as the sign (1: +1).  ``cols`` a number or an int64 tensor broadcast likewise.
    ``buffer(name, shape, dtype)`` gives the memory of the results, "buckets" and "signs", and of the
    hash, "signed" (default: fresh tensors), all written in place: a fresh (rows, n) tensor costs a CPU
    its page faults, and the hash's two int32 scratches are the float32 "signed" (which the caller
    writes next) and "signs" (written last)."""
    shape = torch.broadcast_shapes(positions.shape, seeds.shape)
    buffer = buffer or (lambda name, shape, dtype: torch.empty(shape, dtype=dtype, device=positions.device))
    x, t = (buffer(name, shape, torch.float32).view(torch.int32) for name in ("signed", "signs"))
    kernels.lowbias32_(torch.bitwise_xor(positions, seeds, out=x), scratch=t)
    buckets = buffer("buckets", shape, torch.int64).copy_(torch.bitwise_right_shift(x, 8, out=t).bitwise_and_(0xFFFFFF))
    signs = buffer("signs", shape, torch.float32).copy_(x.bitwise_and_(1))
    return buckets.mul_(cols).bitwise_right_shift_(24), signs.mul_(2).sub_(1)


@register
class Sketch(Compressor):
    """Count sketch with heavy-hitter recovery (Ivkin, Rothchild, Ullah, Braverman, Stoica & Arora,
    NeurIPS 2019, "Communication-efficient distributed SGD with sketching"; Rothchild et al., ICML 2020,
    FetchSGD).

    With R = ``rows`` hash rows of C = ceil(``width`` * k) buckets, k = ceil(ratio * n), bucket hashes
    h_j(i) in [0, C) and signs s_j(i) in {-1, +1} drawn by a counter-based hash of (seed, tensor key,
    step, row j, position i) (:func:`sketch_draws`), the same on every rank (so the ranks' sketches are
    of one linear map S) and on either route (tensor by tensor, or a bucket at once):

        S(p)[j, c] = sum_{i: h_j(i) = c} s_j(i) p_i               (each worker, its error-fed p)
        T = allreduce(S(p_r)) = S(sum_r p_r)                        (sketches are linear)
        est_i = median_j s_j(i) T[j, h_j(i)]                        (estimate of sum_r p_r,i)
        K = the k positions of largest |est_i|
        V = allreduce(p_r[K]) / N                                   (second round: the true mean at K)
        aggregate = V at K, 0 elsewhere;   sent_r = p_r at K, 0 elsewhere

    so the mean of what the workers sent is the aggregate, exactly, and residual error feedback (the
    default) keeps p_r outside K: what was not applied.  The second round is Ivkin et al.'s; FetchSGD's
    one-round unsketching (values read off the sketch, error accumulated in sketch space) is not
    implemented.  The hashes are drawn again every step, so estimation errors do not stick to the same
    coordinates.  Memory: tensor by tensor, the hashes, signs and signed values take 16 * R bytes per
    element (on a CPU kept from one step to the next, as other methods' buffers); on the bucket route, the
    R rows of estimates and one row's draws, about 4 R + 48 bytes per element, for the exchange alone.
    Wire: two allreduces, R * C * 4 + k * 4 bytes (fp32).  Tensors whose sketch would not be smaller
    than themselves (R * C >= n) are averaged densely and keep no residual.
    """

    name = "sketch"
    default_feedback = "residual"
    # The only randomness, the hashes, comes from a generator seeded identically on every rank.
    deterministic = True

    def __init__(self, ratio: float = 0.01, rows: int = 5, width: float = 10.0, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.ratio = check_ratio("ratio", ratio, allow_zero=False)
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows must be an integer >= 1, got {rows!r}")
        if isinstance(width, bool) or not isinstance(width, (int, float)) or not 1 <= width < math.inf:
            raise ValueError(f"width must be a finite number >= 1 (buckets per kept element), got {width!r}")
        self.rows = rows
        self.width = float(width)

    def sizes(self, ctx: TensorContext) -> tuple[int, int]:
        """(k, C): the elements sent and the buckets per row."""
        k = math.ceil(self.ratio * ctx.shape.numel())
        return k, math.ceil(self.width * k)

    def compresses(self, ctx):
        k, cols = self.sizes(ctx)
        return k > 0 and self.rows * cols < ctx.shape.numel()

    def exchange(self, x, ctx):
        flat = x.reshape(-1).float()
        n = flat.numel()
        k, cols = self.sizes(ctx)
        shape = (self.rows, n)
        crc = torch.full((), _stable_hash(ctx.key + "/sketch"), dtype=torch.int64, device=x.device)
        seeds = row_seeds(ctx.seed, crc, ctx.step, self.rows).view(self.rows, 1)
        buckets, signs = sketch_draws(torch.arange(n, dtype=torch.int32, device=x.device), seeds, cols,
                                      lambda name, shape, dtype: ctx.buffer(name, shape, dtype, x.device))
        # The (rows, n) products live in a buffer reused across steps.
        signed = torch.mul(signs, flat, out=ctx.buffer("signed", shape, torch.float32, x.device))
        sketch = torch.zeros(self.rows, cols, dtype=torch.float32, device=x.device).scatter_add_(1, buckets, signed)
        total = yield AllReduce(sketch)
        estimate = median_of_rows(torch.gather(total, 1, buckets, out=signed).mul_(signs))
        # The sampled top_k (25M: 35 ms against torch.topk's 745): medians of shared buckets tie often,
        # and it breaks ties at the k-th value its own way, the same on every rank (their estimates are).
        idx = top_k(estimate.abs_(), k)
        mine = flat[idx]
        values = yield AllReduce(mine)
        aggregate = zeroed(ctx.buffer("aggregate", (n,), torch.float32, x.device))
        aggregate[idx] = values / ctx.world_size
        return Exchanged(aggregate.view(ctx.shape), sparse=(idx, mine))

    def payload_bytes(self, ctx, kept=None):
        if not self.compresses(ctx):  # sent densely by feedback.py, in the gradient's dtype
            return ctx.shape.numel() * ctx.dtype.itemsize
        k, cols = self.sizes(ctx)
        return (self.rows * cols + k) * 4

    # -- the bucket route ---------------------------------------------------------------------------------
    bucketed = True

    def bucket_exchange(self, p, b):
        """As :meth:`exchange` per tensor (the same draws, sketches, medians, top-k and sums), on the whole
        bucket one hash row at a time: row j's bucket and sign of every element from its position in its
        tensor and its tensor's seed, scattered into the bucket's sketches (each tensor its C buckets per
        row, end to end); after the allreduce each row's estimates gathered the same way, the medians over
        the rows, and one topk per size class.  The tensors that are not compressed are averaged densely,
        in fp32 (x / N summed) with the sketches, and keep no residual.  Memory: the R rows of estimates
        and a row's draws, not every row's draws at once.  Wire: two allreduces, (sum of R * C + the dense
        elements + K) * 4 bytes."""
        layout, world, rows = b.layout, b.world_size, self.rows
        plan = self._plan(layout)
        if not plan.classes:  # nothing compressed: every tensor averaged densely
            total = yield AllReduce(p / world if world > 1 else p.clone())
            return Exchanged(total, sparse=(torch.arange(layout.numel, device=p.device), p), sent_exactly=True)
        index = layout.segment_index()
        position = torch.arange(layout.numel, dtype=torch.int32, device=p.device)  # each element's in its tensor
        position.sub_(plan.offsets.index_select(0, index))
        cols, base = plan.cols.index_select(0, index), plan.base.index_select(0, index)
        seeds = row_seeds(b.seed, plan.key_hashes, b.step, rows)  # (rows, tensors)
        kept = p if plan.dense_at is None else p * plan.compressed.index_select(0, index)  # dense ones add 0

        def row(j):
            """Row j's sketch slots (int64) and signs (float32 +-1) of every element."""
            slots, signs = sketch_draws(position, seeds[j].index_select(0, index), cols)
            return slots.add_(base).add_(j * plan.sum_cols), signs

        sketch = torch.zeros(rows * plan.sum_cols, dtype=torch.float32, device=p.device)
        # Each row's draws kept as one integer per element, 2 slot + (sign > 0), for the estimates after the
        # allreduce (drawn once, not again); their memory then takes the estimates themselves.  int32
        # unless a bucket holds 2^30 slots (a sketch of 4 GB).
        wide = 2 * rows * plan.sum_cols >= 2**31
        codes = torch.empty(rows, layout.numel, dtype=torch.int64 if wide else torch.int32, device=p.device)
        for j in range(rows):  # one row's draws alive at a time
            slots, signs = row(j)
            codes[j].copy_(torch.add(signs.gt(0), slots, alpha=2))
            sketch.scatter_add_(0, slots, signs.mul_(kept))
            del slots, signs
        del kept, position, cols, base, index
        dense_values = p.index_select(0, plan.dense_at) if plan.dense_at is not None else p.new_zeros(0)
        total = yield AllReduce(torch.cat([sketch, dense_values / world if world > 1 else dense_values]))
        summed = total[:sketch.numel()]
        estimates = codes.view(torch.float32)[:, :layout.numel]  # int64 codes: the first half of each row
        for j in range(rows):  # s_j(i) T[j, h_j(i)], written over row j's codes
            estimate = summed.index_select(0, codes[j] >> 1).mul_(plus_minus_one(codes[j] & 1, torch.float32))
            estimates[j].copy_(estimate)
            del estimate
        magnitude = median_of_rows(estimates).abs_()
        chosen = [layout.rows(magnitude, size).topk(k, dim=1, sorted=False).indices.add_(size.starts.view(-1, 1))
                  for size, k in plan.classes]
        del estimates, magnitude
        at = _positions(chosen, p.device)
        mine = p.index_select(0, at)
        values = yield AllReduce(mine)
        aggregate = torch.zeros(layout.numel, dtype=torch.float32, device=p.device)
        aggregate.index_copy_(0, at, values / world)
        if plan.dense_at is None:
            return Exchanged(aggregate, sparse=(at, mine), sent_exactly=True)
        aggregate.index_copy_(0, plan.dense_at, total[sketch.numel():])
        return Exchanged(aggregate, sparse=(torch.cat([at, plan.dense_at]), torch.cat([mine, dense_values])),
                         sent_exactly=True)

    def _plan(self, layout) -> "_SketchPlan":
        plans = _PLANS.setdefault(layout, {})
        key = (self.ratio, self.rows, self.width)
        if key not in plans:
            plans[key] = _SketchPlan(layout, self.ratio, self.rows, self.width)
        return plans[key]

    def bucket_payload_bytes(self, layout):
        total = 0
        for n in layout.numels:
            k = math.ceil(self.ratio * n)
            cols = math.ceil(self.width * k)
            total += self.rows * cols + k if k > 0 and self.rows * cols < n else n
        return total * 4


def _positions(parts: list, device: torch.device) -> torch.Tensor:
    """int64 positions in the bucket, the parts' end to end (none: empty)."""
    return torch.cat([part.reshape(-1) for part in parts]) if parts else torch.empty(0, dtype=torch.int64, device=device)


class _SketchPlan:
    """What a bucket's sketch needs that its layout fixes, built once per layout and parameters: per
    tensor (on the device) its offset, C (0 if not compressed), where its C buckets start in a row
    (``base``; rows of ``sum_cols``), 1.0 if compressed (``compressed``) and its key's hash; the size
    classes compressed, with their k; the positions of the tensors averaged densely (None: none)."""

    def __init__(self, layout, ratio: float, rows: int, width: float):
        device, numels = layout.device, layout.numels
        ks = [math.ceil(ratio * n) for n in numels]
        cols = [math.ceil(width * k) for k in ks]
        compressed = [k > 0 and rows * c < n for n, k, c in zip(numels, ks, cols)]
        cols = [c if yes else 0 for c, yes in zip(cols, compressed)]
        self.sum_cols = sum(cols)
        index_dtype = torch.int32 if rows * self.sum_cols < 2**31 else torch.int64
        self.offsets = torch.tensor(layout.offsets, dtype=torch.int32, device=device)
        self.cols = torch.tensor(cols, dtype=torch.int32, device=device)
        # a dense tensor's elements add 0 (``compressed``) to the first slot of each row: always a real one
        self.base = torch.tensor([sum(cols[:i]) if yes else 0 for i, yes in enumerate(compressed)], dtype=index_dtype,
                                 device=device)
        self.compressed = torch.tensor(compressed, dtype=torch.float32, device=device)
        self.key_hashes = torch.tensor([_stable_hash(key + "/sketch") for key in layout.keys], dtype=torch.int64,
                                       device=device)
        self.classes = [(size, ks[size.members[0]]) for size in layout.classes if compressed[size.members[0]]]
        dense = [torch.arange(o, o + n, device=device) for o, n, yes in zip(layout.offsets, numels, compressed)
                 if not yes and n]
        self.dense_at = torch.cat(dense) if dense else None


#: Per bucket layout: its sketch plans by (ratio, rows, width).
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
