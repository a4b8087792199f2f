"""Low-rank compression: send two thin factors P (n x r) and Q (m x r) instead of the n x m gradient."""
from __future__ import annotations

import itertools
import math
import weakref
from typing import Optional

import torch

from .. import devices, kernels
from .base import AllReduce, Compressor, Exchanged, TensorContext
from .bucket import strided_at
from .registry import register


def orthogonalize(a: torch.Tensor, epsilon: float) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``a`` (a new tensor; ``a`` is left as it is).

    Each column is divided by ``norm + epsilon``, so a zero column stays zero instead of becoming NaN
    (a layer whose gradient vanishes must not poison the run).
    """
    a = a.clone()
    for i in range(a.shape[1]):
        col = a[:, i : i + 1]
        col /= torch.linalg.vector_norm(col) + epsilon
        rest = a[:, i + 1 :]
        rest -= col * (col.T @ rest)
    return a


def _outer_sum(P, Rt, rank: int):
    # P[:, 0] Rt[0, :], then a fused multiply-add per further column: the roundings of torch.addcmul_.
    total = P[:, :1] * Rt[:1]
    for k in range(1, rank):
        total = torch.ops.prims.fma(P[:, k : k + 1], Rt[k : k + 1], total)
    return total


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _outer_into(out, P, Rt, *, rank: int):
    return out.copy_(_outer_sum(P, Rt, rank))


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _minus_outer(M, P, Rt, *, rank: int):
    return M.sub_(_outer_sum(P, Rt, rank))


def outer(P: torch.Tensor, Rt: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """P Rt (n x r times r x m) into ``out``.  On CPUs as r broadcast products, sum_k P[:, k] Rt[k, :]:
    a BLAS product of inner dimension 2 writes its n x m result about 2x slower than that (and a fused
    kernel, on large matrices, writes it in one pass)."""
    if not devices.outer_by_products(out):
        return torch.matmul(P, Rt, out=out)
    if kernels.enabled(out.numel()) and _outer_into(out, P, Rt, rank=P.shape[1]) is not None:
        return out
    torch.mul(P[:, :1], Rt[:1], out=out)
    for k in range(1, P.shape[1]):
        out.addcmul_(P[:, k : k + 1], Rt[k : k + 1])
    return out


def minus_outer(M: torch.Tensor, P: torch.Tensor, Rt: torch.Tensor) -> Optional[torch.Tensor]:
    """M - :func:`outer` (P, Rt), written into M, in one fused pass over M; None (M unchanged) where
    there is no such kernel (small matrices, GPUs, fused kernels off)."""
    if not devices.outer_by_products(M) or not kernels.enabled(M.numel()):
        return None
    return _minus_outer(M, P, Rt, rank=P.shape[1])


@register
class PowerSGD(Compressor):
    """PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019): rank-r power iteration, warm-started.

    The gradient is viewed as a matrix M of shape (shape[0], numel / shape[0]) (conv weights: out x
    in*kh*kw).  With Q (m x r) the previous step's basis (warm start) or a shared Gaussian draw:

        P = allreduce(M Q);   P = orthogonalize(P);   Q_i = M^T P;   Qbar = allreduce(Q_i) / N
        aggregate = P Qbar^T            sent_i = P Q_i^T            (mean_i sent_i == aggregate)

    so residual error feedback keeps M - P Q_i^T, this worker's own part.  Wire: P and Q in fp32, two
    allreduces, (n + m) * r * 4 bytes per worker.  Only matrices where (n + m) * r * min_compression <
    n * m are compressed, and only from step ``dense_steps`` on; the rest (1-D tensors, small matrices,
    early steps) is averaged densely.
    """

    name = "powersgd"
    default_feedback = "residual"
    # The only randomness, the initial Q, comes from a generator seeded identically on every rank.
    deterministic = True

    def __init__(self, rank: int = 2, dense_steps: int = 10, warm_start: bool = True, epsilon: float = 1e-8,
                 min_compression: float = 2.0, feedback: Optional[str] = None):
        super().__init__(feedback)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
        if isinstance(dense_steps, bool) or not isinstance(dense_steps, int) or dense_steps < 0:
            raise ValueError(f"dense_steps must be an integer >= 0, got {dense_steps!r}")
        if not isinstance(warm_start, bool):
            raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not 0 < epsilon < math.inf:
            raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
        if (isinstance(min_compression, bool) or not isinstance(min_compression, (int, float))
                or not 0 <= min_compression < math.inf):
            raise ValueError(f"min_compression must be a finite number >= 0, got {min_compression!r}")
        self.rank = rank
        self.dense_steps = dense_steps
        self.warm_start = warm_start
        self.epsilon = float(epsilon)
        self.min_compression = float(min_compression)

    def matrix_shape(self, ctx: TensorContext) -> tuple[int, int, int]:
        """(n, m, r): the matrix view of the tensor and the rank actually used (at most min(n, m))."""
        n = ctx.shape[0] if len(ctx.shape) else 1
        m = ctx.shape.numel() // n if n else 0
        return n, m, min(self.rank, n, m)

    def compresses(self, ctx):
        n, m, r = self.matrix_shape(ctx)
        pays = n * m > 0 and (n + m) * r * self.min_compression < n * m
        return len(ctx.shape) >= 2 and pays and ctx.step >= self.dense_steps

    def initial_q(self, m: int, r: int, x: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        q = ctx.get("Q") if self.warm_start else None
        # Redraw when there is no usable basis.  An all-zero column (left by a step whose gradient was
        # zero, e.g. an unused layer) would otherwise stay zero forever.  Qbar is identical on every
        # rank, so every rank decides the same.
        gen = ctx.generator(x.device, shared=True, salt="powersgd-Q")
        fresh = torch.randn(m, r, generator=gen, device=x.device, dtype=torch.float32)
        if q is None or q.shape != (m, r):
            q = fresh
        else:  # chosen on the device: no host sync (the draw is private to this tensor and step)
            q = torch.where((torch.linalg.vector_norm(q, dim=0) > 0).all(), q.to(fresh), fresh)
        # Unit columns make P scale like M rather than like M^2 (Qbar already carries |M|), so epsilon
        # stays negligible for small gradients.  GS(M Q R) == GS(M Q): the power iteration is unchanged.
        return orthogonalize(q.to(device=x.device, dtype=torch.float32), self.epsilon)

    def exchange(self, x, ctx):
        n, m, r = self.matrix_shape(ctx)
        M = x.reshape(n, m).float()
        Qt = self.initial_q(m, r, x, ctx).T.contiguous()  # Q^T: M Q as dot products of rows (fast on CPUs)
        P = yield AllReduce(M @ Qt.T)  # the sum, not the mean: orthogonalisation removes the scale
        P = orthogonalize(P, self.epsilon)
        Qt_local = P.T @ M  # (M^T P)^T, reading M row by row: M^T P itself is 20x slower on CPUs
        Qbar_t = (yield AllReduce(Qt_local)) / ctx.world_size
        ctx.set("Q", Qbar_t.T)
        aggregate = outer(P, Qbar_t, ctx.buffer("aggregate", (n, m), torch.float32, x.device)).reshape(ctx.shape)

        def sent(out=None):  # P Q_i^T, built only for error feedback (into its buffer when given)
            out = torch.empty(n, m, device=x.device) if out is None else out.view(n, m)
            return outer(P, Qt_local, out).reshape(ctx.shape)

        def subtract_sent(p):  # p is x: M - P Q_i^T in place, without writing P Q_i^T first
            return None if minus_outer(p.view(n, m), P, Qt_local) is None else p

        # |(P Qbar^T)_ij| = |sum over r of P_ik Qbar_jk| <= r max|P| max|Qbar|
        bound = r * P.abs().max() * Qbar_t.abs().max() if P.numel() else None
        return Exchanged(aggregate, sent, sent_into=sent, subtract_sent=subtract_sent, bound=bound)

    # -- the bucket route ---------------------------------------------------------------------------
    bucketed = True

    def _bucket_plan(self, layout, step: int) -> tuple:
        """(classes, dense): the compressed matrices grouped by matrix shape, as (n, m, r, members), and
        the tensors averaged densely; cached per layout and phase (before or from ``dense_steps``)."""
        cache = _PLANS.setdefault(layout, {})
        key = (self.rank, self.min_compression, step >= self.dense_steps)
        if key not in cache:
            classes, dense = {}, []
            for i, shape in enumerate(layout.shapes):
                ctx = TensorContext(key="", shape=shape, dtype=layout.dtype, step=step)
                if self.compresses(ctx):
                    classes.setdefault(self.matrix_shape(ctx), []).append(i)
                else:
                    dense.append(i)
            cache[key] = ([(n, m, r, tuple(members)) for (n, m, r), members in classes.items()], tuple(dense))
        return cache[key]

    def bucket_state_shapes(self, layout, step):
        classes, _ = self._bucket_plan(layout, step)
        shapes = [None] * len(layout)
        for n, m, r, members in classes:
            for i in members:
                shapes[i] = torch.Size((m, r))
        return {"Q": shapes}

    def bucket_exchange(self, p, b):
        """Each compressed matrix as in :meth:`exchange`, all matrices of one shape at once (``bmm``, a
        batched Gram-Schmidt); every P and the dense tensors' x / N in one allreduce, every Q in a second.
        Wire: (n + m) * r * 4 bytes per compressed matrix, 4 per element of the others."""
        layout, N = b.layout, b.world_size
        classes, dense = self._bucket_plan(layout, b.step)
        pieces = torch.split(p, layout.numels)
        Ms = [layout.stacked(p, members).view(-1, n, m) for n, m, r, members in classes]
        Qs = self._bucket_bases(b, classes)
        # every M Q, then the dense tensors' x / N, each written where it lies in what is allreduced
        sizes = [len(members) * n * r for n, m, r, members in classes] + [sum(layout.numels[i] for i in dense)]
        first = p.new_empty(sum(sizes))
        parts = torch.split(first, sizes)
        Ps = [torch.bmm(M, Q, out=part.view(-1, n, r)) for M, Q, part, (n, m, r, _) in zip(Ms, Qs, parts, classes)]
        if dense:
            torch.cat([pieces[i] for i in dense], out=parts[-1]).div_(N)
        total = yield AllReduce(first)
        sums = torch.split(total, sizes)
        Ps = _orthogonalized_together([S.view_as(P) for S, P in zip(sums, Ps)], self.epsilon)
        Qbar_ts = []
        if classes:  # (none before dense_steps)
            sizes = [len(members) * m * r for n, m, r, members in classes]
            own = p.new_empty(sum(sizes))
            Qts = [torch.bmm(P.transpose(1, 2), M, out=part.view(-1, r, m))  # Q_i^T = (M^T P)^T
                   for P, M, part, (n, m, r, _) in zip(Ps, Ms, torch.split(own, sizes), classes)]
            total = (yield AllReduce(own)) / N
            Qbar_ts = [S.view_as(Qt) for S, Qt in zip(torch.split(total, sizes), Qts)]
            b.set("Q", self._in_key_order(layout, classes, [Q.transpose(1, 2) for Q in Qbar_ts]))
        else:
            Qts = []
        aggregate = torch.empty(layout.numel, device=p.device)
        _fill(aggregate, layout, classes, dense, [torch.bmm(P, Qb) for P, Qb in zip(Ps, Qbar_ts)], sums[-1])

        def subtract_sent(q):  # q - P Q_i^T on the matrices, q - q = 0 on the dense tensors (sent whole)
            parts = torch.split(q, layout.numels)
            mine = [torch.bmm(P, Qt) for P, Qt in zip(Ps, Qts)]
            _foreach_rows(torch._foreach_sub_, parts, classes, mine)
            if dense:
                torch._foreach_zero_([parts[i] for i in dense])
            return q

        def sent():  # P Q_i^T on the matrices, the dense tensors as they are
            out = torch.empty_like(p)
            dense_values = torch.cat([pieces[i] for i in dense]) if dense else p.new_empty(0)
            _fill(out, layout, classes, dense, [torch.bmm(P, Qt) for P, Qt in zip(Ps, Qts)], dense_values)
            return out

        return Exchanged(aggregate, sent, subtract_sent=subtract_sent)

    def _bucket_bases(self, b, classes) -> list:
        """Each class's Q: the kept bases where every column of a matrix's basis is non-zero, else a
        draw shared by every rank (counter-based normals), orthogonalised as in :meth:`initial_q`.  With
        ``warm_start`` that draw is the bucket's own, made once (:meth:`_bucket_draw`); without it, a
        fresh one every step."""
        if not classes:
            return []
        if not self.warm_start:
            return _orthogonalized_together(self._drawn_bases(b, classes, per_step=True)[0], self.epsilon)
        kept = b.get("Q")
        fresh, padded = self._bucket_draw(b, classes)
        if kept is None:
            return _orthogonalized_together(fresh, self.epsilon)
        sizes = {i: m * r for n, m, r, members in classes for i in members}
        starts = dict(zip(sorted(sizes), itertools.accumulate([0] + [sizes[i] for i in sorted(sizes)])))  # key order
        bases = {}
        for group, drawn in zip(_by_rank(fresh), padded):  # every class of one r at once, gathered from the kept state
            rows, r = [classes[c][1] for c in group], classes[group[0]][2]
            q, views = _padded_at([kept], [[starts[i] for i in classes[c][3]] for c in group], rows, r)
            usable = (torch.linalg.vector_norm(q, dim=1) > 0).all(1).view(-1, 1, 1)
            _orthogonalize_(torch.where(usable, q, drawn, out=q), self.epsilon)
            bases.update(zip(group, views))
        return [bases[c] for c in range(len(classes))]

    def _bucket_draw(self, b, classes) -> tuple:
        """(per class, its matrices' draws; per group of one r (:func:`_by_rank`), those draws padded as
        the kept bases are): the bucket's one shared draw, made at its first exchange from a seed that
        does not change with the step (the same after a resume) and kept with its layout, where a draw
        at every step took some ten launches a bucket for a basis that is rarely used."""
        cache = _PLANS.setdefault(b.layout, {})
        key = ("draw", b.seed, self.rank, self.min_compression)
        if key not in cache:
            fresh, normal, counts = self._drawn_bases(b, classes, per_step=False)
            drawn_at = list(itertools.accumulate([0] + counts))  # each class's draws in normal
            padded = []
            for group in _by_rank(fresh):
                rows, r = [classes[c][1] for c in group], classes[group[0]][2]
                padded.append(_padded_at([normal], [range(drawn_at[c], drawn_at[c + 1], rows[j] * r)
                                                    for j, c in enumerate(group)], rows, r)[0])
            cache[key] = (fresh, padded)
        return cache[key]

    @staticmethod
    def _drawn_bases(b, classes, per_step: bool) -> tuple:
        """(per class its matrices' standard normal draws (members x m x r), all of them flat, per class
        their number), shared by every rank: Box-Muller of counter-based uniforms."""
        counts = [len(members) * m * r for n, m, r, members in classes]
        u = b.uniforms(2 * sum(counts), shared=True, salt="powersgd-Q", per_step=per_step).view(2, -1)
        normal = torch.sqrt(-2 * torch.log1p(-u[0])) * torch.cos(2 * math.pi * u[1])  # Box-Muller
        fresh = [d.view(len(members), m, r) for d, (n, m, r, members) in zip(torch.split(normal, counts), classes)]
        return fresh, normal, counts

    @staticmethod
    def _in_key_order(layout, classes, per_class) -> torch.Tensor:
        """The classes' per-matrix values laid end to end in the order of the bucket's keys."""
        rows = {i: row for (n, m, r, members), values in zip(classes, per_class)
                for i, row in zip(members, values.unbind(0))}
        ordered = [rows[i] for i in sorted(rows)]
        if len({row.shape[1:] for row in ordered}) == 1:  # one cat of the matrices, each row-major, not a copy each
            return torch.cat(ordered).view(-1)
        return torch.cat([row.reshape(-1) for row in ordered])

    def bucket_payload_bytes(self, layout):
        classes, dense = self._bucket_plan(layout, self.dense_steps)
        return sum((n + m) * r * 4 * len(members) for n, m, r, members in classes) + 4 * sum(layout.numels[i] for i in dense)

    def payload_bytes(self, ctx, kept=None):
        if not self.compresses(ctx):  # sent densely by feedback.py, in the gradient's dtype
            return ctx.shape.numel() * ctx.dtype.itemsize
        n, m, r = self.matrix_shape(ctx)
        return (n + m) * r * 4


#: Per bucket layout: PowerSGD's plans by (rank, min_compression, phase) and its kept draws.
_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _orthogonalized_together(batches: list, epsilon: float) -> list:
    """:func:`orthogonalize` of each matrix of the batches (b_i x n_i x r_i), as new tensors: every batch of
    one r (the rank, or min(n, m) below it where ``min_compression`` < 2 lets such a matrix pay) in one
    Gram-Schmidt over their zero-padded stack (:func:`_padded`), whose operations do not grow with the
    number of shapes.  Zero rows change no norm and no dot product, and stay zero: each matrix gets its
    own result, up to the order of float sums."""
    result = {}
    for group in _by_rank(batches):
        padded, views = _padded([batches[i] for i in group])
        _orthogonalize_(padded, epsilon)
        result.update(zip(group, views))
    return [result[i] for i in range(len(batches))]


def _by_rank(batches: list) -> list:
    """The indices of ``batches`` (b x n x r each) grouped by r, in order of first appearance."""
    groups: dict = {}
    for i, a in enumerate(batches):
        groups.setdefault(a.shape[2], []).append(i)
    return list(groups.values())


def _padded(batches: list) -> tuple:
    """(padded, views): the batches (b_i x n_i x r, one r) end to end in a new (sum b_i) x max n_i x r
    tensor, zero below each matrix's n_i rows, and each batch's view of it (one batch: its clone)."""
    if len(batches) == 1:
        padded = batches[0].clone()
        return padded, [padded]
    starts, at = [], 0
    for a in batches:
        starts.append(range(at, at + a.numel(), a.shape[1] * a.shape[2]))
        at += a.numel()
    return _padded_at([a.reshape(-1) for a in batches], starts, [a.shape[1] for a in batches], batches[0].shape[2])


def _padded_at(sources: list, starts: list, rows: list, r: int) -> tuple:
    """:func:`_padded` of batches of matrices read from the 1-D ``sources`` laid end to end: batch i's
    matrices have ``rows[i]`` rows of r, each row-major from its position in ``starts[i]``.  One gather
    (and the concatenation of the sources, where there are several), by an index built once per
    layout, where a copy of each batch into a zeroed stack would take an operation per batch (and a
    batch read at a stride, a copy more)."""
    first = sources[0]
    total = sum(source.numel() for source in sources)
    index, zero = _pad_index(tuple(tuple(at) for at in starts), tuple(rows), r, total, first.device, first.dtype)
    padded = torch.cat([*sources, zero]).index_select(0, index).view(-1, max(rows), r)
    views, at = [], 0
    for members, n in zip(starts, rows):
        views.append(padded[at:at + len(members), :n])
        at += len(members)
    return padded, views


_PAD_INDICES: dict = {}


def _pad_index(starts: tuple, rows: tuple, r: int, total: int, device: torch.device, dtype: torch.dtype) -> tuple:
    """For :func:`_padded_at`: each element of the padded stack, its position in the sources laid end
    to end (``total`` elements), or the zero after them (below a matrix's rows); and that zero (one
    element, read only)."""
    key = (starts, rows, r, total, device, dtype)
    if key not in _PAD_INDICES:
        height = max(rows)
        within = torch.arange(height * r).view(height, r)  # an element's place in a row-major matrix
        parts = [torch.where(within < n * r, torch.tensor(members).view(-1, 1, 1) + within, total).view(-1)
                 for members, n in zip(starts, rows)]
        index = torch.cat(parts).to(device)
        if len(_PAD_INDICES) >= 64:  # a model's few layouts; bounded all the same
            _PAD_INDICES.clear()
        _PAD_INDICES[key] = (index, torch.zeros(1, dtype=dtype, device=device))
    return _PAD_INDICES[key]


def _orthogonalize_(a: torch.Tensor, epsilon: float) -> torch.Tensor:
    """:func:`orthogonalize` of each matrix of the batch ``a`` (b x n x r) at once, in place."""
    for i in range(a.shape[2]):
        col = a[:, :, i:i + 1]
        col /= torch.linalg.vector_norm(col, dim=1, keepdim=True) + epsilon
        if i + 1 < a.shape[2]:  # the last column has nothing after it: two dispatches saved
            rest = a[:, :, i + 1:]
            rest.baddbmm_(col, torch.bmm(col.transpose(1, 2), rest), alpha=-1)  # rest - col (col^T rest)
    return a


def _foreach_rows(op, parts, classes, values) -> None:
    """``op(tensors, rows)`` over every compressed matrix's part of the bucket and its row of ``values``."""
    targets, rows = [], []
    for (n, m, r, members), batch in zip(classes, values):
        targets.extend(parts[i] for i in members)
        rows.extend(batch.reshape(len(members), -1).unbind(0))
    if targets:
        op(targets, rows)


def _fill(aggregate, layout, classes, dense, per_class, dense_total) -> None:
    """The aggregate's matrices from ``per_class`` and its dense tensors from ``dense_total``."""
    parts = torch.split(aggregate, layout.numels)
    _foreach_rows(torch._foreach_copy_, parts, classes, per_class)
    if dense:
        torch._foreach_copy_([parts[i] for i in dense], list(torch.split(dense_total, [layout.numels[i] for i in dense])))
