"""Count sketches: a fixed-size linear summary of the gradient, summed by one allreduce."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .base import AllReduce, Compressor, Exchanged, TensorContext, check_ratio
from .registry import register


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
    coordinates.  Wire: two allreduces, R * C * 4 + k * 4 bytes (fp32).  Tensors whose sketch would not
    be smaller than themselves (R * C >= n) are averaged densely and keep no residual.
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
        buckets = torch.randint(cols, (self.rows, n), generator=gen, device=x.device)
        signs = torch.randint(2, (self.rows, n), generator=gen, device=x.device).float().mul_(2).sub_(1)
        sketch = torch.zeros(self.rows, cols, dtype=torch.float32, device=x.device)
        sketch.scatter_add_(1, buckets, signs * flat)
        total = yield AllReduce(sketch)
        estimate = (signs * total.gather(1, buckets)).median(dim=0).values
        idx = torch.topk(estimate.abs(), k, sorted=False).indices
        mine = flat[idx]
        values = yield AllReduce(mine)
        aggregate = ctx.buffer("aggregate", (n,), torch.float32, x.device).zero_()
        aggregate[idx] = values / ctx.world_size
        return Exchanged(aggregate.view(ctx.shape), sparse=(idx, mine))

    def payload_bytes(self, ctx, kept=None):
        if not self.compresses(ctx):  # sent densely by feedback.py, in the gradient's dtype
            return ctx.shape.numel() * ctx.dtype.itemsize
        k, cols = self.sizes(ctx)
        return (self.rows * cols + k) * 4
