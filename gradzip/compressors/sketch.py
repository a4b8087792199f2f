"""Count sketches: a fixed-size linear summary of the gradient, summed by one allreduce."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .base import AllReduce, Compressor, Exchanged, TensorContext, check_ratio, workspace, zeroed
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


@register
class Sketch(Compressor):
    """Count sketch with heavy-hitter recovery (Ivkin, Rothchild, Ullah, Braverman, Stoica & Arora,
    NeurIPS 2019, "Communication-efficient distributed SGD with sketching"; Rothchild et al., ICML 2020,
    FetchSGD).

    With R = ``rows`` hash rows of C = ceil(``width`` * k) buckets, k = ceil(ratio * n), bucket hashes
    h_j(i) in [0, C) and signs s_j(i) in {-1, +1} drawn from a generator shared by every rank (same
    seed, tensor and step, so the ranks' sketches are of one linear map S):

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
    coordinates.  Memory: the hashes, signs and signed values take 16 * R bytes per element (on a CPU
    kept from one step to the next, as other methods' buffers).  Wire: two allreduces, R * C * 4 + k * 4
    bytes (fp32).  Tensors whose sketch would not be smaller than themselves (R * C >= n) are averaged
    densely and keep no residual.
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
        gen = ctx.generator(x.device, shared=True, salt="sketch")
        # The (rows, n) tables live in buffers reused across steps; signs are drawn as float32 directly
        # (the same values and generator state as int64 draws).
        shape = (self.rows, n)
        buckets = torch.randint(cols, shape, generator=gen, out=ctx.buffer("buckets", shape, torch.int64, x.device))
        signs = torch.randint(2, shape, generator=gen, out=ctx.buffer("signs", shape, torch.float32, x.device))
        signs.mul_(2).sub_(1)
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
