"""Sparsification: send a few (value, index) pairs instead of the whole gradient.

Workers pick different positions, so the pairs are allgathered and scatter-added (Top-k, Threshold,
Gradient dropping, DGC).  Random-k and CSC pick the *same* positions on every rank, so they allreduce the
values alone and send no indices.  Indices use the smallest integer dtype that addresses the tensor
(uint8 / int16 / int32); values use ``value_dtype`` (default: the gradient's own dtype).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .. import devices, kernels
from ..bits import as_index, index_dtype
from .base import AllGather, AllReduce, Compressor, Exchanged, GatheredCompressor, TensorContext, check_ratio
from .base import value_dtype as _parse_value_dtype
from .base import compare, count_true, wire_cast, workspace, zeroed
from .bucket import PIECE, ClassTopK, segment_of
from .registry import register


class Sparsifier(GatheredCompressor):
    """Shared machinery: subclasses only say which positions to send (:meth:`select`).

    Where the (value, index) pairs would take more bytes than the values of every element (more than
    half the elements of an fp32 tensor with int32 indices), the payload is those n values instead,
    zero where nothing is sent, with an empty index field: the same sum, never more bytes than dense.
    """

    default_feedback = "residual"

    def __init__(self, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.value_dtype = value_dtype
        self._vdtype = _parse_value_dtype(value_dtype)

    def select(self, flat: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """Indices (int64, 1-D, unique) of the elements to send."""
        raise NotImplementedError

    def select_mask(self, flat: torch.Tensor, ctx: TensorContext, out: torch.Tensor) -> Optional[torch.Tensor]:
        """Optional: whether each element is sent, written into the bool tensor ``out`` and returned, for
        methods that select by one comparison (the positions are then found only when they are few);
        None (the default): :meth:`select` gives the positions."""
        return None

    def values_dtype(self, ctx: TensorContext) -> torch.dtype:
        return self._vdtype or ctx.dtype

    def sends_dense(self, ctx: TensorContext, kept: int) -> bool:
        """Whether ``kept`` (value, index) pairs would take more bytes than n values."""
        vbytes = self.values_dtype(ctx).itemsize
        return kept * (vbytes + index_dtype(ctx.shape.numel()).itemsize) > ctx.shape.numel() * vbytes

    def encode(self, flat: torch.Tensor, ctx: TensorContext) -> tuple[tuple, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(fields, idx, mask): the payload and the int64 positions sent, or, for a dense payload, None
        and the mask of the positions sent."""
        n, vdtype = flat.numel(), self.values_dtype(ctx)
        passed = self.select_mask(flat, ctx, workspace("mask", n, torch.bool, flat.device))
        # A dense payload's mask outlives the yield (feedback's kept count, DGC's momentum masking).
        if passed is not None and self.sends_dense(ctx, count_true(passed)):
            mask = ctx.buffer("sent mask", (n,), torch.bool, flat.device).copy_(passed)
        else:
            idx = self.select(flat, ctx) if passed is None else _where(passed)
            if not self.sends_dense(ctx, idx.numel()):
                values = wire_cast(flat.index_select(0, idx), vdtype, self.saturates)
                return (values, idx.to(index_dtype(n))), idx, None
            mask = zeroed(ctx.buffer("sent mask", (n,), torch.bool, flat.device)).index_fill_(0, idx, True)
        values = ctx.buffer("dense values", (n,), vdtype, flat.device)
        if passed is None or not self.values_where_passed(flat, values):
            zero = flat.new_zeros(())
            if vdtype == flat.dtype:
                torch.where(mask, flat, zero, out=values)
            else:
                wire_cast(torch.where(mask, flat, zero), vdtype, self.saturates, out=values)
        return (values, torch.empty(0, dtype=index_dtype(n), device=flat.device)), None, mask

    def values_where_passed(self, flat: torch.Tensor, out: torch.Tensor) -> bool:
        """Optional, for methods with :meth:`select_mask`: write ``where(select_mask, flat, 0)`` into
        ``out`` from ``flat`` alone, and return True; False (the default): the mask is read instead.
        (torch.where reading a bool mask runs at about a fifth of memory speed on CPUs.)"""
        return False

    def compress(self, x, ctx):
        return self.encode(x.reshape(-1), ctx)[0]

    @staticmethod
    def is_dense(fields: tuple, n: int) -> bool:
        values, idx = fields
        return n > 0 and idx.numel() == 0 and values.numel() == n

    def decompress(self, fields, ctx):
        values, idx = fields
        n = ctx.shape.numel()
        out = torch.zeros(n, dtype=torch.float32, device=values.device)
        if self.is_dense(fields, n):
            out += values
        else:
            out[idx.long()] = values.float()
        return out.view(ctx.shape)

    def exchange(self, x, ctx):
        fields, own_idx, own_mask = self.encode(x.reshape(-1), ctx)
        gathered = yield AllGather(fields, same_size=self.same_size)
        n = ctx.shape.numel()
        total = ctx.buffer("aggregate", (n,), torch.float32, x.device)
        dense = [self.is_dense(f, n) for f in gathered]
        positions = [None if d else idx.long() for d, (_, idx) in zip(dense, gathered)]
        union = means = None  # where the aggregate can be non-zero, when that is a small part of it
        if not (all(dense) and _dense_mean(total, gathered)):  # else summed and divided in one pass
            # Rank 0's part is 0 + v, not a copy of v: -0.0 sums to +0.0, as in the scatter-adds after it.
            if dense[0]:
                torch.add(gathered[0][0], 0.0, out=total)
            else:  # a rank's positions are distinct, so its scatter-add into zeros is a copy of 0 + v
                zeroed(total).index_copy_(0, positions[0], torch.add(gathered[0][0].float(), 0.0))
            for rank in range(1, len(gathered)):  # rank order: identical sums on every rank
                values, idx = gathered[rank][0], positions[rank]
                if idx is not None:
                    total.index_add_(0, idx, values.float())
                else:  # +0 where nothing was sent leaves the sum as it is (it is never -0)
                    total += values
            # The mean: total / N, computed where something was sent (0 / N is 0 everywhere else).
            if not any(dense) and sum(idx.numel() for idx in positions) * 4 < n:
                union = torch.cat(positions) if len(positions) > 1 else positions[0]
                means = total.index_select(0, union).div_(ctx.world_size)
                total.index_copy_(0, union, means)
            else:
                total.div_(ctx.world_size)
        exactly = x.dtype == self.values_dtype(ctx) == torch.float32
        if own_idx is None:  # sent densely: p - sent is p - p = +0 where sent, p - (+0) = p elsewhere
            values = fields[0]
            sent = values.view(ctx.shape) if exactly else (lambda: values.float().view(ctx.shape))
            return Exchanged(total.view(ctx.shape), sent, own_mask.view(ctx.shape))
        # sent is zero but at this rank's own positions: error feedback touches only those.
        sent = (positions[ctx.rank], gathered[ctx.rank][0].float())
        return Exchanged(total.view(ctx.shape), sparse=sent, support=union, support_values=means,
                         sent_exactly=exactly)

    def payload_bytes(self, ctx, kept=None):
        if kept is None:
            kept = self.kept(ctx)
        vbytes = self.values_dtype(ctx).itemsize
        if self.sends_dense(ctx, kept):
            return ctx.shape.numel() * vbytes
        return kept * (vbytes + index_dtype(ctx.shape.numel()).itemsize)

    def kept(self, ctx: TensorContext) -> int:
        raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")


@kernels.fused(min_numel=kernels.LARGE_NUMEL)  # two passes saved for N = 1, N for N ranks
def _mean_of_dense(out, *values):
    """(((0 + v_0) + v_1) + ... + v_(N-1)) / N, the ranks' dense payloads summed in rank order and
    divided as :meth:`Sparsifier.exchange` does, in one pass instead of N + 1."""
    total = values[0].float() + 0.0  # -0.0 sums to +0.0, as in the reference (Inductor keeps it)
    for v in values[1:]:
        total = total + v.float()
    return out.copy_(total / len(values))


def _dense_mean(total: torch.Tensor, gathered) -> bool:
    """The mean of the ranks' dense payloads into ``total`` by :func:`_mean_of_dense`, where it runs;
    False: the caller sums and divides."""
    if not kernels.enabled_over_ranks(total.numel(), len(gathered)):
        return False
    return _mean_of_dense(total, *(values for values, _ in gathered)) is not None


@register
class TopK(Sparsifier):
    """Top-k (Aji & Heafield 2017; Stich et al. 2018): send the k = ceil(ratio * n) largest |x_i|.

    Wire: k * (value bytes + index bytes) per worker, allgathered.  Use with residual error feedback;
    without it accuracy drops sharply (GRACE, Xu et al. 2021: ResNet-50 with Top-k 1% reached 42.5% top-1
    without error feedback, 73.0% with it).
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio)

    def kept(self, ctx):
        return math.ceil(self.ratio * ctx.shape.numel())

    def select(self, flat, ctx):
        return top_k_abs(flat, self.kept(ctx))

    bucketed = True

    def bucket_exchange(self, p, b):
        """The same k per tensor, found size class by size class: one ``torch.topk`` of |rows| over the
        stacked tensors of each size.  Wire: the bucket's K selected values and their positions in
        the bucket, or, where those would take more bytes, its n values, zero where not selected."""
        layout, vdtype = b.layout, self._vdtype or b.layout.dtype
        absp = p.abs()  # |p| once for the bucket, and the values read once at the end
        position = _ratio_top(layout, self.ratio)(lambda size: layout.rows(absp, size))
        del absp
        value = wire_cast(p.index_select(0, position), vdtype, self.saturates)
        dense = self._bucket_dense(layout, position.numel())
        if dense:
            fields = (torch.zeros(layout.numel, dtype=vdtype, device=p.device).index_put_((position,), value),)
        else:
            fields = (value, position.to(index_dtype(layout.numel)))
        gathered = yield AllGather(fields)
        total = torch.zeros(layout.numel, dtype=torch.float32, device=p.device)
        for got in gathered:  # rank order: identical sums on every rank; rank 0's is 0 + v, as in exchange()
            if dense:
                total += got[0]
            else:
                total.index_add_(0, as_index(got[1]), got[0].float())
        exactly = p.dtype == vdtype == torch.float32
        return Exchanged(total.div_(b.world_size), sparse=(position, value.float()), sent_exactly=exactly)

    def _bucket_dense(self, layout, kept: int) -> bool:
        vbytes = (self._vdtype or layout.dtype).itemsize
        return kept * (vbytes + index_dtype(layout.numel).itemsize) > layout.numel * vbytes

    def bucket_payload_bytes(self, layout):
        kept = sum(math.ceil(self.ratio * n) for n in layout.numels)
        vbytes = (self._vdtype or layout.dtype).itemsize
        if self._bucket_dense(layout, kept):
            return layout.numel * vbytes
        return kept * (vbytes + index_dtype(layout.numel).itemsize)


# -- parameter checks and selection helpers ---------------------------------------------------------------


def largest_first(a: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending positions of the 1-D ``a``'s k largest values, ties going to the lower position: the
    first k of a stable descending sort, without sorting all of ``a`` (CSC's 98K chunk norms of 25M
    elements: 1 ms against 10).  Everything above the k-th largest value is in; of the values equal
    to it, the first ones by position fill up to k."""
    if k >= a.numel() or bool(torch.isnan(a).any()):  # NaN's place in the order: the sort's
        return torch.sort(a, descending=True, stable=True).indices[:k].sort().values
    kth = torch.topk(a, k, sorted=False).values.min()
    above = _where(a > kth)
    tied = _where(a == kth)[: k - above.numel()]
    return torch.cat([above, tied]).sort().values


def _check_number(name: str, value, ok, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _momentum_params(momentum, nesterov, clip_norm) -> tuple:
    """Validate the parameters of feedback.py's MomentumCorrection (DGC Sec. 3.2-3.3)."""
    momentum = _check_number("momentum", momentum, lambda m: 0 <= m < 1, "a number with 0 <= momentum < 1")
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be True or False, got {nesterov!r}")
    if clip_norm is not None:
        clip_norm = _check_number("clip_norm", clip_norm, lambda c: c > 0, "None or a finite number > 0")
    return momentum, nesterov, clip_norm


def strided_sample(a: torch.Tensor, sample_ratio: float, ctx: TensorContext) -> torch.Tensor:
    """Every (1/sample_ratio)-th element of ``a`` from a random start (``a`` must not be empty).

    Each element is equally likely to be drawn, so the sample's quantiles estimate those of ``a``, at the
    cost of one strided read.  Each rank draws its own start: the thresholds are local decisions.
    """
    stride = max(1, round(1 / sample_ratio))
    gen = ctx.generator(torch.device("cpu"), shared=False, salt="sample")
    start = int(torch.randint(min(stride, a.numel()), (1,), generator=gen))
    return a[start::stride]


def _kth_largest(a: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(a, k, sorted=False).values.min()


def _where(mask: torch.Tensor) -> torch.Tensor:
    """The positions of ``mask``'s True elements in its flattened order: int64, ascending, as
    ``mask.nonzero()``, which on CPUs takes four to six times as long as numpy's ``flatnonzero`` (25M
    elements: 28 ms against 7 at 0.3% True, 280 ms against 44 at 94%)."""
    if not devices.host_memory(mask):
        return mask.nonzero().reshape(-1)
    return torch.from_numpy(np.flatnonzero(mask.numpy()))


def _where_2d(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column indices of the 2-D ``mask``'s True elements, row by row (as ``mask.nonzero()``'s
    two columns).  On CPUs the flat positions by numpy's ``flatnonzero``, then one ``divmod``: a fifth
    of the time of numpy's 2-D ``nonzero`` (8 x 13,000 booleans, 13% True: 59 us against 245)."""
    if not devices.host_memory(mask):
        return mask.nonzero().unbind(1)
    rows, cols = np.divmod(np.flatnonzero(mask.numpy()), mask.shape[1])
    return torch.from_numpy(rows), torch.from_numpy(cols)


def _at_least(a: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    # Zeros are never worth sending: a zero threshold (sparse gradients, e.g. embeddings) must not
    # select the whole tensor.  For a >= 0, "a >= t and a > 0" is "a >= max(t, smallest positive
    # subnormal)": one comparison pass instead of three (a NaN threshold stays NaN and selects nothing).
    passed = workspace("mask", a.numel(), torch.bool, a.device)
    return _where(compare("ge", a, _above_zero(threshold, a.dtype), passed))


def _above_zero(threshold: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    info = torch.finfo(dtype)
    return threshold.clamp_min(info.smallest_normal * info.eps)


def _at_least_abs(flat: torch.Tensor, threshold: torch.Tensor, expected: int) -> torch.Tensor:
    """``_at_least(|flat|, threshold)``, the same indices in the same (ascending) order, without
    writing |flat| when about ``expected`` elements pass: by the column search of :func:`_not_below_abs`
    where few columns can hit (at most 1/16 of the elements expected to pass), else by one comparison
    over |flat|."""
    if 16 * expected > flat.numel() or flat.numel() < _PREFILTER_MIN or not devices.prefilters_selection(flat):
        return _at_least(magnitudes(flat), threshold)
    return _not_below_abs(flat, _above_zero(threshold, flat.dtype), keep_nan=False)


def magnitudes(flat: torch.Tensor) -> torch.Tensor:
    """|flat| in a reused workspace (see :func:`workspace`): only for selections done before a yield."""
    return torch.abs(flat, out=workspace("abs", flat.numel(), flat.dtype, flat.device))


#: Elements of |x| that CSC's chunk norms write and sum at a time (1 MB of fp32: cached in between).
_NORM_BLOCK = 1 << 18

#: Rows up to this length are reduced by one serial loop each (torch's parallel grain is 32768).
_SERIAL_ROW = 8192

#: top_k pre-filters with a sample only above this size (torch.topk is fast enough below, and on GPUs).
_PREFILTER_MIN = 1 << 16


def top_k(a: torch.Tensor, k: int, negated: bool = False) -> torch.Tensor:
    """Indices of the k largest values of the 1-D ``a`` (of ``-a`` if ``negated``: the same indices as
    ``top_k(-a, k)``, without writing -a), exactly as ``torch.topk(a, k).indices`` up to
    the order of the indices and the choice among tied values.

    ``torch.topk`` over millions of elements is slow on CPUs.  A fixed strided sample (no randomness:
    Top-k is deterministic) gives a threshold t that a little over k elements reach; the exact top-k
    then runs over those candidates only.  It is exact whenever at least k candidates pass (then the
    k-th largest value is >= t, so every top-k element is a candidate); otherwise, which a skewed
    sample can cause, it falls back to the full ``torch.topk``.  Candidates are "not below t", so NaNs
    count as the largest values, as in ``torch.topk``.
    """
    n = a.numel()

    def whole():  # -a is written only here
        return torch.topk(torch.neg(a, out=workspace("negated", n, a.dtype, a.device)) if negated else a, k,
                          sorted=False).indices

    # Sample about 200 n / k elements (see _sampled_threshold).
    stride = k // 200
    if stride < 2 or n < _PREFILTER_MIN or not devices.prefilters_selection(a) or 8 * k > n:
        return whole()
    sample = a[::stride]
    threshold = _sampled_threshold(-sample if negated else sample, k, n)
    # -a < t is a > -t, exactly (negation is exact; NaN compares false either way).
    mask = workspace("mask", n, torch.bool, a.device)
    below = compare("gt", a, -threshold, mask) if negated else compare("lt", a, threshold, mask)
    candidates = _where(below.logical_not_())
    if candidates.numel() < k:
        return whole()
    found = a.index_select(0, candidates)
    return candidates[torch.topk(found.neg_() if negated else found, k, sorted=False).indices]


#: top_k_abs looks at the elements in this many interleaved groups (x viewed as GROUPS rows).
GROUPS = 8


def top_k_abs(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest |x_i| of the 1-D ``x``: :func:`top_k` of |x|, without writing |x|.

    Candidates "not below" a sampled threshold t are found in two steps: x is viewed as GROUPS rows of
    w columns, and the largest |x| of each column is max(amax, -amin) over the rows (one read of x,
    vectorised); only the columns whose largest |x| is not below t are gathered and compared element
    by element.  That replaces a comparison and a ``nonzero`` over all n elements, both slow on CPUs
    (a byte of output per element), with ones over n / GROUPS columns and the few columns that hit.
    """
    n = k // 200
    if n < 2 or x.numel() < _PREFILTER_MIN or not devices.prefilters_selection(x) or 8 * k > x.numel():
        return top_k(magnitudes(x), k)
    threshold = _sampled_threshold(x[::n].abs(), k, x.numel())
    candidates, found = _not_below_abs(x, threshold, with_magnitudes=True)
    if candidates.numel() < k:
        return torch.topk(magnitudes(x), k, sorted=False).indices
    return candidates[torch.topk(found, k, sorted=False).indices]


def _sampled_threshold(sample: torch.Tensor, k: int, n: int) -> torch.Tensor:
    """A value that a little over k of the n elements reach, from a strided sample of them."""
    # The count above the sample's r-th largest has a relative spread of about 1 / sqrt(r), and r is
    # set 20% plus 3 standard deviations above k's share.
    share = k * sample.numel() / n
    return _kth_largest(sample, min(sample.numel(), math.ceil(1.2 * share + 3 * math.sqrt(share) + 1)))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)  # it saves about a pass: worth its compile on large tensors only
def _column_max_abs(rows, out):
    return out.copy_(rows.abs().amax(0))


def _not_below_abs(x: torch.Tensor, threshold: torch.Tensor, keep_nan: bool = True, with_magnitudes: bool = False):
    """Indices i, ascending, with |x_i| not below ``threshold``: NaN is not below anything, so it is
    kept, unless ``keep_nan`` is False (then the indices are those of |x_i| >= threshold).  With
    ``with_magnitudes``, also their |x_i|, in the same order (gathered from the few columns read
    already, rather than from x again)."""
    w = x.numel() // GROUPS
    rows = x[: GROUPS * w].view(GROUPS, w)

    def scratch(name, dtype, shape):  # fresh temporaries of this size would be page-faulted in every call
        return workspace(name, math.prod(shape), dtype, x.device).view(shape)

    # The largest |x| of each column: one read of x in a fused kernel (|x| is never written; a kernel
    # that also compared them with the threshold and wrote a boolean mask ran four times slower), else
    # max(amax, -amin), two reads.  Both are exact, and NaN propagates, so its column is kept.
    tops = scratch("tops", x.dtype, (w,))
    if not (x.dtype == torch.float32 and kernels.enabled(x.numel()) and _column_max_abs(rows, tops) is not None):
        torch.amax(rows, 0, out=tops)
        torch.maximum(tops, torch.amin(rows, 0, out=scratch("lows", x.dtype, (w,))).neg_(), out=tops)
    # Boolean masks: a byte per element for _where to scan (a 0./1. float mask would be four).
    columns = _where(compare("lt", tops, threshold, scratch("columns", torch.bool, (w,))).logical_not_())
    c = columns.numel()
    picked = torch.index_select(rows, 1, columns, out=scratch("picked", x.dtype, (GROUPS, c))).abs_()

    def passing(a, out=None):
        return compare("lt", a, threshold, out).logical_not_() if keep_nan else compare("ge", a, threshold, out)

    row, hit = _where_2d(passing(picked, scratch("hits", torch.bool, (GROUPS, c))))
    found = picked.view(-1).index_select(0, row * c + hit) if with_magnitudes else None
    # Row by row, columns ascending within a row: i = row * w + column is ascending, tail last.
    positions = columns.index_select(0, hit).add_(row.mul_(w))
    rest = x[GROUPS * w :].abs()
    tail = _where(passing(rest))
    positions = torch.cat([positions, tail + GROUPS * w])
    if not with_magnitudes:
        return positions
    return positions, torch.cat([found, rest.index_select(0, tail)])


def random_positions(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct positions out of n, every k-subset equally likely, drawn from ``gen`` only.

    ``randperm(n)[:k]`` costs O(n) (over a second for 25M elements on a CPU) to keep 1%.  For large,
    sparse draws this takes a few more than k uniform draws, sorts them and keeps the d distinct values:
    given d, a uniformly random d-subset, since nothing in the draws favours one position over another.
    Dropping d - k of them at ranks drawn independently of their values (a recursive, much smaller
    draw) leaves a uniformly random k-subset, in ascending order (the sum order is the same on every
    rank).  The draws are int32 where n allows: sorting them takes two thirds of the time of int64's.
    """
    device = gen.device
    if n < _PREFILTER_MIN or 16 * k > n or not devices.sorts_subset_draws(device):
        return torch.randperm(n, generator=gen, device=device)[:k]
    dtype = torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64
    distinct = torch.empty(0, dtype=dtype, device=device)
    while distinct.numel() < k:
        # Expected repeats among m draws are about m^2 / 2n; draw a few standard deviations more.
        extra = math.ceil(k * k / n + 6 * math.sqrt(k * k / n) + 16)
        draws = torch.randint(n, (k - distinct.numel() + extra,), generator=gen, device=device, dtype=dtype)
        both = torch.cat([distinct, draws])
        distinct = torch.unique_consecutive(torch.from_numpy(np.sort(both.numpy())))  # numpy's: twice torch's speed
    if distinct.numel() > k:  # numpy's boolean indexing: a quarter of the time of masked_select
        kept = np.ones(distinct.numel(), dtype=bool)
        kept[random_positions(distinct.numel(), distinct.numel() - k, gen).numpy()] = False
        return torch.from_numpy(distinct.numpy()[kept].astype(np.int64))
    return distinct.long()


# -- sparsifiers with positions shared by all ranks: values are allreduced ------------------------------


def _times(a: torch.Tensor, factor: float) -> torch.Tensor:
    """``a * factor``, or ``a`` itself for a factor of 1 (x * 1.0 is x, bit for bit)."""
    return a if factor == 1 else a * factor


class SharedSparsifier(Compressor):
    """Every rank sends the same positions, so only values travel, summed by one allreduce.

    Unlike the allgathered sparsifiers, no indices are sent and the cost does not grow with N.
    """

    default_feedback = "residual"

    def __init__(self, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.value_dtype = value_dtype
        self._vdtype = _parse_value_dtype(value_dtype)

    def values_dtype(self, ctx: TensorContext) -> torch.dtype:
        return self._vdtype or ctx.dtype

    def reduce_at(self, x: torch.Tensor, idx: torch.Tensor, ctx: TensorContext, scale: float = 1.0):
        """Allreduce ``scale * x[idx]``; the aggregate is the mean, ``sent`` this rank's decoded share."""
        flat = x.reshape(-1)
        vdtype = self.values_dtype(ctx)
        # A 16-bit sum could overflow: divide by N before the cast, as the fp16 baseline does (and with
        # error feedback saturate each rank's share so that the N of them cannot sum past the range).
        pre = ctx.world_size if vdtype.itemsize == 2 else 1
        payload = wire_cast(_times(flat.index_select(0, idx), scale / pre), vdtype, self.saturates, summed=pre)
        total = yield AllReduce(payload)
        aggregate = zeroed(ctx.buffer("aggregate", (flat.numel(),), torch.float32, x.device))
        means = _times(total.float(), pre / ctx.world_size)
        aggregate.index_copy_(0, idx, means)
        return Exchanged(aggregate.view(ctx.shape), sparse=(idx, _times(payload.float(), pre)), support=idx,
                         support_values=means, sent_exactly=x.dtype == vdtype == torch.float32 and scale == 1)


@register
class RandomK(SharedSparsifier):
    """Random-k (Stich et al., NeurIPS 2018): send k = ceil(ratio * n) positions drawn at random.

    Every rank draws the same positions (generator seeded by seed, tensor key and step), so the values
    are allreduced and no index is sent.  ``unbiased=True`` scales them by n/k, making E[sent] = x; its
    default feedback is then "none", else "residual".  Wire: k * value bytes.
    """

    name = "randomk"
    deterministic = False

    def __init__(self, ratio: float = 0.01, unbiased: bool = False, value_dtype: Optional[str] = None,
                 feedback: Optional[str] = None):
        if not isinstance(unbiased, bool):
            raise ValueError(f"unbiased must be True or False, got {unbiased!r}")
        if feedback is None:
            feedback = "none" if unbiased else "residual"
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio, allow_zero=False)
        self.unbiased = unbiased

    def kept(self, ctx: TensorContext) -> int:
        return math.ceil(self.ratio * ctx.shape.numel())

    def exchange(self, x, ctx):
        n, k = ctx.shape.numel(), self.kept(ctx)
        idx = random_positions(n, k, ctx.generator(x.device, shared=True))
        scale = n / k if self.unbiased and k else 1.0
        return (yield from self.reduce_at(x, idx, ctx, scale))

    def payload_bytes(self, ctx, kept=None):
        return (self.kept(ctx) if kept is None else kept) * self.values_dtype(ctx).itemsize

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor the same k = ceil(ratio * n) positions on every rank: the k largest of n distinct
        int32 keys hashed by counter, shared by the ranks (``b.hashes(shared=True)``: one draw for the
        bucket, one topk per size class), so every k-subset is equally likely.  The values (times n / k
        if unbiased) are allreduced as in :meth:`exchange`, divided by N before a 16-bit cast.  Wire: the
        bucket's K values, no index."""
        layout, vdtype = b.layout, self._vdtype or b.layout.dtype
        pre = b.world_size if vdtype.itemsize == 2 else 1
        keys = b.hashes(layout.numel, shared=True, salt="randomk")  # one draw: a class each its slice
        rows = {size.members: part.view(-1, size.numel)
                for size, part in zip(layout.classes, keys.split([len(s.members) * s.numel for s in layout.classes]))}
        idx = _ratio_top(layout, self.ratio)(lambda size: rows[size.members])
        keys = rows = None  # a bucket's worth of draws (rows views it), not to be held across the allreduce
        factors = [((size.numel / k if self.unbiased else 1.0) / pre, len(size.members) * k)
                   for size, k in ((size, math.ceil(self.ratio * size.numel)) for size in layout.classes)]
        values = p.index_select(0, idx)  # the bucket's values at once; each class's factor, if any, after
        if any(factor != 1 for factor, _ in factors):
            cached = self.__dict__.setdefault("_bucket_factors", {})
            if (layout.keys, pre) not in cached:
                cached[layout.keys, pre] = torch.cat([torch.full((count,), factor, device=p.device)
                                                     for factor, count in factors])
            values.mul_(cached[layout.keys, pre])
        payload = wire_cast(values, vdtype, self.saturates, summed=pre)
        total = yield AllReduce(payload)
        aggregate = torch.zeros(layout.numel, dtype=torch.float32, device=p.device)
        aggregate.index_copy_(0, idx, _times(total.float(), pre / b.world_size))
        return Exchanged(aggregate, sparse=(idx, _times(payload.float(), pre)),
                         sent_exactly=p.dtype == vdtype == torch.float32 and not self.unbiased)

    def bucket_payload_bytes(self, layout):
        return sum(math.ceil(self.ratio * n) for n in layout.numels) * (self._vdtype or layout.dtype).itemsize


# -- allgathered sparsifiers with data-dependent sizes ---------------------------------------------------


class MaskedBucket:
    """The bucket route of a sparsifier that selects by a mask whose count depends on the data
    (Threshold, Gradient dropping): a mixin before :class:`Sparsifier` in the bases.

    The subclass computes its selection over the whole bucket as one bool mask (:meth:`bucket_mask`);
    then one allreduce gives the largest count over the ranks, K, and **the bucket's one host read**
    (:func:`masked_bucket_exchange`) takes K and this rank's own count, which fix the payload's size.
    Every rank sends K (value, position in the bucket) pairs, its own first, padded with position n (a
    slot past the bucket, dropped by the receivers); or, where pairs would take more bytes than the
    bucket's n values, those values, zero where not selected.  The sums are those of :meth:`exchange`:
    every rank's values added at its positions in rank order, divided by N.  Wire: 8 bytes (the count)
    + K * (value bytes + index bytes), or n * value bytes.
    """

    def bucket_mask(self, p: torch.Tensor, b) -> torch.Tensor:
        """Whether each element of the flat ``p`` is sent (bool, over the bucket)."""
        raise NotImplementedError

    def bucket_exchange(self, p, b):
        vdtype = self._vdtype or b.layout.dtype
        kept = self.__dict__.setdefault("_bucket_kept", {})
        return (yield from masked_bucket_exchange(p, b, self.bucket_mask(p, b), vdtype, kept, self.saturates))

    def bucket_payload_bytes(self, layout, kept: Optional[int] = None) -> int:
        """Bytes sent for K = ``kept`` pairs (None: the K of this bucket's last exchange)."""
        if kept is None:
            kept = self.__dict__.get("_bucket_kept", {}).get(layout.keys)
            if kept is None:
                raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")
        vbytes = (self._vdtype or layout.dtype).itemsize
        if _pairs_exceed(kept, layout.numel, vbytes):
            return 8 + layout.numel * vbytes
        return 8 + kept * (vbytes + index_dtype(layout.numel + 1).itemsize)


def _pairs_exceed(kept: int, n: int, vbytes: int) -> bool:
    """Whether ``kept`` (value, index) pairs over a bucket of n take more bytes than its n values."""
    return kept * (vbytes + index_dtype(n + 1).itemsize) > n * vbytes


def masked_bucket_exchange(p: torch.Tensor, b, passed: torch.Tensor, vdtype: torch.dtype, kept_by_bucket: dict,
                           saturate: bool):
    """See :class:`MaskedBucket`.  ``kept_by_bucket`` records K under the bucket's keys; ``saturate``:
    :func:`~.base.wire_cast`'s."""
    n = b.layout.numel
    own = torch.count_nonzero(passed).view(1)
    most = yield AllReduce(own, op="max")
    kept, mine = torch.cat([most, own]).tolist()  # the bucket's one host read: K and this rank's count
    kept_by_bucket[b.layout.keys] = kept
    exactly = p.dtype == vdtype == torch.float32
    if _pairs_exceed(kept, n, vdtype.itemsize):  # the bucket's values, zero where not sent: no positions
        sent = wire_cast(torch.where(passed, p, 0.0), vdtype, saturate)
        gathered = yield AllGather((sent,))
        total = torch.zeros(n, dtype=torch.float32, device=p.device)
        for (got,) in gathered:  # rank order: identical sums on every rank; rank 0's is 0 + v, as in exchange()
            total += got
        return Exchanged(total.div_(b.world_size), sent.float, passed, sent_exactly=exactly)
    idx = torch.nonzero_static(passed, size=kept, fill_value=n).view(-1)  # ascending, then the padding
    values = wire_cast(p.index_select(0, idx.clamp(max=n - 1)), vdtype, saturate)
    gathered = yield AllGather((values, idx.to(index_dtype(n + 1))))
    total = torch.zeros(n + 1, dtype=torch.float32, device=p.device)
    for got in gathered:  # rank order: identical sums on every rank; rank 0's is 0 + v, as in exchange()
        total.index_add_(0, as_index(got[1]), got[0].float())
    return Exchanged(total[:n].div_(b.world_size), sparse=(idx[:mine], values[:mine].float()), sent_exactly=exactly)



@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _above_tau(flat, tau, out):
    """where(|x| > tau, x, 0): Threshold's dense payload, one read of x (the mask is not read)."""
    return out.copy_(torch.where(flat.abs() > tau, flat, 0.0))


@register
class Threshold(MaskedBucket, Sparsifier):
    """Threshold sparsification (Strom, Interspeech 2015): send every x_i with |x_i| > tau.

    tau is a static hyper-parameter, hard to tune (the right value drifts during training), so the number
    sent varies by step and by rank.  Wire: kept * (value bytes + index bytes), allgathered with a size
    header.  Strom sends +-tau for each kept element; here the exact values are sent, so the residual
    keeps only what was not sent.
    """

    name = "threshold"
    same_size = False

    def __init__(self, tau: float = 1e-3, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.tau = _check_number("tau", tau, lambda t: t > 0, "a finite number > 0")

    def select(self, flat, ctx):
        return _where(self.select_mask(flat, ctx, workspace("mask", flat.numel(), torch.bool, flat.device)))

    def select_mask(self, flat, ctx, out):
        return compare("gt", magnitudes(flat), self.tau, out)

    def values_where_passed(self, flat, out):
        # |x| > tau as select_mask compares it: in float32, tau rounded to it (as torch and numpy do).
        return (flat.dtype == out.dtype == torch.float32 and kernels.enabled(flat.numel())
                and _above_tau(flat, torch.tensor(self.tau, dtype=torch.float32), out) is not None)

    bucketed = True

    def bucket_mask(self, p, b):
        """|p_i| > tau, one comparison over the bucket (tau rounded to float32, as per tensor); the
        exchange and its one host read: :class:`MaskedBucket`."""
        return torch.abs(p) > self.tau


@register
class GradientDropping(MaskedBucket, Sparsifier):
    """Gradient dropping (Aji & Heafield, EMNLP 2017): drop the R = ``drop_ratio`` smallest |x_i|.

    The threshold is the R-quantile of a strided random sample of |x| (``sample_ratio`` of it), which avoids
    a full sort; then every |x_i| >= threshold is sent, so about (1 - R) n elements.  Wire: kept * (value
    bytes + index bytes), allgathered with a size header.  Thresholds are per tensor (the paper's
    layer-wise variant).
    """

    name = "dropping"
    same_size = False
    deterministic = False

    def __init__(self, drop_ratio: float = 0.99, sample_ratio: float = 0.01, value_dtype: Optional[str] = None,
                 feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.drop_ratio = _check_number("drop_ratio", drop_ratio, lambda r: 0 <= r < 1,
                                        "a number with 0 <= drop_ratio < 1")
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio, allow_zero=False)

    def select(self, flat, ctx):
        if flat.numel() == 0:
            return torch.empty(0, dtype=torch.long, device=flat.device)
        sample = strided_sample(flat, self.sample_ratio, ctx).abs()
        # s - floor(R s) rather than ceil((1 - R) s): 1 - 0.99 is 0.0100000000000000089, one too many.
        keep = sample.numel() - math.floor(self.drop_ratio * sample.numel())
        expected = math.ceil(keep * flat.numel() / sample.numel())
        return _at_least_abs(flat, _kth_largest(sample, keep), expected)

    bucketed = True

    def bucket_mask(self, p, b):
        """|p_i| >= t (and > 0) with t per tensor the keep-th largest of its sample as in :meth:`select`,
        keep = s - floor(R s) for a sample of s: each tensor's strided sample from a start drawn by
        counter for each rank (``b.uniforms(shared=False)``, once for the bucket), every sample sorted at
        once (:meth:`_SamplePlan.sorted`) and each tensor's keep-th read off it.  The exchange and its one
        host read: :class:`MaskedBucket`."""
        layout = b.layout
        plan = _dropping_plan(layout, max(1, round(1 / self.sample_ratio)), self.drop_ratio)
        if not plan.sampled:  # every tensor empty
            return torch.zeros(layout.numel, dtype=torch.bool, device=p.device)
        sample, short = plan.sorted(p, b.uniforms(len(layout), shared=False, salt="dropping"), absolute=False)
        thresholds = sample.take(torch.where(short, plan.keep_short, plan.keep_full)).clamp_min_(_TINY)
        if _dropping_mask.wanted(layout.numel, p):
            mask = _dropping_mask.ahead(p, thresholds, layout.tensor_starts)
            if mask is not None:
                return mask
        # The thresholds spread first: their int32 index is freed before |p| is made.
        spread = layout.per_element(thresholds)
        return torch.abs(p) >= spread


@kernels.fused
def _dropping_mask(p, thresholds, tensor_starts):
    """|p_i| >= its tensor's threshold in one pass over the bucket, each element's tensor found from
    ``tensor_starts`` (``segment_of``), where the reference path first spreads the thresholds over the
    bucket by a bucket-sized index (four operations, two bucket-sized temporaries)."""
    return p.abs() >= thresholds.index_select(0, segment_of(p.shape[0], tensor_starts, p.device))


@register
class DGC(MaskedBucket, Sparsifier):
    """Deep Gradient Compression (Lin et al., ICLR 2018) with all four techniques.

    feedback="momentum" (feedback.py) does momentum correction u = m u + g, v = v + u (Nesterov:
    u = (u + g) m, v = v + u + g), local clipping of g to ``clip_norm`` * N^-1/2, and momentum factor
    masking (u = v = 0 where sent).  This class selects: about k = ceil(density * n) of the largest |v|,
    with the warm-up density(e) = max(ratio, 0.25^(e + 1)) in stage e < warmup_epochs (75%, 93.75%,
    98.4375%, 99.6% sparsity, Sec. 3.4), ``ratio`` afterwards.

    The stage is the epoch given to ``GradzipState.set_epoch``.  A script that never calls it gets the
    same schedule stepped by exchanges: stage = floor(step * warmup_epochs / warmup_steps), ``step``
    counting this tensor's exchanges, so the warm-up ends after ``warmup_steps`` of them (0: no warm-up
    without set_epoch).  The default, 1000 (250 per stage), is of the order of the paper's 4 epochs for
    small runs (an epoch is 937 steps of Fashion-MNIST with 2 workers of batch 32, ``gradzip train``'s
    default, and 98 of CIFAR-10 at a global batch of 512), and it bounds the first, densest stage, which
    can be slower than no compression (25%: 2 bytes per element with fp32 values and int32 indices,
    allgathered: at 4 workers as many bytes as a dense ring allreduce, more beyond), to 250 steps.

    Selection: the threshold is the top-density quantile of a strided sample of |v| (its r-th largest
    value); if fewer than 0.8k pass it is lowered (at most ``max_retries`` times) to the sample's 2r-th,
    4r-th, 8r-th largest value, but at most halved, and halved where the sample goes no lower; if more
    than k pass, an exact top-k runs over the candidates only (hierarchical top-k), so the k *largest*
    are kept (the reference code truncates by index order) and never more than k are sent.  Only
    tensors with dim > 1 and at least ``min_numel`` elements are compressed; the others go dense.
    Wire: kept * (value bytes + index bytes), allgathered with a size header (6 B per element with
    value_dtype="float16" and int32 indices).
    """

    name = "dgc"
    default_feedback = "momentum"
    feedbacks = ("none", "residual", "momentum")
    same_size = False
    deterministic = False
    #: Accept the candidates as they are when at least this fraction of k pass.
    lower_bound = 0.8
    #: How often the threshold is lowered when too few pass.
    max_retries = 3

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, nesterov: bool = False,
                 clip_norm: Optional[float] = None, warmup_epochs: int = 4, warmup_steps: int = 1000,
                 sample_ratio: float = 0.01, min_numel: int = 1024, value_dtype: Optional[str] = None,
                 feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio, allow_zero=False)
        self.momentum, self.nesterov, self.clip_norm = _momentum_params(momentum, nesterov, clip_norm)
        self.warmup_epochs = _check_int("warmup_epochs", warmup_epochs, 0)
        self.warmup_steps = _check_int("warmup_steps", warmup_steps, 0)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio, allow_zero=False)
        self.min_numel = _check_int("min_numel", min_numel, 0)

    def feedback_params(self):
        """The parameters of the momentum correction (feedback.MomentumCorrection) this method builds."""
        return {"momentum": self.momentum, "nesterov": self.nesterov, "clip_norm": self.clip_norm}

    def density(self, epoch: int) -> float:
        """Fraction of elements sent in ``epoch``: the paper's exponential warm-up (Sec. 3.4), density
        25%, 6.25%, 1.5625%, 0.39% (4x sparser each epoch, never below ``ratio``), then ``ratio``."""
        if epoch >= self.warmup_epochs:
            return self.ratio
        return max(self.ratio, 0.25 ** (max(epoch, 0) + 1))

    def stage(self, ctx: TensorContext) -> int:
        """The warm-up stage of this exchange: the epoch given to ``set_epoch``, else
        min(floor(step * warmup_epochs / warmup_steps), warmup_epochs), where ``warmup_epochs`` is past
        the warm-up (as is every step when ``warmup_steps`` is 0)."""
        return self._stage(ctx.epoch, ctx.step)

    def _stage(self, epoch: Optional[int], step: int) -> int:
        if epoch is not None:
            return epoch
        if self.warmup_steps == 0:
            return self.warmup_epochs
        return min(step * self.warmup_epochs // self.warmup_steps, self.warmup_epochs)

    def compresses(self, ctx):
        # Biases and normalisation weights are a tiny share of the bytes: the paper sends them dense.
        return len(ctx.shape) > 1 and ctx.shape.numel() >= self.min_numel

    def sample(self, v: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """The sample of v whose |.| the threshold is estimated from (0.1%-1% of it in the paper)."""
        return strided_sample(v, self.sample_ratio, ctx)

    def select(self, flat, ctx):
        density = self.density(self.stage(ctx))
        k = math.ceil(density * flat.numel())
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=flat.device)
        sample = self.sample(flat, ctx).abs()
        r = math.ceil(density * sample.numel())
        threshold = _kth_largest(sample, r)
        chosen = _at_least_abs(flat, threshold, k)
        for retry in range(1, self.max_retries + 1):
            if chosen.numel() >= self.lower_bound * k:
                break
            # Twice as far down the sample each time, so that about twice as many pass, but never below
            # half the previous threshold, and always lower (halved where the sample goes no further).
            # Halving alone lets some 100x as many through on a Gaussian's tail, all for the exact top-k.
            lower = _kth_largest(sample, min(sample.numel(), r << retry))
            threshold = torch.where(lower < threshold, torch.maximum(lower, threshold / 2), threshold / 2)
            chosen = _at_least_abs(flat, threshold, k << retry)
        if chosen.numel() > k:
            # Hierarchical top-k: exact, but over the candidates only.
            chosen = chosen[torch.topk(flat.index_select(0, chosen).abs_(), k, sorted=False).indices]
        return chosen

    def payload_bytes(self, ctx, kept=None):
        if not self.compresses(ctx):
            return ctx.shape.numel() * ctx.dtype.itemsize  # feedback.py's dense path
        return super().payload_bytes(ctx, kept)

    bucketed = True

    def bucket_sent_whole(self, layout) -> Optional[torch.Tensor]:
        """The positions of the elements of the tensors sent whole (dim <= 1 or fewer than ``min_numel``
        elements), built once per layout; None where every tensor is compressed."""
        return _whole_tensors(layout, self.min_numel)

    def bucket_exchange(self, p, b):
        """Per tensor the selection of :meth:`select`, for the whole bucket at once (:meth:`_bucket_mask`),
        as one mask over it; the exchange of the selected elements and its **one host read**:
        :class:`MaskedBucket` (the number sent is data-dependent: fewer than k when too few pass the
        lowered thresholds).  The tensors sent whole are first averaged by one allreduce of x / N in
        the gradient's dtype, as feedback.py's dense path does per tensor.  Wire: their n_whole *
        dtype bytes + 8 + K * (value bytes + index bytes), or + 8 + n * value bytes."""
        at = _whole_tensors(b.layout, self.min_numel)
        passed = self._bucket_mask(p, b)
        dense = None
        if at is not None:
            passed.index_fill_(0, at, False)
            values = p.index_select(0, at)
            dense = yield AllReduce((values if b.world_size == 1 else values / b.world_size).to(b.layout.dtype))
        kept = self.__dict__.setdefault("_bucket_kept", {})
        vdtype = self._vdtype or b.layout.dtype
        result = yield from masked_bucket_exchange(p, b, passed, vdtype, kept, self.saturates)
        if dense is not None:
            result.aggregate.index_copy_(0, at, dense.float())
        return result

    def _bucket_mask(self, p, b) -> torch.Tensor:
        """:meth:`select` for every tensor of the bucket at once, as a bool over it (the tensors sent
        whole are left to the caller): each tensor's strided sample of |v| from a start drawn by
        counter per rank, sorted once for the whole bucket (:meth:`_SamplePlan.sorted`); every retry's
        threshold from it (:func:`_retry_thresholds`); the elements passing each of them counted in
        one comparison, and the first threshold passing at least 0.8 k kept (the last one where none
        does); tensors where more than k pass keep their exact top k (one ``topk`` per size class).
        |v| is taken in v's own memory and v's signs given back after (:func:`_in_magnitude`)."""
        layout = b.layout
        plan = _dgc_plan(layout, max(1, round(1 / self.sample_ratio)), self.min_numel,
                         self.density(self._stage(b.epoch, b.step)), self.lower_bound, self.max_retries)
        if plan is None:  # every tensor is sent whole
            return torch.zeros(layout.numel, dtype=torch.bool, device=p.device)
        with _in_magnitude(p) as absp:
            return self._mask_of(absp, b, plan)

    def _mask_of(self, absp, b, plan) -> torch.Tensor:
        """:meth:`_bucket_mask`'s selection, from the bucket's |v|."""
        layout = b.layout
        sample, short = plan.sorted(absp, b.uniforms(len(layout), shared=False, salt="dgc"))
        thresholds = _dgc_thresholds.ahead(sample, short, *plan.rows_short, *plan.rows_full)
        if thresholds is None:
            thresholds = _thresholds(sample, short, plan.ranks_short, plan.ranks_full)
        # each element's tensor (int32, bucket-sized), made where an eager step first needs it: one index
        # spreads every per-tensor quantity below
        segments = functools.cache(layout.segment_index)
        counts = _counts_at_least(absp, thresholds, plan, segments)  # (retries + 1, tensors), a transposed view
        top = None
        if _dgc_selected.wanted(layout.numel, absp):
            top = _class_top_k(absp, layout, plan)
            # the kernel finds each element's tensor itself (segment_of): no index is read or written
            selected = _dgc_selected.ahead(absp, counts.T, thresholds, plan.enough, plan.k, layout.tensor_starts, top)
            if selected is not None:
                return selected
        candidates, too_many = _passing(absp, counts.T, thresholds, plan.enough, plan.k, segments())
        segments.cache_clear()  # before the top k's mask (where not made already): a bucket-sized int32 less at the peak
        return torch.where(too_many, _class_top_k(absp, layout, plan) if top is None else top, candidates)

    def bucket_payload_bytes(self, layout, kept: Optional[int] = None) -> int:
        whole = sum(n for n, shape in zip(layout.numels, layout.shapes) if not _compressed(shape, self.min_numel))
        return whole * layout.dtype.itemsize + super().bucket_payload_bytes(layout, kept)


@contextlib.contextmanager
def _in_magnitude(p: torch.Tensor):
    """|p| written over ``p`` within the block, and p's signs put back after it (bit for bit: -0.0 and
    NaN's sign bits included), where a bucket-sized |p| beside p would be a copy of the bucket more at
    DGC's peak; a bool of the signs is kept meanwhile."""
    negative = torch.signbit(p)
    try:
        yield p.abs_()
    finally:
        p.copysign_(negative.view(torch.int8).neg())  # -1 where the sign was set, +0 where not
        del negative


def _compressed(shape: torch.Size, min_numel: int) -> bool:
    """DGC.compresses: matrices (dim > 1) of at least ``min_numel`` elements."""
    return len(shape) > 1 and shape.numel() >= min_numel


#: Per bucket layout and min_numel: DGC's tensors sent whole (see _whole_tensors).
_WHOLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _whole_tensors(layout, min_numel: int) -> Optional[torch.Tensor]:
    """The int64 positions of the elements of the tensors DGC sends whole (vectors and small tensors:
    a small share of a bucket, kept rather than a bool over all of it), built once per layout; None
    where it compresses every tensor."""
    cached = _WHOLE.setdefault(layout, {})
    if min_numel not in cached:
        runs = [torch.arange(start, start + n) for shape, start, n in zip(layout.shapes, layout.offsets, layout.numels)
                if n and not _compressed(shape, min_numel)]
        cached[min_numel] = torch.cat(runs).to(layout.device) if runs else None
    return cached[min_numel]


#: The smallest positive float32 (a subnormal): a threshold clamped to it never selects a zero.
_TINY = torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps


class _SamplePlan:
    """Every sampled tensor's strided sample of a bucket, as device tensors built once per layout: the
    sample is laid out in *slots*: tensor i (sampled and not empty) owns W_i = ceil(n_i / stride)
    consecutive slots, one per strided position from start 0; a random start moves them all, and the
    last one may then fall past the tensor ("short": a sample of W_i - 1).

    ``slot_tensor``, ``slot_base``, ``slot_last``: per slot, its tensor, its position in the bucket from
    start 0, and its tensor's last position (int32 where the bucket's positions fit, as they do in any
    DDP bucket: twelve bytes a slot, an eighth of a float32 bucket's bytes at DGC's 1% sample; built on
    the host by tensor operations, not lists).  ``span`` (float32) and ``span_max``: per tensor, the starts
    drawn, 0 to span - 1 (span = min(stride, n)).  ``last_slot``: per tensor, its last slot.  ``sampled``:
    whether any tensor is.  ``layout``: the bucket's layout.
    """

    def __init__(self, layout, stride: int, sampled: Sequence[bool]):
        self.layout = layout
        widths = [-(-n // stride) if n and yes else 0 for n, yes in zip(layout.numels, sampled)]
        firsts = [0, *itertools.accumulate(widths)][:-1]
        self._slots = list(zip(firsts, widths))  # per tensor: (first slot, W)
        self.sampled = any(widths)
        counts = torch.tensor(widths, dtype=torch.int64)
        dtype = torch.int32 if layout.numel < 2**31 else torch.int64
        within = torch.arange(sum(widths)) - torch.tensor(firsts, dtype=torch.int64).repeat_interleave(counts)
        per_slot = (lambda values: torch.tensor(values, dtype=torch.int64).repeat_interleave(counts))  # noqa: E731
        self.slot_tensor = torch.arange(len(layout), dtype=dtype).repeat_interleave(counts).to(layout.device)
        self.slot_base = (per_slot(layout.offsets) + within * stride).to(device=layout.device, dtype=dtype)
        self.slot_last = per_slot([o + n - 1 for o, n in zip(layout.offsets, layout.numels)]).to(
            device=layout.device, dtype=dtype)
        spans = [max(1, min(stride, n)) for n in layout.numels]
        self.span, self.span_max = self._device(spans, torch.float32), self._device([s - 1 for s in spans])
        self.last_slot = self._device([first + width - 1 if width else 0 for first, width in self._slots])

    def _device(self, values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.layout.device)

    def rank_slots(self, ranks_of) -> tuple:
        """(full, short): per rank j (rows) and tensor (columns), the slot of the sample's r_j-th largest
        value once sorted (:meth:`sorted`), where ``ranks_of(s)`` gives the list of r_j (from 1) for a
        sample of s values: s = W (full) or W - 1 (short); 0 for a tensor not sampled."""
        full, short = [], []
        for first, width in self._slots:
            for slots, s in ((full, width), (short, max(width - 1, 1))):
                slots.append([first + r - 1 if width else 0 for r in ranks_of(s)])
        return self._device(full).T.contiguous(), self._device(short).T.contiguous()

    def sorted(self, absp: torch.Tensor, uniforms: torch.Tensor, absolute: bool = True) -> tuple:
        """(every sampled tensor's strided sample of ``absp``, sorted in descending order within the
        tensor's slots, a slot past the tensor last (as -1: below every |v|); per tensor whether its
        sample is short), the start of tensor i being floor(uniforms[i] span_i).  One sort by value,
        then a stable one by tensor.  ``absolute=False``: ``absp`` is signed, and its sample is taken
        in magnitude (no bucket-sized |x| needed for it)."""
        args = (absp, uniforms, self.span, self.span_max, self.slot_base, self.slot_tensor, self.slot_last,
                self.last_slot)
        if _sample_keys.wanted(absp.numel(), absp):
            keyed = _sample_keys.ahead(*args, absolute=absolute)
            if keyed is not None:  # one sort by (tensor, value descending): the same order as the two below
                keys, values, short = keyed
                return values.index_select(0, keys.sort(stable=True).indices), short
        values, short = _sample(*args, absolute=absolute)
        values, order = values.sort(descending=True, stable=True)
        by_tensor = self.slot_tensor.index_select(0, order).sort(stable=True).indices
        return values.index_select(0, by_tensor), short


def _sample(absp, uniforms, span, span_max, slot_base, slot_tensor, slot_last, last_slot, absolute):
    """(each slot's value, -1 past its tensor; per tensor whether its last slot is past it: its sample
    is short), as :meth:`_SamplePlan.sorted` takes them, from tensor i's start floor(uniforms[i] span_i)."""
    starts = torch.minimum((uniforms * span).long(), span_max)
    positions = slot_base + starts.index_select(0, slot_tensor)
    outside = positions > slot_last
    values = absp.index_select(0, torch.minimum(positions, slot_last))
    return (values if absolute else values.abs()).masked_fill(outside, -1.0), outside.index_select(0, last_slot)


@kernels.fused(min_numel=1, nonnegative=("uniforms", "span"))  # indices made of their product
def _sample_keys(absp, uniforms, span, span_max, slot_base, slot_tensor, slot_last, last_slot, absolute):
    """:func:`_sample` in one kernel, with a key per slot whose ascending order is its tensor's, then its
    value's descending, as the reference path's two stable sorts leave them: tensor * 2^32 + (2^31 - 1 -
    m), m the value's float32 bits as an int32, which order as the values do (magnitudes, and -1 below
    them), NaN made one NaN (above inf, as a sort puts every NaN; equal among themselves); and per tensor
    whether its sample is short.  Fifteen operations of the reference path become this kernel, a sort and
    a gather."""
    values, short = _sample(absp, uniforms, span, span_max, slot_base, slot_tensor, slot_last, last_slot, absolute)
    v = values.float()
    m = torch.where(v != v, float("nan"), v).view(torch.int32).long()
    keys = slot_tensor.long() * 2**32 + (2**31 - 1 - m)
    return keys, values, short


class _DGCPlan(_SamplePlan):
    """What DGC's bucket selection needs of a layout at one stride, min_numel, density and retry rule,
    as device tensors built once (see :func:`_dgc_plan`): the samples of the compressed tensors
    (:class:`_SamplePlan`), and

    ``ranks_full``, ``ranks_short``: per retry j = 0..R (rows) and tensor (columns), the slot of the
    sample's min(r 2^j, s)-th largest value once sorted, r = ceil(density s), for a sample of s = W
    (full) or W - 1 (short).  ``enough``: per retry and tensor, ceil(lower_bound k) (float64), -inf at
    the last retry (taken when none before passed enough).  ``k``: per tensor, ceil(density n) (float64).
    ``top``: the exact top k, k = ceil(density n), of each size class with a compressed tensor.
    ``true``: a 0-d True to write with.
    """

    def __init__(self, layout, stride: int, min_numel: int, density: float, lower_bound: float, retries: int):
        super().__init__(layout, stride, [_compressed(shape, min_numel) for shape in layout.shapes])
        ks = [math.ceil(density * n) for n in layout.numels]
        self.ranks_full, self.ranks_short = self.rank_slots(
            lambda s: [min(math.ceil(s * density) << j, s) for j in range(retries + 1)])
        # the rows again, each a tensor of its own, for a kernel: a row viewed at an unaligned start
        # would be copied by the GPU kernel at every call
        self.rows_short, self.rows_full = (tuple(row.clone() for row in ranks)
                                           for ranks in (self.ranks_short, self.ranks_full))
        enough = [[float(math.ceil(lower_bound * k))] * retries + [-math.inf] for k in ks]
        self.enough, self.k = self._device(enough, torch.float64).T.contiguous(), self._device(ks, torch.float64)
        self.top = ClassTopK([(size, math.ceil(density * size.numel)) for size in layout.classes
                              if any(_compressed(layout.shapes[i], min_numel) for i in size.members)], layout.device)
        self.true = torch.ones((), dtype=torch.bool, device=layout.device)


#: Per bucket layout: DGC's plans by (stride, min_numel, density, lower_bound, retries), gradient
#: dropping's by ("dropping", stride, drop_ratio), Top-k's and Random-k's size classes by ("top", ratio).
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _ratio_top(layout, ratio: float) -> ClassTopK:
    """Top-k's and Random-k's :class:`ClassTopK`: k = ceil(ratio n) per size class, built once per layout
    and ratio."""
    cached = _PLANS.setdefault(layout, {})
    key = ("top", ratio)
    if key not in cached:
        cached[key] = ClassTopK([(size, math.ceil(ratio * size.numel)) for size in layout.classes], layout.device)
    return cached[key]


def _dropping_plan(layout, stride: int, drop_ratio: float) -> _SamplePlan:
    """Gradient dropping's samples of every non-empty tensor (:class:`_SamplePlan`) and the slots of
    their keep-th largest values, keep = s - floor(R s), full and short (``keep_full``, ``keep_short``:
    one per tensor), built once per layout."""
    cached = _PLANS.setdefault(layout, {})
    key = ("dropping", stride, drop_ratio)
    if key not in cached:
        plan = cached[key] = _SamplePlan(layout, stride, [True] * len(layout))
        full, short = plan.rank_slots(lambda s: [s - math.floor(drop_ratio * s)])
        plan.keep_full, plan.keep_short = full[0], short[0]
    return cached[key]


def _dgc_plan(layout, *key) -> Optional[_DGCPlan]:
    """The layout's :class:`_DGCPlan` for ``key`` = (stride, min_numel, density, lower_bound, retries),
    built once; None where no tensor of it is sampled (every one is sent whole or empty)."""
    cached = _PLANS.setdefault(layout, {})
    if key not in cached:
        cached[key] = _DGCPlan(layout, *key)
    return cached[key] if cached[key].sampled else None


def _retry_thresholds(lower: torch.Tensor) -> torch.Tensor:
    """DGC's threshold at each retry j = 0..R (rows, one column per tensor) from ``lower``, the sample's
    r-th, 2r-th, ..., 2^R r-th largest values: the first is the r-th, and each next one the next of
    those, but never below half the previous threshold, and half of it where the sample goes no lower."""
    rows = lower.unbind(0)
    thresholds = [rows[0]]
    for value in rows[1:]:
        half = thresholds[-1] / 2
        thresholds.append(torch.where(value < thresholds[-1], torch.maximum(value, half), half))
    return torch.stack(thresholds)


def _thresholds(sample, short, ranks_short, ranks_full) -> torch.Tensor:
    """Each retry's threshold (rows) per tensor (columns) from the samples sorted by
    :meth:`_SamplePlan.sorted` and the slots of their ranked values (a short sample's where it is
    short): :func:`_retry_thresholds`, at least the smallest positive float (zeros are never sent)."""
    return _retry_thresholds(sample.take(torch.where(short, ranks_short, ranks_full))).clamp_min_(_TINY)


@kernels.fused(min_numel=1)
def _dgc_thresholds(sample, short, *ranks):
    """:func:`_thresholds` in one kernel (a dozen operations on a few values each, launched one by one),
    each retry's row of ranks short, then each one's full, an argument of its own: their number is
    fixed in the kernel, where every dimension of a tensor is compiled as of any size."""
    retries = len(ranks) // 2
    return _thresholds(sample, short, torch.stack(ranks[:retries]), torch.stack(ranks[retries:]))


def _passing(absp, counts_by_tensor, thresholds, enough, k, index) -> tuple:
    """DGC's selection before its exact top k, as bools over the bucket: (the elements passing their
    tensor's first retry threshold that at least ``enough`` pass, or the last where none does: ``enough``
    is -inf there; whether their tensor has more than k passing it, so that its exact top k is taken
    instead).  ``counts_by_tensor``: how many pass each threshold (tensors, retries + 1); ``index``:
    each element's tensor."""
    counts = counts_by_tensor.T
    first = (counts >= enough).byte().argmax(0, keepdim=True)
    candidates = absp >= thresholds.gather(0, first).view(-1).index_select(0, index)
    too_many = (counts.gather(0, first).view(-1) > k).index_select(0, index)
    return candidates, too_many


@kernels.fused(min_numel=1)
def _dgc_selected(absp, counts_by_tensor, thresholds, enough, k, tensor_starts, top):
    """DGC's selection (:func:`_passing`, the top k where too many pass) in one pass over the bucket:
    neither the candidates nor the tensors with too many written out, and each element's tensor found
    from ``tensor_starts`` (``segment_of``) rather than read from a bucket-sized index."""
    index = segment_of(absp.shape[0], tensor_starts, absp.device)
    candidates, too_many = _passing(absp, counts_by_tensor, thresholds, enough, k, index)
    return torch.where(too_many, top, candidates)


def _counts_at_least(absp: torch.Tensor, thresholds: torch.Tensor, plan: _DGCPlan,
                     segments: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Per threshold (rows) and tensor (columns), how many of the tensor's elements of ``absp`` are >=
    it: every threshold's count per piece of the bucket in one kernel where it is compiled ahead
    (:func:`_dgc_piece_counts`), else row by row (R + 1 of them: a bucket's worth of memory at a time,
    not R + 1), each row spread over the elements by ``segments()`` (:meth:`BucketLayout.segment_index`),
    compared in place (1.0 where the threshold is at most |p|: no bool and no float copy of it) and
    counted per piece; then each tensor's pieces summed (exact either way: at most 2^14 a piece, float64
    over a tensor's pieces, all rows' at once)."""
    layout = plan.layout
    if _dgc_piece_counts.wanted(layout.numel, absp):
        first = _dgc_piece_counts.ahead(absp, *layout.piece_table, thresholds.reshape(-1), width=PIECE,
                                        rows=thresholds.shape[0])
        if first is not None:
            return layout.reduce_pieces(first, total=torch.float64).T
    index = segments()
    return layout.reduce_each((row.index_select(0, index).le_(absp) for row in thresholds), total=torch.float64)


@kernels.fused
def _dgc_piece_counts(absp, start, length, tensor, thresholds, *, width: int, rows: int):
    """Per piece of the bucket (rows: each one's ``start``, ``length`` and ``tensor``) and threshold
    (columns; ``thresholds``: ``rows`` rows of one per tensor, flat, so that their number is fixed in
    the package and no row is a view a GPU kernel would find unaligned), how many of the piece's
    elements of ``absp`` are at least its tensor's threshold: one pass over the bucket for all of them,
    where the reference path spreads and compares each one over the whole bucket.  Counts are exact
    whatever order they add in."""
    tensors = thresholds.shape[0] // rows
    at = torch.arange(width, dtype=torch.int32, device=absp.device)
    inside = at < length.unsqueeze(1)  # (pieces, width)
    values = absp.index_select(0, torch.where(inside, start.unsqueeze(1) + at, 0).view(-1)).view(inside.shape)
    return torch.stack([((thresholds.index_select(0, tensor + r * tensors).unsqueeze(1) <= values) & inside)
                        .sum(dim=1, dtype=torch.int32) for r in range(rows)], dim=1)


def _class_top_k(absp: torch.Tensor, layout, plan: _DGCPlan) -> torch.Tensor:
    """Each compressed tensor's k largest of ``absp`` as a bool over the bucket: one ``topk`` over the
    stacked rows of each size class (with a compressed member; the others' rows are left False)."""
    top = torch.zeros(layout.numel, dtype=torch.bool, device=absp.device)
    return top.index_put_((plan.top(lambda size: layout.rows(absp, size)),), plan.true)



@register
class CSC(SharedSparsifier):
    """Coarse-grained sparse communication (Sun et al. 2019, GradientFlow).

    Split the tensor into chunks of ``chunk_size`` elements (the last one zero-padded); allreduce the
    per-chunk L1 norms; every rank then picks the same kc = ceil(ratio * nchunks) chunks with the largest
    summed norm and allreduces only their values.  Unselected chunks stay in the residual (or, with
    feedback="momentum", in DGC's momentum-corrected velocity).  Wire: 4 * nchunks (fp32 norms) +
    kept * value bytes, where kept = elements of the selected chunks; the padding is not sent.
    """

    name = "csc"
    feedbacks = ("none", "residual", "momentum")

    def __init__(self, ratio: float = 0.01, chunk_size: int = 256, value_dtype: Optional[str] = None,
                 momentum: float = 0.9, nesterov: bool = False, clip_norm: Optional[float] = None,
                 feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio, allow_zero=False)
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)
        self.momentum, self.nesterov, self.clip_norm = _momentum_params(momentum, nesterov, clip_norm)

    def feedback_params(self):
        """The parameters of the momentum correction (feedback.MomentumCorrection) this method builds."""
        return {"momentum": self.momentum, "nesterov": self.nesterov, "clip_norm": self.clip_norm}

    def exchange(self, x, ctx):
        flat = x.reshape(-1).float()
        n, c = flat.numel(), self.chunk_size
        nchunks = -(-n // c)
        norms = yield AllReduce(self.chunk_norms(flat, nchunks, ctx.precomputed))
        # Every rank holds the same summed norms, and the stable sort breaks ties by chunk id, so all
        # ranks pick the same chunks in the same (ascending) order.
        top = largest_first(norms, math.ceil(self.ratio * nchunks))
        idx = (top.unsqueeze(1) * c + torch.arange(c, device=x.device)).reshape(-1)
        return (yield from self.reduce_at(flat, idx[idx < n], ctx))

    def read_while_written(self, ctx):
        # The norms of the whole chunks, from each cached chunk of p = g + e as residual feedback writes
        # it: chunks of chunk_size elements lie whole within its chunks when chunk_size divides them.
        c = self.chunk_size
        if c > _SERIAL_ROW or kernels.CHECK_CHUNK % c:
            return None
        full = ctx.shape.numel() // c
        norms = ctx.precomputed = ctx.buffer("chunk norms", (full,), torch.float32, torch.device("cpu"))
        scratch = workspace("abs", kernels.CHECK_CHUNK, torch.float32, torch.device("cpu")).view(-1, c)

        def observe(p, start, stop):
            rows = (min(stop, full * c) - start) // c
            block = torch.abs(p[start:start + rows * c].view(rows, c), out=scratch[:rows])
            torch.sum(block, dim=1, out=norms[start // c:start // c + rows])

        return observe

    def chunk_norms(self, flat: torch.Tensor, nchunks: int, whole: Optional[torch.Tensor] = None) -> torch.Tensor:
        """L1 norm of every chunk, the last one zero-padded to ``chunk_size`` (``whole``: those of the
        whole chunks, computed already by :meth:`read_while_written`)."""
        n, c = flat.numel(), self.chunk_size
        full = n // c
        if c > _SERIAL_ROW:  # a long single row is summed in parallel pieces: pad it with the rest
            return torch.cat([flat, flat.new_zeros(nchunks * c - n)]).view(nchunks, c).abs().sum(dim=1)
        # Only the last chunk is padded (copying the whole tensor to pad it would cost a pass); each row
        # is summed by the same serial loop, so the norms are those of the padded matrix, bit for bit.
        # |x| is written a block of rows at a time and summed while the block is in the cache.
        norms = whole
        if norms is None:
            rows = max(1, _NORM_BLOCK // c)
            body = flat[: full * c].view(full, c)
            scratch = workspace("abs", min(rows, full) * c, flat.dtype, flat.device).view(-1, c)
            norms = torch.empty(full, dtype=flat.dtype, device=flat.device)
            for start in range(0, full, rows):
                block = torch.abs(body[start : start + rows], out=scratch[: min(rows, full - start)])
                torch.sum(block, dim=1, out=norms[start : start + rows])
        if full < nchunks:
            last = flat.new_zeros(1, c)
            last[0, : n - full * c] = flat[full * c :]
            norms = torch.cat([norms, last.abs().sum(dim=1)])
        return norms

    def payload_bytes(self, ctx, kept=None):
        if kept is None:
            raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")
        return 4 * -(-ctx.shape.numel() // self.chunk_size) + kept * self.values_dtype(ctx).itemsize

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor the chunks of :meth:`exchange`: every chunk norm of the bucket by one segmented
        sum of |p| over its chunk lengths (each tensor's last chunk shorter: the zero-padded one's
        norm), all allreduced at once; one stable descending sort of all the summed norms, then a stable
        one by tensor, puts each tensor's chunks in descending order (ties to the lower chunk, as
        :func:`largest_first`), and its first kc are picked at slots fixed by the layout; the values of the
        picked chunks allreduced as :meth:`reduce_at` does (divided by N before a 16-bit cast).
        Wire: 4 * chunks + kc * chunk_size values per tensor: a picked last chunk's padding is sent as
        zeros (so the size is fixed by the shapes), and dropped by the receivers.  ``sent`` and its
        mask are given dense (the count of real elements sent is data-dependent)."""
        layout, c, n = b.layout, self.chunk_size, b.layout.numel
        vdtype = self._vdtype or layout.dtype
        pre = b.world_size if vdtype.itemsize == 2 else 1
        plan = _chunk_plan(layout, c, self.ratio)
        norms = yield AllReduce(layout.chunk_reduce(p.abs(), "sum", c))
        order = norms.sort(descending=True, stable=True).indices
        by_tensor = plan.chunk_tensor.index_select(0, order).sort(stable=True).indices
        top = order.index_select(0, by_tensor.index_select(0, plan.kept_slots))  # each tensor's first kc
        at = plan.starts.index_select(0, top).view(-1, 1) + plan.lanes
        at = torch.where(plan.lanes < plan.lengths.index_select(0, top).view(-1, 1), at, n).view(-1)  # padding: n
        values = torch.cat([p, p.new_zeros(1)]).index_select(0, at)  # the padding's values are zero
        payload = wire_cast(_times(values, 1 / pre), vdtype, self.saturates, summed=pre)
        total = yield AllReduce(payload)
        aggregate = torch.zeros(n + 1, dtype=torch.float32, device=p.device)
        aggregate.index_put_((at,), _times(total.float(), pre / b.world_size))
        sent = _times(payload.float(), pre)
        return Exchanged(aggregate[:n], lambda: torch.zeros(n + 1, device=p.device).index_put_((at,), sent)[:n],
                         lambda: torch.zeros(n + 1, dtype=torch.bool, device=p.device).index_fill_(0, at, True)[:n])

    def bucket_payload_bytes(self, layout):
        chunks = [-(-n // self.chunk_size) for n in layout.numels]
        kept = sum(math.ceil(self.ratio * k) * self.chunk_size for k in chunks)
        return 4 * sum(chunks) + kept * (self._vdtype or layout.dtype).itemsize


#: Per bucket layout: CSC's chunk plans by (chunk size, ratio) (see _chunk_plan).
_CHUNK_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _ChunkPlan:
    """CSC's chunks of a bucket (:meth:`BucketLayout.chunk_offsets`), as device tensors built once:
    per chunk its tensor (``chunk_tensor``), start and length; ``kept_slots``: once the chunks are
    grouped by tensor, each group in descending order of norm, the slots of each tensor's first
    ceil(ratio * chunks); ``lanes``: 0 .. c - 1."""

    def __init__(self, layout, c: int, ratio: float):
        device = layout.device
        offsets = layout.chunk_offsets(c)
        self.starts, self.lengths = offsets[:-1], offsets.diff()
        tensors, slots = [], []
        for i, n in enumerate(layout.numels):
            chunks = -(-n // c)
            slots += range(len(tensors), len(tensors) + math.ceil(ratio * chunks))
            tensors += [i] * chunks
        self.chunk_tensor = torch.tensor(tensors, dtype=torch.int64, device=device)
        self.kept_slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.lanes = torch.arange(c, device=device)


def _chunk_plan(layout, c: int, ratio: float) -> _ChunkPlan:
    cached = _CHUNK_PLANS.setdefault(layout, {})
    if (c, ratio) not in cached:
        cached[(c, ratio)] = _ChunkPlan(layout, c, ratio)
    return cached[(c, ratio)]


def _signed_counts(p: torch.Tensor, layout) -> torch.Tensor:
    """Per tensor of the bucket, |{p_i > 0}| and |{p_i < 0}| (2, tensors), float64: each comparison
    written as 1.0 / 0.0 into one float32 buffer (the second once the first is summed by pieces) and
    summed by :meth:`BucketLayout.reduce_each` (exact: float32 within a piece, float64 over a tensor's
    pieces)."""
    marked = torch.empty_like(p, dtype=torch.float32)
    return layout.reduce_each((compare(p, 0, out=marked) for compare in (torch.gt, torch.lt)), total=torch.float64)


class _AdaptivePlan:
    """What adaptive threshold's bucket route needs of a layout, built once: ``class_order`` and
    ``class_offsets``, the tensors grouped by size class (for each class's peaks by one segmented max);
    per class ``both_sides``, its members' places among (k+ of every tensor, then k-), and
    ``both_starts``, their starts in the bucket then those plus n (P's marks, then M's, in one flat
    mask); ``all_sides``, every class's ``both_sides`` end to end, and ``class_rows``, each class's
    (start, stop) in it; ``ends``, where each tensor but the last ends (int64: a position's tensor is how
    many end at or before it, the padding position n the last tensor's); ``zero``, a float32 0."""

    def __init__(self, layout):
        device, members = layout.device, [size.members for size in layout.classes]
        order = [i for m in members for i in m]
        self.class_order = torch.tensor(order, dtype=torch.int64, device=device)
        self.class_offsets = torch.tensor([0, *itertools.accumulate(len(m) for m in members)], dtype=torch.int64,
                                          device=device)
        self.both_sides = [torch.tensor([*m, *(i + len(layout) for i in m)], dtype=torch.int64, device=device)
                           for m in members]
        self.both_starts = [torch.cat([size.starts, size.starts + layout.numel]).view(-1, 1) for size in layout.classes]
        self.all_sides = torch.cat(self.both_sides) if members else torch.empty(0, dtype=torch.int64, device=device)
        bounds = list(itertools.accumulate((2 * len(m) for m in members), initial=0))
        self.class_rows = list(zip(bounds, bounds[1:]))
        self.ends = torch.tensor([o + n for o, n in zip(layout.offsets, layout.numels)][:-1], dtype=torch.int64,
                                 device=device)
        self.zero = torch.zeros((), device=device)


#: Per bucket layout: adaptive threshold's plan (see _AdaptivePlan).
_ADAPTIVE_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _adaptive_plan(layout) -> _AdaptivePlan:
    plan = _ADAPTIVE_PLANS.get(layout)
    if plan is None:
        plan = _ADAPTIVE_PLANS[layout] = _AdaptivePlan(layout)
    return plan


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _signs_counted(flat):
    """|{x_i > 0}| and |{x_i < 0}| in one read of x (a comparison and a count each cost about a pass)."""
    return torch.stack([(flat > 0).sum(), (flat < 0).sum()])


@register
class AdaptiveThreshold(Compressor):
    """Adaptive quantization (Dryden, Moon, Jacobs & Van Essen 2016, "Communication Quantization for
    Data-Parallel Training of Deep Neural Networks", MLHPC): per tensor, keep the fraction ``ratio`` of
    the positive values (the largest) and the same fraction of the negative ones (the most negative),
    and send each kept set's indices with one value, the set's mean:

        P = the ceil(ratio * |{x_i > 0}|) largest positive x_i,   mu+ = mean_{i in P} x_i
        M = the ceil(ratio * |{x_i < 0}|) most negative x_i,      mu- = mean_{i in M} x_i
        D(C(x))_i = mu+ (i in P),  mu- (i in M),  0 elsewhere

    Residual error feedback (the default) keeps x - D(C(x)).  Workers choose different positions, so the
    fields are allgathered and scatter-added in rank order.  Wire: 8 + (|P| + |M|) * index bytes (the two
    means in fp32), allgathered with a size header.
    """

    name = "adaptive_threshold"
    default_feedback = "residual"

    def __init__(self, ratio: float = 0.01, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.ratio = check_ratio("ratio", ratio)

    def _side(self, flat: torch.Tensor, sign: float, count: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of the kept values of one sign (unique int64) and their mean (fp32, 0 when none);
        ``count``: how many values have that sign, if known.

        k = ceil(ratio * |P|) is at most |P|, so the k largest values of all are positive: they are the
        k largest positive ones, found by :func:`top_k` over the whole tensor (which samples a threshold)
        rather than by a topk over the positions of every positive value."""
        if count is None:  # -x > 0 is x < 0
            count = count_true(compare("gt" if sign > 0 else "lt", flat, 0,
                                       workspace("mask", flat.numel(), torch.bool, flat.device)))
        k = math.ceil(self.ratio * count)
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=flat.device), flat.new_zeros(())
        idx = top_k(flat, k, negated=sign < 0)
        return idx, flat.index_select(0, idx).mean()  # flat[idx]: three times as long on CPUs

    def exchange(self, x, ctx):
        flat = x.reshape(-1).float()
        counts = _signs_counted(flat) if kernels.enabled(flat.numel()) else None
        positives, negatives = (None, None) if counts is None else counts.tolist()
        pos, mu_pos = self._side(flat, 1.0, positives)
        neg, mu_neg = self._side(flat, -1.0, negatives)
        itype = index_dtype(flat.numel())
        means = torch.stack([mu_pos, mu_neg])
        gathered = yield AllGather((means, pos.to(itype), neg.to(itype)), same_size=False)
        total = zeroed(ctx.buffer("aggregate", (flat.numel(),), torch.float32, x.device))
        for m, p, q in gathered:  # rank order: identical float sums on every rank
            total.index_add_(0, p.long(), m[0].expand(p.numel()))
            total.index_add_(0, q.long(), m[1].expand(q.numel()))
        total.div_(ctx.world_size)
        idx = torch.cat([pos, neg])
        values = torch.cat([mu_pos.expand(pos.numel()), mu_neg.expand(neg.numel())])
        return Exchanged(total.view(ctx.shape), sparse=(idx, values))

    def payload_bytes(self, ctx, kept=None):
        if kept is None:
            raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")
        return 8 + kept * index_dtype(ctx.shape.numel()).itemsize

    bucketed = True

    def bucket_exchange(self, p, b):
        """Per tensor P, M, mu+ and mu- as in :meth:`exchange`, size class by size class: each row's
        counts of positive and negative values give its k+ and k-; after the count allreduce, **the
        bucket's one host read** takes the largest per-rank totals K+ and K- over the ranks, this rank's
        own totals and each size class's largest k+ and k-, which size one sorted topk per class and
        sign (its first k of each row are kept; the means are sums over them, so equal to the
        per-tensor route's up to the order of those sums).  Wire: 16 bytes (the totals) + 8 per tensor
        (mu+, mu-) + (K+ + K-) positions in the bucket, P's then M's, each side this rank's own first,
        padded with position n (dropped by the receivers); a position decodes to its side's mean of the
        tensor it lies in."""
        layout, n = b.layout, b.layout.numel
        plan = _adaptive_plan(layout)
        ks = torch.ceil(_signed_counts(p, layout).mul_(self.ratio),  # (2, tensors): k+ and k-, exact in float64
                        out=torch.empty(2, len(layout), dtype=torch.float64, device=p.device))  # contiguous rows
        own = ks.sum(dim=1)
        most = yield AllReduce(own, op="max")
        peaks = torch.segment_reduce(ks.T.index_select(0, plan.class_order), "max", offsets=plan.class_offsets,
                                     unsafe=True, initial=0.0)  # per class (k+ max, k- max)
        read = [int(v) for v in torch.cat([most, own, peaks.view(-1)]).tolist()]  # the bucket's one host read
        self.__dict__.setdefault("_bucket_kept", {})[layout.keys] = read[0] + read[1]
        means, marks = self._bucket_sides(p, layout, ks, read[4:], plan)
        itype = index_dtype(n + 1)
        sides = [torch.nonzero_static(mark, size=size, fill_value=n).view(-1) for mark, size in zip(marks, read[:2])]
        gathered = yield AllGather((means, torch.cat(sides).to(itype)))  # P's positions, then M's
        total = torch.zeros(n + 1, dtype=torch.float32, device=p.device)
        plus, tensors = read[0], len(layout)
        values = None  # this rank's own, as decoded from what it sent
        for rank, (mu, at) in enumerate(gathered):  # rank order: identical float sums on every rank
            at = as_index(at)
            # Each position's tensor (padding, n: the last), then its side's mean: mu- of tensor i is
            # mu[T + i].  P and M are disjoint, so one sum of both is exchange()'s two in turn.
            tensor = torch.searchsorted(plan.ends, at, right=True)
            tensor[plus:].add_(tensors)
            decoded = mu.index_select(0, tensor)
            total.index_add_(0, at, decoded)
            if rank == b.rank:
                values = torch.cat([decoded[:read[2]], decoded[plus:plus + read[3]]])
        own_at = torch.cat([side[:count] for side, count in zip(sides, read[2:4])])
        return Exchanged(total[:n].div_(b.world_size), sparse=(own_at, values))

    def _bucket_sides(self, p, layout, ks, peaks, plan):
        """(means: mu+ of every tensor then mu- of every tensor, fp32; the bool masks of P and M over
        the bucket), from k (2, tensors) and each size class's peaks [k+ max, k- max, ...]: per class
        its rows' largest and smallest values (each topk as long as the larger peak, sorted: the first
        k of each row are kept), both sides' sums, means and marks at once (rows + then rows -).  Every
        class's block of values, positions and kept flags lies in one flat buffer of each, so that what
        follows the topks is one operation for all classes, or one per class writing into its place."""
        means = torch.zeros(2 * len(layout), dtype=torch.float32, device=p.device)
        marks = torch.zeros(2 * layout.numel, dtype=torch.bool, device=p.device)  # P's, then M's
        blocks, at = [], 0  # per class with a peak: (class, its block's start in the flat buffers, peak)
        for c, size in enumerate(layout.classes):
            peak = max(peaks[2 * c], peaks[2 * c + 1])
            if peak:
                blocks.append((c, at, peak))
                at += 2 * len(size.members) * peak
        if not blocks:
            return means, marks.view(2, -1)
        k_rows = ks.view(-1).index_select(0, plan.all_sides)  # every class's rows' k, one gather for all
        values = torch.empty(at, dtype=p.dtype, device=p.device)
        positions = torch.empty(at, dtype=torch.int64, device=p.device)
        kept = torch.empty(at, dtype=torch.bool, device=p.device)
        views = []
        for c, start, peak in blocks:
            size, (lo, hi) = layout.classes[c], plan.class_rows[c]
            r, m, block = layout.rows(p, size), len(size.members), slice(start, start + 2 * len(size.members) * peak)
            v, a = values[block].view(2 * m, peak), positions[block].view(2 * m, peak)
            # the largest then the smallest of each row, written where the two sides' rows lie
            torch.topk(r, peak, dim=1, out=(v[:m], a[:m]))
            torch.topk(r, peak, dim=1, largest=False, out=(v[m:], a[m:]))
            torch.lt(_counting(peak, p.device), k_rows[lo:hi].view(-1, 1), out=kept[block].view(2 * m, peak))
            a.add_(plan.both_starts[c])
            views.append((v, lo, hi))
        torch.where(kept, values, plan.zero, out=values)  # what no side keeps adds nothing to a sum
        # a class without a peak keeps nothing: its rows' sums are 0 (and so their means)
        sums = (torch.empty if len(blocks) == len(layout.classes) else torch.zeros)(
            len(plan.all_sides), dtype=torch.float32, device=p.device)
        for v, lo, hi in views:
            torch.sum(v, dim=1, out=sums[lo:hi])
        means.index_copy_(0, plan.all_sides, sums.div_(k_rows.clamp(min=1)))  # k is float64: each quotient rounded once
        marks.index_put_((positions,), kept)
        return means, marks.view(2, -1)

    def bucket_payload_bytes(self, layout, kept: Optional[int] = None):
        """Bytes sent for K+ + K- = ``kept`` positions (None: those of this bucket's last exchange)."""
        if kept is None:
            kept = self.__dict__.get("_bucket_kept", {}).get(layout.keys)
            if kept is None:
                raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")
        return 16 + 8 * len(layout) + kept * index_dtype(layout.numel + 1).itemsize


@functools.lru_cache(maxsize=64)
def _counting(n: int, device: torch.device) -> torch.Tensor:
    """0, 1, ..., n - 1 (int64) on ``device``, made once per length (read only)."""
    return torch.arange(n, device=device)
