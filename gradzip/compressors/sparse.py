"""Sparsification: send a few (value, index) pairs instead of the whole gradient.

Workers pick different positions, so the pairs are allgathered and scatter-added (Top-k, Threshold,
Gradient dropping, DGC).  Random-k and CSC pick the *same* positions on every rank, so they allreduce the
values alone and send no indices.  Indices use the smallest integer dtype that addresses the tensor
(uint8 / int16 / int32); values use ``value_dtype`` (default: the gradient's own dtype).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..bits import index_dtype
from . import register
from .base import AllGather, AllReduce, Compressor, Exchanged, GatheredCompressor, TensorContext, check_ratio
from .base import value_dtype as _parse_value_dtype


class Sparsifier(GatheredCompressor):
    """Shared machinery: subclasses only say which positions to send (:meth:`select`)."""

    default_feedback = "residual"

    def __init__(self, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(feedback)
        self.value_dtype = value_dtype
        self._vdtype = _parse_value_dtype(value_dtype)

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


# -- parameter checks and selection helpers ---------------------------------------------------------------


def _check_number(name: str, value, ok, allowed: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return float(value)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _momentum_params(momentum, nesterov, clip_norm) -> tuple:
    """Validate the parameters feedback.py's momentum correction reads (DGC Sec. 3.2-3.3)."""
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


def _at_least(a: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    # Zeros are never worth sending: a zero threshold (sparse gradients, e.g. embeddings) must not
    # select the whole tensor.
    return ((a >= threshold) & (a > 0)).nonzero().reshape(-1)


# -- sparsifiers with positions shared by all ranks: values are allreduced ------------------------------


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
        # A 16-bit sum could overflow: divide by N before the cast, as the fp16 baseline does.
        pre = ctx.world_size if vdtype.itemsize == 2 else 1
        payload = (flat[idx] * (scale / pre)).to(vdtype)
        total = yield AllReduce(payload)
        aggregate = torch.zeros(flat.numel(), dtype=torch.float32, device=x.device)
        sent = torch.zeros_like(aggregate)
        mask = torch.zeros(flat.numel(), dtype=torch.bool, device=x.device)
        aggregate[idx] = total.float() * (pre / ctx.world_size)
        sent[idx] = payload.float() * pre
        mask[idx] = True
        return Exchanged(aggregate.view(ctx.shape), sent.view(ctx.shape), mask.view(ctx.shape))


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
        gen = ctx.generator(x.device, shared=True)
        idx = torch.randperm(n, generator=gen, device=x.device)[:k]
        scale = n / k if self.unbiased and k else 1.0
        return (yield from self.reduce_at(x, idx, ctx, scale))

    def payload_bytes(self, ctx, kept=None):
        return (self.kept(ctx) if kept is None else kept) * self.values_dtype(ctx).itemsize


# -- allgathered sparsifiers with data-dependent sizes ---------------------------------------------------


@register
class Threshold(Sparsifier):
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
        return (flat.abs() > self.tau).nonzero().reshape(-1)


@register
class GradientDropping(Sparsifier):
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
        a = flat.abs()
        if a.numel() == 0:
            return torch.empty(0, dtype=torch.long, device=a.device)
        sample = strided_sample(a, self.sample_ratio, ctx)
        # s - floor(R s) rather than ceil((1 - R) s): 1 - 0.99 is 0.0100000000000000089, one too many.
        keep = sample.numel() - math.floor(self.drop_ratio * sample.numel())
        return _at_least(a, _kth_largest(sample, keep))


@register
class DGC(Sparsifier):
    """Deep Gradient Compression (Lin et al., ICLR 2018) with all four techniques.

    feedback="momentum" (feedback.py) does momentum correction u = m u + g, v = v + u (Nesterov:
    u = (u + g) m, v = v + u + g), local clipping of g to ``clip_norm`` * N^-1/2, and momentum factor
    masking (u = v = 0 where sent).  This class selects: about k = ceil(density * n) of the largest |v|,
    with the warm-up density(e) = 0.25 (ratio / 0.25)^(e / warmup_epochs) for epoch e < warmup_epochs
    (75% ... 99.9% sparsity at the defaults), ``ratio`` afterwards.

    Selection: the threshold is the top-density quantile of a strided sample of |v|; if fewer than 0.8k
    pass it is halved (at most ``max_retries`` times); if more than k pass, an exact top-k runs over the
    candidates only (hierarchical top-k), so the k *largest* are kept (the reference code truncates by
    index order) and never more than k are sent.  Only tensors with dim > 1 and at least ``min_numel``
    elements are compressed; the others go dense.  Wire: kept * (value bytes + index bytes), allgathered
    with a size header (6 B per element with value_dtype="float16" and int32 indices).
    """

    name = "dgc"
    default_feedback = "momentum"
    feedbacks = ("none", "residual", "momentum")
    same_size = False
    deterministic = False
    #: Accept the candidates as they are when at least this fraction of k pass.
    lower_bound = 0.8
    #: How often the threshold is halved when too few pass.
    max_retries = 3

    def __init__(self, ratio: float = 0.001, momentum: float = 0.9, nesterov: bool = False,
                 clip_norm: Optional[float] = None, warmup_epochs: int = 4, sample_ratio: float = 0.01,
                 min_numel: int = 1024, value_dtype: Optional[str] = None, feedback: Optional[str] = None):
        super().__init__(value_dtype, feedback)
        self.ratio = check_ratio("ratio", ratio, allow_zero=False)
        self.momentum, self.nesterov, self.clip_norm = _momentum_params(momentum, nesterov, clip_norm)
        self.warmup_epochs = _check_int("warmup_epochs", warmup_epochs, 0)
        self.sample_ratio = check_ratio("sample_ratio", sample_ratio, allow_zero=False)
        self.min_numel = _check_int("min_numel", min_numel, 0)

    def density(self, epoch: int) -> float:
        """Fraction of elements sent in ``epoch``: the paper's exponential warm-up (Sec. 3.4), density
        25%, 6.25%, 1.5625%, 0.39% (4x sparser each epoch, never below ``ratio``), then ``ratio``."""
        if epoch >= self.warmup_epochs:
            return self.ratio
        return max(self.ratio, 0.25 ** (max(epoch, 0) + 1))

    def compresses(self, ctx):
        # Biases and normalisation weights are a tiny share of the bytes: the paper sends them dense.
        return len(ctx.shape) > 1 and ctx.shape.numel() >= self.min_numel

    def sample(self, a: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """The sample of |v| the threshold is estimated from (0.1%-1% of it in the paper)."""
        return strided_sample(a, self.sample_ratio, ctx)

    def select(self, flat, ctx):
        a = flat.abs()
        density = self.density(ctx.epoch)
        k = math.ceil(density * a.numel())
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=a.device)
        sample = self.sample(a, ctx)
        threshold = _kth_largest(sample, math.ceil(density * sample.numel()))
        chosen = _at_least(a, threshold)
        for _ in range(self.max_retries):
            if chosen.numel() >= self.lower_bound * k:
                break
            threshold = threshold / 2
            chosen = _at_least(a, threshold)
        if chosen.numel() > k:
            # Hierarchical top-k: exact, but over the candidates only.
            chosen = chosen[torch.topk(a[chosen], k, sorted=False).indices]
        return chosen

    def payload_bytes(self, ctx, kept=None):
        if not self.compresses(ctx):
            return ctx.shape.numel() * ctx.dtype.itemsize  # feedback.py's dense path
        return super().payload_bytes(ctx, kept)



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

    def exchange(self, x, ctx):
        flat = x.reshape(-1).float()
        n, c = flat.numel(), self.chunk_size
        nchunks = -(-n // c)
        chunks = torch.cat([flat, flat.new_zeros(nchunks * c - n)]).view(nchunks, c)
        norms = yield AllReduce(chunks.abs().sum(dim=1))
        # Every rank holds the same summed norms, and the stable sort breaks ties by chunk id, so all
        # ranks pick the same chunks in the same (ascending) order.
        kc = math.ceil(self.ratio * nchunks)
        top = torch.sort(norms, descending=True, stable=True).indices[:kc].sort().values
        idx = (top.unsqueeze(1) * c + torch.arange(c, device=x.device)).reshape(-1)
        return (yield from self.reduce_at(flat, idx[idx < n], ctx))

    def payload_bytes(self, ctx, kept=None):
        if kept is None:
            raise ValueError(f"{self.name} sends a data-dependent number of elements; pass kept=")
        return 4 * -(-ctx.shape.numel() // self.chunk_size) + kept * self.values_dtype(ctx).itemsize
