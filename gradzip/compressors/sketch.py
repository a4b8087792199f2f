"""Count sketches: a fixed-size linear summary of the gradient, summed by one allreduce."""
from __future__ import annotations

import math
import weakref
from typing import Optional

import torch

from .. import kernels
from .base import AllReduce, Compressor, Exchanged, TensorContext, _stable_hash, check_ratio, workspace, zeroed
from .bucket import ClassTopK
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


def row_seeds(seed: int, crcs: torch.Tensor, step: int, rows: int,
              folded: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 seeds (rows, *crcs.shape) of the hash rows of the tensors whose key hashes are ``crcs``
    (int64, on the device): (seed, key, step, row) folded on the device, so that a bucket's tensors get
    theirs without a copy from the host.  Folding (seed, key), then the step, then the row j,

        ((((key + seed M) mod P) M + step) mod P) M + j) mod P  =  (F + (step M mod P) + j) mod P,
        F = ((key + seed M) mod P) M^2 mod P

    (every term below 2^52: no int64 overflows), so F, which only the seed and keys fix, is
    ``folded`` (:func:`keys_folded`) where the caller keeps it, and a step costs four operations."""
    folded = keys_folded(seed, crcs) if folded is None else folded
    stepped = (step % _PRIME) * _MIX % _PRIME
    j = torch.arange(stepped + 1, stepped + rows + 1, dtype=torch.int64, device=crcs.device)
    return torch.remainder(folded + j.view(-1, *([1] * crcs.dim())), _PRIME).to(torch.int32)


def keys_folded(seed: int, crcs: torch.Tensor) -> torch.Tensor:
    """F of :func:`row_seeds`: ((crcs + seed M) mod P) M^2 mod P, int64."""
    v = (crcs + (seed % _PRIME) * _MIX) % _PRIME
    return (v * _MIX % _PRIME) * _MIX % _PRIME


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
    element (on a CPU kept from one step to the next, as other methods' buffers); on the bucket route, a
    piece's draws and the estimates' magnitudes, about 13 bytes per element at R = 5, for the exchange.
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
        bucket a piece of elements at a time (:attr:`_SketchPlan.pieces`): every hash row's bucket and sign
        of the piece's elements, from their positions in their tensors and their tensors' seeds, scattered
        into the bucket's sketches (each tensor its C buckets per row, end to end); after the allreduce the
        same draws again, each row's estimates gathered, their median and its magnitude; then one topk per
        size class.  The tensors that are not compressed are averaged densely, in fp32 (x / N summed) with
        the sketches, and keep no residual.  Memory: the draws of one piece's R rows (drawing twice costs
        less than keeping R rows of draws over the bucket, R copies of it); where the kernels are compiled
        ahead, none (:func:`_sketch_bucket`, :func:`_sketch_magnitude`).  Wire: two allreduces, (sum of
        R * C + the dense elements + K) * 4 bytes."""
        layout, world, rows = b.layout, b.world_size, self.rows
        plan = self._plan(layout)
        if not plan.classes:  # nothing compressed: every tensor averaged densely
            total = yield AllReduce(p / world if world > 1 else p.clone())
            return Exchanged(total, sparse=(torch.arange(layout.numel, device=p.device), p), sent_exactly=True)
        seeds = row_seeds(b.seed, plan.key_hashes, b.step, rows, plan.folded(b.seed))  # (rows, tensors)
        sketch = self._sketches(p, plan, seeds)
        if plan.dense_at is None:
            total = yield AllReduce(sketch)
        else:
            dense_values = p.index_select(0, plan.dense_at)
            total = yield AllReduce(torch.cat([sketch, dense_values / world if world > 1 else dense_values]))
        del sketch
        magnitude = self._magnitudes(p, total[:rows * plan.sum_cols], plan, seeds)
        at = plan.top(lambda size: layout.rows(magnitude, size))
        del magnitude
        mine = p.index_select(0, at)
        values = yield AllReduce(mine)
        aggregate = torch.zeros(layout.numel, dtype=torch.float32, device=p.device)
        aggregate.index_copy_(0, at, values / world)
        if plan.dense_at is None:
            return Exchanged(aggregate, sparse=(at, mine), sent_exactly=True)
        aggregate.index_copy_(0, plan.dense_at, total[rows * plan.sum_cols:])
        return Exchanged(aggregate, sparse=(torch.cat([at, plan.dense_at]), torch.cat([mine, dense_values])),
                         sent_exactly=True)

    def _sketches(self, p, plan, seeds) -> torch.Tensor:
        """The bucket's sketches S(p), its tensors' rows of C slots end to end in each of R rows: by one
        kernel where it is compiled ahead, else a piece at a time (dense tensors' elements add 0)."""
        sketch = torch.zeros(self.rows * plan.sum_cols, dtype=torch.float32, device=p.device)
        if _sketch_bucket.wanted(p.numel(), p):
            fused = _sketch_bucket.ahead(p, sketch, *plan.tables, plan.compressed, *_rows_apart(seeds))
            if fused is not None:
                return fused
        for start, stop in plan.pieces:
            tensor, slots, signs = plan.draws(seeds, start, stop)
            values = p[start:stop] if plan.dense_at is None else p[start:stop] * plan.compressed.index_select(0, tensor)
            sketch.index_add_(0, slots.view(-1), signs.mul_(values).view(-1))
            del tensor, slots, signs, values
        return sketch

    def _magnitudes(self, p, summed, plan, seeds) -> torch.Tensor:
        """|est_i| = |median_j s_j(i) T[j, h_j(i)]| of every element, from the summed sketches T: by one
        kernel where it is compiled ahead, else the same draws again a piece at a time."""
        if self.rows <= _NETWORK_ROWS and _sketch_magnitude.wanted(p.numel(), p):
            fused = _sketch_magnitude.ahead(p, summed, *plan.tables, *_rows_apart(seeds))
            if fused is not None:
                return fused
        magnitude = torch.empty(p.numel(), dtype=torch.float32, device=p.device)
        for start, stop in plan.pieces:
            _, slots, signs = plan.draws(seeds, start, stop)
            estimates = signs.mul_(summed.index_select(0, slots.view(-1)).view_as(signs))
            del slots
            torch.abs(median_of_rows(estimates), out=magnitude[start:stop])
            del estimates, signs
        return magnitude

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


@kernels.fused(ordered=False)
def _sketch_bucket(p, sketch, tensor_starts, offsets, cols, base, compressed, *seeds):
    """The bucket's sketches ``sketch`` (zeros, a row of ``sum_cols`` per hash row) plus every hash row's
    s_j(i) p_i at its slot h_j(i), as :meth:`Sketch.bucket_exchange` draws them a piece at a time: one
    kernel, no draw kept in memory.  The sums at a slot are in no fixed order (atomic adds on a GPU, as
    ``index_add_``'s there); every rank then gets the same allreduced sketches.  The seeds come a row per
    argument (:func:`_rows_apart`)."""
    tensor, slots, signs = _draws_of(torch.arange(p.shape[0], dtype=torch.int32, device=p.device), torch.stack(seeds),
                                     tensor_starts, offsets, cols, base, _row_starts(len(seeds), sketch.shape[0], p.device))
    return sketch.index_add(0, slots.reshape(-1), (signs * (p * compressed.index_select(0, tensor))).reshape(-1))


@kernels.fused
def _sketch_magnitude(p, summed, tensor_starts, offsets, cols, base, *seeds):
    """|median_j s_j(i) T[j, h_j(i)]| of every element of the bucket ``p`` from the allreduced sketches
    ``summed``, as :meth:`Sketch.bucket_exchange` estimates a piece at a time: the draws again, the gathers
    and the sorting network of :func:`median_of_rows` (up to 16 rows) in one kernel; seeds as
    :func:`_sketch_bucket`'s."""
    rows = len(seeds)
    _, slots, signs = _draws_of(torch.arange(p.shape[0], dtype=torch.int32, device=p.device), torch.stack(seeds),
                                tensor_starts, offsets, cols, base, _row_starts(rows, summed.shape[0], p.device))
    estimates = list((signs * summed.index_select(0, slots.reshape(-1)).view_as(signs)).unbind(0))
    for r in range(rows):  # median_of_rows' network, on values
        for i in range(r % 2, rows - 1, 2):
            estimates[i], estimates[i + 1] = torch.minimum(estimates[i], estimates[i + 1]), torch.maximum(estimates[i], estimates[i + 1])
    return estimates[(rows - 1) // 2].abs()


def _rows_apart(seeds: torch.Tensor) -> tuple:
    """The (rows, tensors) seeds as a kernel compiled ahead takes them, a tensor per row: every dimension
    of its arguments is a size it compiles for any value of, and the number of rows is a constant."""
    return tuple(seeds.unbind(0))


def _row_starts(rows: int, slots, device) -> torch.Tensor:
    """Where each of the ``rows`` rows of a bucket's sketches of ``slots`` slots in all starts, int64
    (rows, 1)."""
    return torch.arange(rows, dtype=torch.int64, device=device).view(-1, 1) * (slots // rows)


def _draws_of(position, seeds, tensor_starts, offsets, cols, base, row_starts) -> tuple:
    """The tensor (int32) of each bucket element at ``position`` (int32), and every hash row's slot
    (int64, in the bucket's sketches, rows starting at ``row_starts``) and sign (float32 +-1) of them,
    as (rows, n) tensors, under the (rows, tensors) ``seeds``; per tensor its offset, C and first slot
    in a row."""
    tensor = torch.bucketize(position, tensor_starts, out_int32=True, right=True)
    position = position.sub_(offsets.index_select(0, tensor))  # in its tensor
    hashed = seeds.index_select(1, tensor)  # eagerly the draws' first scratch: hashed in place

    def buffer(name, shape, dtype):
        return hashed.view(dtype) if name == "signed" else torch.empty(shape, dtype=dtype, device=seeds.device)

    slots, signs = sketch_draws(position, hashed, cols.index_select(0, tensor), buffer)
    return tensor, slots.add_(base.index_select(0, tensor)).add_(row_starts), signs


#: A bucket is drawn a piece at a time, every hash row of a piece at once (a row's draws take about four
#: copies of the piece): pieces of a (_PIECES_PER_ROW * rows + 1)-th of the bucket keep them within one
#: copy and a half of it; below _MIN_PIECE elements a piece's operations cost more than its memory.
_PIECES_PER_ROW, _MIN_PIECE = 3, 2**16


class _SketchPlan:
    """What a bucket's sketch needs that its layout fixes, built once per layout and parameters: per
    tensor (on the device) its offset, C (0 if not compressed), where its C buckets start in a row
    (``base``; rows of ``sum_cols``), 1.0 if compressed (``compressed``) and its key's hash; the size
    classes compressed, with their k; the positions of the tensors averaged densely (None: none); the
    pieces the bucket is drawn in, and their draws (:meth:`draws`)."""

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
        self.top = ClassTopK(self.classes, device)  # each compressed tensor's k largest estimates
        self._folded: dict = {}
        dense = [torch.arange(o, o + n, device=device) for o, n, yes in zip(layout.offsets, numels, compressed)
                 if not yes and n]
        self.dense_at = torch.cat(dense) if dense else None
        self.tables = (layout.tensor_starts, self.offsets, self.cols, self.base)  # what the draws read per tensor
        self.row_starts = _row_starts(rows, rows * self.sum_cols, device)
        size = max(_MIN_PIECE, -(-layout.numel // (_PIECES_PER_ROW * rows + 1)))
        self.pieces = [(start, min(start + size, layout.numel)) for start in range(0, layout.numel, size)]

    def folded(self, seed: int) -> torch.Tensor:
        """The tensors' :func:`keys_folded` under ``seed``, made once."""
        if seed not in self._folded:
            self._folded[seed] = keys_folded(seed, self.key_hashes)
        return self._folded[seed]

    def draws(self, seeds: torch.Tensor, start: int, stop: int) -> tuple:
        """:func:`_draws_of` the elements of the piece [start, stop) of the bucket."""
        position = torch.arange(start, stop, dtype=torch.int32, device=seeds.device)
        return _draws_of(position, seeds, *self.tables, self.row_starts)


#: Per bucket layout: its sketch plans by (ratio, rows, width).
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
