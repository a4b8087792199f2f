"""Error feedback: what a worker keeps of the gradient mass that compression did not send.

All three schemes wrap a compressor's exchange generator and keep the invariant

    sent + new_state == compensated input          (nothing dropped is lost, only delayed)

- ``none``: send C(g); whatever C drops is gone (right for unbiased quantisers).
- ``residual`` (Seide et al. 2014; Karimireddy et al. 2019): p = g + e; send C(p); e = p - D(C(p)).
- ``momentum`` (DGC, Lin et al. ICLR 2018, Sec. 3.2-3.3): momentum correction
  u = m*u + g (Nesterov: u = (u + g)*m, v gets u + g); v = v + u; send C(v); v = v - D(C(v));
  momentum factor masking zeroes u where an element was sent; local clipping of g by
  ``clip_norm * N^-1/2`` before accumulation.  The optimizer must then apply no momentum of its own.
"""
from __future__ import annotations

import torch

from .compressors.base import Compressor, Exchange, TensorContext, workspace
from .compressors.dense import NoCompression

__all__ = ["exchange", "FEEDBACKS"]

FEEDBACKS = ("none", "residual", "momentum")
_DENSE = NoCompression()


def exchange(compressor: Compressor, g: torch.Tensor, ctx: TensorContext) -> Exchange:
    """Compress one gradient with the compressor's feedback scheme; returns its :class:`Exchanged`."""
    x = g.detach().reshape(ctx.shape).float()
    compressed = compressor.compresses(ctx)
    run = compressor.exchange if compressed else _DENSE.exchange
    scheme = compressor.feedback
    if scheme == "none":
        return (yield from run(x, ctx))
    if scheme == "residual":
        residual = ctx.get("residual")
        p = x if residual is None else x + residual
        result = yield from run(p, ctx)
        # A tensor sent densely keeps no residual (it would be rounding noise at most).  Asking again
        # after the exchange lets a method that decides within it (auto) drop the residual at once: it
        # sent this step densely too.
        keep = compressed and compressor.compresses(ctx)
        ctx.set("residual", _minus_sent(p, result, own=residual is not None) if keep else None)
        return result
    if scheme == "momentum":
        return (yield from _momentum_corrected(compressor, x, ctx, run, compressed))
    raise ValueError(f"unknown feedback {scheme!r}; valid: {', '.join(FEEDBACKS)}")


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
        flat = out.view(-1)
        flat.index_put_((idx,), flat[idx] - values)
        return out
    if own and result.sent_into is not None and result.sent_pending:
        return p.sub_(result.sent_into(workspace("sent", p.numel(), torch.float32, p.device).view(p.shape)))
    sent = result.sent
    if own and not _shares_memory(p, sent):
        return p.sub_(sent)
    return p - sent


def _momentum_corrected(compressor, g, ctx, run, compressed):
    m = compressor.momentum
    if compressor.clip_norm is not None:
        limit = compressor.clip_norm * ctx.world_size ** -0.5
        norm = torch.linalg.vector_norm(g)
        g = g * torch.clamp(limit / (norm + 1e-6), max=1.0)
    u = ctx.get("momentum")
    u = torch.zeros_like(g) if u is None else u
    # New tensors, then in-place steps: the same roundings as the textbook expressions in comments.
    if compressor.nesterov:
        u = torch.add(u, g).mul_(m)  # u = (u + g) * m
        increment = u + g
    else:
        u = torch.mul(u, m).add_(g)  # u = m * u + g
        increment = u
    v = ctx.get("velocity")
    fresh_v = v is not None or increment is not u  # v's memory is this exchange's own, not u's
    v = increment if v is None else v + increment
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
        ctx.set("velocity", v)
    else:
        # Sent whole: nothing accumulates and masking would erase the momentum, so keep u as it is.
        ctx.set("velocity", None)
    ctx.set("momentum", u)
    return result
