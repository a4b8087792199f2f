"""Double momentum as a checked error, shared by the DDP hook and ``DistributedOptimizer``.

Methods that apply momentum to the gradients they exchange (DGC's momentum correction, Signum) must not
be stepped by an optimizer that applies momentum again.  :func:`guard_momentum` marks such parameters;
a global optimizer step pre-hook then refuses any optimizer with momentum (or Adam-style betas) that
steps one of them.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..state import GradzipState

__all__ = ["guard_momentum", "release_momentum"]

# Parameters whose gradients already carry momentum (DGC's momentum correction).  Keyed by identity:
# a WeakSet would compare tensors with ==.
_momentum_corrected = WeakIdKeyDictionary()
_guard_handle = None


def _check_no_optimizer_momentum(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        if not any(p in _momentum_corrected for p in group["params"]):
            continue
        if group.get("momentum", 0) or "betas" in group:
            raise ValueError(
                f"{type(optimizer).__name__} applies its own momentum to parameters whose gradients gradzip "
                "already applies momentum to (DGC's momentum correction, Signum); use torch.optim.SGD with "
                "momentum=0 and give the momentum to the compressor instead"
            )


def guard_momentum(state: GradzipState, params: Iterable[torch.Tensor]) -> None:
    """Make double momentum a checked error: any optimizer stepping these parameters with momentum raises."""
    global _guard_handle
    if not state.compressor.applies_momentum:
        return
    for p in params:
        _momentum_corrected[p] = _momentum_corrected.get(p, 0) + 1  # states guarding it
    if _guard_handle is None:
        _guard_handle = register_optimizer_step_pre_hook(_check_no_optimizer_momentum)


def release_momentum(state: GradzipState, params: Iterable[torch.Tensor]) -> None:
    """Undo :func:`guard_momentum` for a state that no longer exchanges these parameters (closed)."""
    if not state.compressor.applies_momentum:
        return
    for p in params:
        left = _momentum_corrected.get(p, 0) - 1
        if left > 0:
            _momentum_corrected[p] = left
        else:
            _momentum_corrected.pop(p, None)
