"""Error feedback: what a worker keeps of the gradient mass that compression did not send.

Each scheme is a small :class:`Feedback` object that wraps a compressor's exchange generator and keeps
the invariant

    sent + new_state == compensated input          (nothing dropped is lost, only delayed)

- :class:`NoFeedback` (``none``): send C(g); whatever C drops is gone (right for unbiased quantisers).
- :class:`Residual` (``residual``; Seide et al. 2014; Karimireddy et al. 2019): p = g + e; send C(p);
  e = p - D(C(p)).
- :class:`MomentumCorrection` (``momentum``; DGC, Lin et al. ICLR 2018, Sec. 3.2-3.3): momentum
  correction u = m*u + g (Nesterov: u = (u + g)*m, v gets u + g); v = v + u; send C(v); v = v - D(C(v));
  momentum factor masking zeroes u where an element was sent; local clipping of g by
  ``clip_norm * N^-1/2`` before accumulation.  The optimizer must then apply no momentum of its own.

Each scheme owns a typed per-tensor state, a dataclass of tensors (:class:`ResidualState`,
:class:`MomentumState`): :meth:`Feedback.load` reads it from the tensor's staged context and
:meth:`Feedback.stage` writes it back, under the state's field names (also the checkpoint's keys).
Under a loss scale (``ctx.scale``: ``GradScaler``'s, which the gradients carry) the state is kept
divided by it and multiplied by the current one as it is added, in the same pass: it then follows the
scale as the scaler backs off and grows.

A compressor names its scheme in ``compressor.feedback`` (a string, as in its ``params()`` and state
dicts); :func:`scheme_of` gives the object, built here from the name and the compressor's
``feedback_params()`` (DGC's and CSC's momentum, nesterov, clip_norm) and cached on the compressor, so
that the compressors never import this module.  :func:`exchange` is the entry point.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import ClassVar, Optional

import torch

from . import devices, kernels
from .compressors.base import Compressor, Exchange, TensorContext, add_scaled, times_scale, unscale_, workspace
from .compressors.dense import NoCompression
from .compressors.sparse import _momentum_params

__all__ = ["exchange", "FEEDBACKS", "STATE_KEYS", "Feedback", "NoFeedback", "Residual", "MomentumCorrection", "NoState",
           "ResidualState", "MomentumState", "make_feedback", "scheme_of", "with_feedback"]

_DENSE = NoCompression()


@dataclasses.dataclass
class NoState:
    """No feedback keeps nothing."""


@dataclasses.dataclass
class ResidualState:
    """Residual feedback's memory of one tensor."""

    residual: Optional[torch.Tensor] = None  # e = p - D(C(p)); None: nothing held back


@dataclasses.dataclass
class MomentumState:
    """DGC's momentum correction for one tensor."""

    momentum: Optional[torch.Tensor] = None  # u, the corrected momentum (masked where sent)
    velocity: Optional[torch.Tensor] = None  # v, the accumulated velocity not yet sent


class Feedback:
    """Base class of the error-feedback schemes: ``name`` (the compressor's ``feedback`` string),
    ``State`` (its per-tensor state, a dataclass of tensors or None; ``state_keys`` are its field names,
    the entries it owns in a tensor's state and checkpoint) and the generator :meth:`exchange`."""

    name: ClassVar[str] = ""
    State: ClassVar[type] = NoState
    state_keys: ClassVar[tuple] = ()
    #: The constructor parameters, taken from a compressor's ``feedback_params()`` by :func:`scheme_of`.
    param_names: ClassVar[tuple] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.state_keys = tuple(f.name for f in dataclasses.fields(cls.State))

    def params(self) -> dict:
        return {k: getattr(self, k) for k in self.param_names}

    def load(self, ctx: TensorContext):
        """This tensor's state as of this exchange (staged values first, then the committed ones)."""
        return self.State(**{k: ctx.get(k) for k in self.state_keys})

    def stage(self, ctx: TensorContext, state) -> None:
        """Stage ``state``; the owner commits it only once the exchange succeeded on every rank."""
        for k in self.state_keys:
            ctx.set(k, getattr(state, k))

    def checks_input(self, g: torch.Tensor, ctx: TensorContext) -> bool:
        """Whether :meth:`exchange` can check the compensated input for NaN and Inf while it computes it
        (then the owner sets ``ctx.check_input`` and skips its own read of ``g``); False by default."""
        return False

    def exchange(self, compressor: Compressor, x: torch.Tensor, ctx: TensorContext, run, compressed: bool) -> Exchange:
        """Run ``run(input, ctx)`` (the compressor's exchange, or the dense one when ``compressed`` is
        False) on the compensated input and update this scheme's state in ``ctx``."""
        raise NotImplementedError

    def __eq__(self, other):
        return type(other) is type(self) and other.params() == self.params()

    def __hash__(self):
        return hash((type(self), tuple(self.params().items())))

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.params().items())})"


class NoFeedback(Feedback):
    """send C(g); whatever C drops is gone (right for unbiased quantisers)."""

    name = "none"

    def exchange(self, compressor, x, ctx, run, compressed):
        return (yield from run(x, ctx))


class Residual(Feedback):
    """Residual error feedback (Seide et al. 2014; Karimireddy et al. 2019):
    p = g + e; send C(p); e = p - D(C(p))."""

    name = "residual"
    State = ResidualState

    def checks_input(self, g, ctx):
        e = self.load(ctx).residual
        return e is not None and _checkable(g) and e.is_contiguous()

    def exchange(self, compressor, x, ctx, run, compressed):
        e = self.load(ctx).residual
        if e is None:
            p = x
        elif ctx.check_input:
            p = _checked_add(x, e, ctx, compressor.read_while_written(ctx) if compressed else None)
        else:
            p = add_scaled(x, e, ctx.scale, out=ctx.spare("residual", e))
        result = yield from run(p, ctx)
        # A tensor sent densely keeps no residual (it would be rounding noise at most), nor does one that
        # the method settled within this exchange on sending densely from now on.
        keep = compressed and not result.settled_dense
        e = unscale_(_minus_sent(p, result, own=e is not None), ctx.scale) if keep else None
        self.stage(ctx, ResidualState(e))
        return result


class MomentumCorrection(Feedback):
    """DGC's momentum correction (Lin et al., ICLR 2018, Sec. 3.2-3.3):
    u = m*u + g (Nesterov: u = (u + g)*m, v gets u + g); v = v + u; send C(v); v = v - D(C(v)); momentum
    factor masking zeroes u where an element was sent; local clipping of g by ``clip_norm * N^-1/2``
    before accumulation.  The optimizer must then apply no momentum of its own."""

    name = "momentum"
    State = MomentumState
    param_names = ("momentum", "nesterov", "clip_norm")

    def __init__(self, momentum: float = 0.9, nesterov: bool = False, clip_norm: Optional[float] = None):
        self.momentum, self.nesterov, self.clip_norm = _momentum_params(momentum, nesterov, clip_norm)

    def exchange(self, compressor, g, ctx, run, compressed):
        m, scale = self.momentum, ctx.scale
        if self.clip_norm is not None:
            limit = self.clip_norm * ctx.world_size ** -0.5
            norm = torch.linalg.vector_norm(g)
            if scale is not None:  # clip_norm is in gradient units
                norm = norm / scale
            g = g * torch.clamp(limit / (norm + 1e-6), max=1.0)
        state = self.load(ctx)
        u, v = state.momentum, state.velocity
        fused = None
        fusable = kernels.enabled(g.numel()) and g.is_contiguous() and devices.fuses_momentum(g) and scale is None
        if u is not None and v is not None and fusable:
            # Both updates in one pass over u, g and v (a kernel, on large CPU tensors: GPU compilers
            # contract a multiply and an add into one rounding), rounded as below.
            new_u, new_v = ctx.spare("momentum", u), ctx.spare("velocity", v)
            fused = _momentum_step(u, g, v, new_u, new_v, m=m, nesterov=self.nesterov)
        if fused is not None:
            u, v, fresh_v = new_u, new_v, True
        else:
            u = torch.zeros_like(g) if u is None else u
            # Into spare memory, then in-place steps: the same roundings as the textbook expressions.
            if self.nesterov:
                u = add_scaled(g, u, scale, out=ctx.spare("momentum", u)).mul_(m)  # u = (u + g) * m
                increment = u + g
            else:
                u = torch.mul(u, times_scale(m, scale), out=ctx.spare("momentum", u)).add_(g)  # u = m * u + g
                increment = u
            fresh_v = v is not None or increment is not u  # v's memory is this exchange's own, not u's
            v = increment if v is None else add_scaled(increment, v, scale, out=ctx.spare("velocity", v))
        result = yield from run(v, ctx)
        if compressed:
            v = _minus_sent(v, result, own=fresh_v)
            if result.sparse is not None or result.mask is not None:
                # Momentum factor masking.  v is already ~0 where sent (exactly 0 for fp32 values); it keeps
                # the value-dtype rounding residue so that conservation stays exact.  u is this exchange's own.
                if result.sparse is not None and u.is_contiguous():
                    u.view(-1).index_fill_(0, result.sparse[0], 0.0)
                else:
                    u = u.masked_fill(result.mask.reshape(u.shape), 0.0)
        else:
            # Sent whole: nothing accumulates and masking would erase the momentum, so keep u as it is.
            v = None
        self.stage(ctx, MomentumState(momentum=unscale_(u, scale), velocity=unscale_(v, scale)))
        return result

    def bucket_exchange(self, compressor, g, b):
        """The same over a flat bucket ``g``: u and v one flat tensor each in ``b``'s state; each
        tensor's clipping norm by one segmented sum of squares; masking u at the sent positions
        (``sparse``: index_fill; else the sent mask).  The tensors that the compressor sends whole
        (:func:`_none_where_whole`) keep no velocity, and their momentum is not masked (their sent
        positions are not in ``sparse``/``mask``)."""
        layout, m, scale = b.layout, self.momentum, b.scale
        spare = b.input_spare  # g's memory may take v (see BucketContext)
        g = g.float()
        if self.clip_norm is not None:
            limit = self.clip_norm * b.world_size ** -0.5
            norms = layout.segment_sum(g * g).sqrt_()
            if scale is not None:  # clip_norm is in gradient units
                norms = norms / scale
            g, spare = g * layout.per_element(torch.clamp(limit / (norms + 1e-6), max=1.0)), True
        u, v = b.get("momentum"), b.get("velocity")
        u = torch.zeros_like(g) if u is None else u
        if self.nesterov:
            u = add_scaled(g, u, scale).mul_(m)  # u = (u + g) * m
            increment = g.add_(u) if spare else u + g
        else:
            u = torch.mul(u, times_scale(m, scale)).add_(g)  # u = m * u + g
            increment = u
        into = g if spare else None
        if v is None:
            v = increment.clone() if into is None else into.copy_(increment)
        else:
            v = add_scaled(increment, v, scale, out=into)
        result = yield from compressor.bucket_exchange(v, b)
        v = _none_where_whole(compressor, b, _minus_sent(v, result, own=True))
        if result.sparse is not None:
            u.index_fill_(0, result.sparse[0], 0.0)
        elif result.mask is not None:
            u.masked_fill_(result.mask, 0.0)
        b.set("momentum", unscale_(u, scale))
        b.set("velocity", unscale_(v, scale))
        return result


@kernels.fused(min_numel=kernels.LARGE_NUMEL)
def _momentum_step(u, g, v, new_u, new_v, *, m: float, nesterov: bool):
    """MomentumCorrection's u and v updates into ``new_u`` and ``new_v``, in one loop."""
    u = (u + g) * m if nesterov else u * m + g
    new_u.copy_(u)
    return new_v.copy_(v + (u + g if nesterov else u))


_SCHEMES = {cls.name: cls for cls in (NoFeedback, Residual, MomentumCorrection)}
FEEDBACKS = tuple(_SCHEMES)
#: The names of every scheme's per-tensor state (a tensor's entries that error feedback owns).
STATE_KEYS = tuple(dict.fromkeys(k for cls in _SCHEMES.values() for k in cls.state_keys))


def make_feedback(spec, **params) -> Feedback:
    """A :class:`Feedback` from None (no feedback), a scheme name (built with ``params``) or an instance."""
    if isinstance(spec, Feedback):
        if params:
            raise ValueError("parameters cannot be given together with an already built feedback")
        return spec
    if spec is None:
        spec = "none"
    if spec not in _SCHEMES:
        raise ValueError(f"unknown feedback {spec!r}; valid: {', '.join(FEEDBACKS)}")
    return _SCHEMES[spec](**params)


def scheme_of(compressor: Compressor) -> Feedback:
    """The compressor's feedback object: one given to :func:`with_feedback`, else built from its
    ``feedback`` name and ``feedback_params()``; cached on the compressor while those stay the same."""
    name = compressor.feedback
    cached = compressor.__dict__.get("_feedback_scheme")
    if cached is not None and cached[0] is None and cached[1].name == name:
        return cached[1]  # given explicitly
    cls = _SCHEMES.get(name)
    if cls is None:
        raise ValueError(f"unknown feedback {name!r}; valid: {', '.join(FEEDBACKS)}")
    given = compressor.feedback_params()
    params = {k: given[k] for k in cls.param_names if k in given}
    key = (name, tuple(params.items()))
    if cached is not None and cached[0] == key:
        return cached[1]
    scheme = cls(**params)
    compressor._feedback_scheme = (key, scheme)
    return scheme


def with_feedback(compressor: Compressor, spec) -> Compressor:
    """The same compressor with feedback ``spec`` (a name or a :class:`Feedback`), allowed by its
    ``feedbacks``: rebuilt from its constructor parameters (a method may build parts from its feedback,
    as auto does, and with the scheme's parameters where the method takes them), else a copy with
    ``feedback`` set.  A Feedback object is used as given."""
    scheme = spec if isinstance(spec, Feedback) else None
    name = scheme.name if scheme is not None else spec
    if name not in compressor.feedbacks:
        raise ValueError(f"{compressor.name}: feedback must be one of {list(compressor.feedbacks)}, got {spec!r}")
    sig = inspect.signature(type(compressor).__init__).parameters
    if "feedback" in sig:
        kwargs = {k: v for k, v in compressor.params().items() if k in sig}
        kwargs["feedback"] = name
        if scheme is not None:  # the scheme's parameters where the method has them (DGC's momentum)
            kwargs.update((k, v) for k, v in scheme.params().items() if k in sig)
        c = type(compressor)(**kwargs)
    else:
        c = copy.deepcopy(compressor)
        c.feedback = name
    if scheme is not None:
        c._feedback_scheme = (None, scheme)
    return c


def checks_input(compressor: Compressor, g: torch.Tensor, ctx: TensorContext) -> bool:
    """Whether this gradient's exchange can check its compensated input (g + e) for NaN and Inf fused
    with computing it, in place of a separate read of g: g + e is finite exactly when g is (e is
    always finite) or the sum overflowed, which the output check would flag anyway."""
    return scheme_of(compressor).checks_input(g, ctx)


def _checkable(g: torch.Tensor) -> bool:
    return devices.reads_freely(g) and g.is_contiguous() and g.numel() >= kernels.CHECK_CHUNK


def _checked_add(x: torch.Tensor, e: torch.Tensor, ctx: TensorContext, observe=None) -> torch.Tensor:
    """x + e (e times ``ctx.scale``, if any) into ``e``'s spare memory, checked as it is written
    (:func:`kernels.written_finite`), each chunk also handed to ``observe``
    (:meth:`Compressor.read_while_written`) while it is cached; if it holds NaN or Inf, ``ctx.input_nonfinite`` is set and the sum zeroed (the step is discarded, and
    compressors never see non-finite values, nor what was computed from them)."""
    p = ctx.spare("residual", e)
    xs, es, ps = x.reshape(-1), e.reshape(-1), p.view(-1)

    def write(a, b):
        add_scaled(xs[a:b], es[a:b], ctx.scale, out=ps[a:b])
        if observe is not None:
            observe(ps, a, b)

    if not kernels.written_finite(p, write):
        ctx.input_nonfinite = True
        ctx.precomputed = None
        p.nan_to_num_(0.0, 0.0, 0.0)
    return p


def exchange(compressor: Compressor, g: torch.Tensor, ctx: TensorContext) -> Exchange:
    """Compress one gradient with the compressor's feedback scheme; returns its :class:`Exchanged`."""
    x = g.detach().reshape(ctx.shape).float()
    compressed = compressor.compresses(ctx)
    run = compressor.exchange if compressed else _DENSE.exchange
    # Without feedback nothing reads the input after the exchange, so a method that is done with it
    # before building the aggregate may build it in the input's own memory.
    if ctx.out is not None and not (compressed and compressor.done_with_input_early
                                    and isinstance(scheme_of(compressor), NoFeedback)):
        run = _withdrawing_overlapping_out(run)
    return (yield from scheme_of(compressor).exchange(compressor, x, ctx, run, compressed))


def takes_bucket(compressor: Compressor) -> bool:
    """Whether the compressor's feedback scheme has a bucket route (:func:`bucket_exchange`)."""
    return type(scheme_of(compressor)) in (NoFeedback, Residual, MomentumCorrection)


def bucket_exchange(compressor: Compressor, g: torch.Tensor, b) -> Exchange:
    """Compress a whole bucket, the flat ``g``, with the compressor's feedback scheme (none; residual:
    p = g + e; send C(p); e = p - D(C(p)), with e one flat tensor in ``b``'s state, staged for the owner
    to commit; momentum: :meth:`MomentumCorrection.bucket_exchange`)."""
    scheme = scheme_of(compressor)
    if isinstance(scheme, NoFeedback):
        return (yield from compressor.bucket_exchange(g.float(), b))
    if isinstance(scheme, MomentumCorrection):
        return (yield from scheme.bucket_exchange(compressor, g, b))
    e = b.get("residual")
    p = g.float() if e is None else add_scaled(g, e, b.scale, out=g if b.input_spare else None)
    result = yield from compressor.bucket_exchange(p, b)
    e = _minus_sent(p, result, own=e is not None or g.dtype != torch.float32 or b.input_spare)
    b.set("residual", unscale_(_none_where_whole(compressor, b, e), b.scale))
    return result


def _none_where_whole(compressor: Compressor, b, state: torch.Tensor) -> torch.Tensor:
    """``state`` zeroed (the route's "nothing kept") over the tensors that the compressor sent whole
    (``compressor.bucket_sent_whole(layout)``: their positions, or None), which keep no state."""
    whole = compressor.bucket_sent_whole(b.layout)
    return state if whole is None else state.index_fill_(0, whole, 0.0)


def _withdrawing_overlapping_out(run):
    """``run``, except that the caller's output is not lent as the aggregate buffer when it shares
    memory with the compressor's input: a compressor may read its input after building the aggregate."""
    def guarded(p, ctx):
        if _shares_memory(ctx.out, p):
            ctx.out = None
        return (yield from run(p, ctx))
    return guarded


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _minus_sent(p: torch.Tensor, result, own: bool) -> torch.Tensor:
    """``p - result.sent``, exactly, without new full-size tensors where possible.

    ``own``: p was computed by this exchange, so its memory may take the result, unless the compressor
    handed p itself back (a dense method may return its input as ``sent`` or ``aggregate``).  A sparse
    ``sent`` only changes p at the sent positions (p - 0 == p, signed zeros included).
    """
    own = own and p.is_contiguous() and not _shares_memory(p, result.aggregate)
    if result.sparse is not None and p.is_contiguous():
        idx, values = result.sparse
        out = p if own else p.clone()
        if result.sent_exactly:  # p - p is +0: a write costs less than a read-modify-write
            out.view(-1).index_fill_(0, idx, 0.0)
        else:  # p + (-1) * v is p - v to the bit (IEEE subtraction adds the negation); one
            out.view(-1).index_add_(0, idx, values, alpha=-1)  # read-modify-write beats a gather and a scatter
        return out
    if own and result.subtract_sent is not None and result.sent_pending and result.subtract_sent(p) is not None:
        return p
    if own and result.sent_into is not None and result.sent_pending:
        return p.sub_(result.sent_into(workspace("sent", p.numel(), torch.float32, p.device).view(p.shape)))
    sent = result.sent
    if own and not _shares_memory(p, sent):
        return p.sub_(sent)
    return p - sent
