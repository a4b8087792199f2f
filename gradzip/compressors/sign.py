"""Sign methods: one bit per element, packed eight per byte.

Bit convention (all four methods): bit = 1 where x >= 0, so sign(0) (and sign(-0.0)) is taken as +1;
one bit cannot carry a third "zero" symbol.  NaN compares false and becomes -1 (non-finite steps are
discarded by GradzipState anyway).  Bits are packed with :func:`gradzip.bits.pack_bits` (little-endian
inside a byte), so n elements cost ceil(n / 8) bytes (GRACE spends a whole byte per sign).

All payloads are allgathered: sign bits are not summable.  Every rank decodes the gathered payloads in
rank order, so all ranks compute bit-identical aggregates.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..bits import pack_bits, packed_nbytes, select, unpack_bits
from . import register
from .base import AllGather, Exchanged, GatheredCompressor, TensorContext, workspace


def encode_signs(x: torch.Tensor) -> torch.Tensor:
    """Packed sign bits of ``x`` (bit 1 for x >= 0), ceil(numel / 8) uint8 bytes."""
    flat = x.reshape(-1)
    return pack_bits(torch.ge(flat, 0, out=workspace("signs", flat.numel(), torch.bool, flat.device)), 1)


def decode_signs(packed: torch.Tensor, shape) -> torch.Tensor:
    """Inverse of :func:`encode_signs`: +1.0 / -1.0 as float32 with ``shape``."""
    bits = unpack_bits(packed, 1, math.prod(shape))
    # 2b - 1 in int8 (exact), then one conversion: the same values as float(b) * 2 - 1.
    return bits.view(torch.int8).mul_(2).sub_(1).float().reshape(shape)


def majority_vote(signs: list) -> torch.Tensor:
    """sign(sum_r s_r) of +-1 tensors; a tie (even world size) gives 0.

    The sum of +-1 values is an exact integer in float32, so every rank gets the same vote.
    """
    total = signs[0].clone()
    for s in signs[1:]:
        total += s
    return total.sign_()


def vote_of_bits(gathered: list, shape) -> torch.Tensor:
    """:func:`majority_vote` of the ranks' packed sign bits, counted as integers: with c the number of
    +1 votes among N, sum_r s_r = 2c - N exactly, so sign(2c - N) is the same vote."""
    n, world = math.prod(shape), len(gathered)
    count = workspace("votes", n, torch.int16 if world < 2**14 else torch.int32, gathered[0][0].device)
    count.copy_(unpack_bits(gathered[0][0], 1, n))
    for (packed,) in gathered[1:]:
        count += unpack_bits(packed, 1, n)
    return count.mul_(2).sub_(world).sign_().float().reshape(shape)


def _bits_bytes(ctx: TensorContext) -> int:
    return packed_nbytes(ctx.shape.numel(), 1)


@register
class OneBit(GatheredCompressor):
    """1-bit SGD (Seide et al., Interspeech 2014, "1-bit stochastic gradient descent and its application
    to data-parallel distributed training of speech DNNs").

    View x as a matrix M of shape (shape[0], prod(shape[1:])) (1-D: n x 1, 0-d: 1 x 1).  Quantise at 0;
    per column j send two reconstruction values, a_j = mean{M_ij : M_ij >= 0} and
    b_j = mean{M_ij : M_ij < 0} (0.0 for an empty group), and decode M_ij = a_j if bit else b_j.  The
    column sums are preserved (up to rounding); the paper needs error feedback (default ``residual``) because
    without it training diverges.  Wire: fp32 [a_1..a_m, b_1..b_m] + bits = 8 m + ceil(n / 8) bytes,
    allgathered; the aggregate is the mean of the decoded tensors.
    """

    name = "onebit"
    default_feedback = "residual"

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    @staticmethod
    def matrix_shape(shape) -> tuple:
        # prod(shape[1:]) rather than numel / shape[0]: defined for shape[0] == 0 too.
        return (shape[0] if len(shape) else 1, math.prod(shape[1:]))

    def compress(self, x, ctx):
        M = x.reshape(self.matrix_shape(ctx.shape))
        rows, numel = M.shape[0], M.numel()
        zero = torch.zeros((), dtype=M.dtype, device=M.device)
        # A selection, not M * group: inf * 0 would turn a finite mean into NaN.  The column sums must add
        # in the order of M's own layout (as torch.where's outputs would), so reused (contiguous) buffers
        # are for contiguous M only.
        if M.dtype == torch.float32 and M.is_contiguous():
            pos = torch.ge(M, 0, out=workspace("onebit.pos", numel, torch.bool, M.device).view(M.shape))
            buffers = {"out": workspace("onebit.picked", numel, torch.float32, M.device).view(M.shape),
                       "scratch": workspace("onebit.mask", numel, torch.int32, M.device).view(M.shape)}
            pos_total = select(pos, M, zero, **buffers).sum(dim=0)
            neg_total = select(pos, zero, M, **buffers).sum(dim=0)
        elif M.dtype == torch.float32:
            pos = M >= 0
            pos_total, neg_total = select(pos, M, zero).sum(dim=0), select(pos, zero, M).sum(dim=0)
        else:
            pos = M >= 0
            pos_total, neg_total = torch.where(pos, M, zero).sum(dim=0), torch.where(pos, zero, M).sum(dim=0)
        pos_count = pos.sum(dim=0)
        means = torch.cat([pos_total / pos_count.clamp(min=1), neg_total / (rows - pos_count).clamp(min=1)]).float()
        return means, pack_bits(pos, 1)

    def decompress(self, fields, ctx):
        means, packed = fields
        pos_mean, neg_mean = means.view(2, -1)
        shape = self.matrix_shape(ctx.shape)
        numel = math.prod(shape)
        bits = unpack_bits(packed, 1, numel).view(torch.bool).view(shape)
        scratch = workspace("onebit.mask", numel, torch.int32, bits.device).view(shape)
        return select(bits, pos_mean, neg_mean, scratch=scratch).reshape(ctx.shape)

    def payload_bytes(self, ctx, kept=None):
        return 8 * self.matrix_shape(ctx.shape)[1] + _bits_bytes(ctx)


class _SignVote(GatheredCompressor):
    """signSGD's protocol: allgather packed sign bits, aggregate by majority vote."""

    def signs_of(self, x: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        """The tensor whose signs are sent (the input for signSGD, the momentum for Signum)."""
        return x

    def compress(self, x, ctx):
        return (encode_signs(self.signs_of(x, ctx)),)

    def decompress(self, fields, ctx):
        return decode_signs(fields[0], ctx.shape)

    def combine(self, decoded, ctx):
        return majority_vote(decoded)

    def exchange(self, x, ctx):
        # Vote on the bits directly; decode this rank's own signs only if error feedback asks for them.
        fields = self.compress(x, ctx)
        gathered = yield AllGather(tuple(fields), same_size=True)
        return Exchanged(vote_of_bits(gathered, ctx.shape), lambda: self.decompress(gathered[ctx.rank], ctx))

    def payload_bytes(self, ctx, kept=None):
        return _bits_bytes(ctx)


@register
class SignSGD(_SignVote):
    """signSGD with majority vote (Bernstein et al., ICML 2018, "signSGD: compressed optimisation for
    non-convex problems").

    Each worker sends sign(x); the aggregate is sign(sum_r sign(x_r)) (ties give 0).  The aggregate is
    +-1 per element, so the learning rate is the step length.  Residual feedback is accepted but
    mis-scaled (it keeps p - sign(p)); use ``efsignsgd`` for error feedback.  Wire: ceil(n / 8) bytes, allgathered.
    """

    name = "signsgd"

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)


@register
class Signum(_SignVote):
    """Signum with majority vote (Bernstein et al., ICML 2018, as ``signsgd``, on the momentum).

    m = beta * m + (1 - beta) * x, kept per tensor (staged in ``ctx``, committed only when the exchange
    succeeded); each worker sends sign(m); aggregate sign(sum_r sign(m_r)), ties 0.  The momentum lives
    here, so the optimizer should use none of its own.  Wire: ceil(n / 8) bytes, allgathered.
    """

    name = "signum"
    state_key = "signum_momentum"  # distinct from feedback.py's "momentum"

    def __init__(self, beta: float = 0.9, feedback: Optional[str] = None):
        super().__init__(feedback)
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
            raise ValueError(f"beta must be a number with 0 <= beta < 1, got {beta!r}")
        self.beta = float(beta)

    def signs_of(self, x, ctx):
        m = ctx.get(self.state_key)
        if m is None:
            m = (1 - self.beta) * x
        else:  # beta * m + (1 - beta) * x, rounded as written
            step = torch.mul(x, 1 - self.beta, out=workspace("signum", x.numel(), x.dtype, x.device).view(x.shape))
            m = torch.mul(m, self.beta).add_(step)
        ctx.set(self.state_key, m)
        return m


@register
class EFSignSGD(GatheredCompressor):
    """EF-signSGD (Karimireddy et al., ICML 2019, "Error feedback fixes SignSGD and other gradient
    compression schemes").

    delta = (||p||_1 / n) * sign(p), with p the error-compensated input and the residual e = p - delta
    kept by residual feedback (the default).  The paper forms p = lr * g + e; with a constant learning
    rate, running the same recursion on g and letting the optimizer multiply by lr is equivalent (the
    residual is e / lr); under a schedule the kept residual is not rescaled when lr changes.  Wire: fp32 scale + ceil(n / 8) bytes =
    4 + ceil(n / 8), allgathered; the aggregate is the mean over workers of their deltas.
    """

    name = "efsignsgd"
    default_feedback = "residual"

    def __init__(self, feedback: Optional[str] = None):
        super().__init__(feedback)

    def compress(self, x, ctx):
        # Sum / max(n, 1) instead of mean(): an empty tensor gets scale 0, not NaN.
        # |x| into a reused buffer, unless x's own layout sets the order of the sum.
        magnitudes = (torch.abs(x, out=workspace("abs", x.numel(), x.dtype, x.device).view(x.shape))
                      if x.is_contiguous() else x.abs())
        scale = magnitudes.sum(dtype=torch.float32) / max(x.numel(), 1)
        return scale.reshape(1), encode_signs(x)

    def decompress(self, fields, ctx):
        scale, packed = fields
        return decode_signs(packed, ctx.shape).mul_(scale.reshape(()))

    def payload_bytes(self, ctx, kept=None):
        return 4 + _bits_bytes(ctx)
