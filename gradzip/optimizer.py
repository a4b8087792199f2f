"""Horovod-style integration: wrap any optimizer so ``step()`` averages compressed gradients first.

For code that does not use DistributedDataParallel (the seeds' design).  Gradients are exchanged in
buckets as soon as every gradient of a bucket is accumulated (overlapping the rest of backward), on the
state's single communication thread, in bucket order on every rank.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .state import GradzipState

__all__ = ["DistributedOptimizer", "guard_momentum", "own_group"]

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
                "already momentum-corrected (feedback='momentum', as in DGC); use torch.optim.SGD with "
                "momentum=0 and give momentum/nesterov to the compressor instead"
            )


def own_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """gradzip talks over a process group of its own (same ranks and backend as the default group) so
    that its collectives, issued from the communication thread, never interleave with the script's."""
    if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.new_group()
    return group


def guard_momentum(state: GradzipState, params: Iterable[torch.Tensor]) -> None:
    """Make double momentum a checked error: any optimizer stepping these parameters with momentum raises."""
    global _guard_handle
    if state.compressor.feedback != "momentum":
        return
    for p in params:
        _momentum_corrected[p] = True
    if _guard_handle is None:
        _guard_handle = register_optimizer_step_pre_hook(_check_no_optimizer_momentum)


class DistributedOptimizer:
    """``DistributedOptimizer(optimizer, model.named_parameters(), compressor="topk", ratio=0.01)``.

    ``backward_passes_per_step``: gradients of that many backward passes are accumulated locally and
    exchanged once (their sum is averaged over workers, as in Horovod).  ``bucket_cap_mb`` bounds the fused
    buckets.  Other keyword arguments are the compressor's parameters.  Weight decay and any other
    optimizer term stay local: the optimizer applies them to the averaged gradient.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, compressor="none", *,
                 backward_passes_per_step: int = 1, bucket_cap_mb: float = 25.0,
                 group: Optional[dist.ProcessGroup] = None, seed: int = 0, **params):
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
        if named_parameters is None:
            named = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            named = [(n, p) for n, p in named_parameters if p.requires_grad]
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names; each parameter needs a unique name")
        known = set(in_optimizer)
        missing = [n for n, p in named if p not in known]
        if missing:
            raise ValueError(f"parameters not in the optimizer: {', '.join(missing[:5])}")
        self.optimizer = optimizer
        if params.get("transport") is None:
            group = own_group(group)
        self.state = GradzipState(compressor, group=group, seed=seed, **params)
        self.backward_passes_per_step = backward_passes_per_step
        self._buckets = _buckets(named, bucket_cap_mb * 2**20)
        self._bucket_of = {p: b for b, members in enumerate(self._buckets) for _, p in members}
        self._counts: dict = {}
        self._futures: dict[int, torch.futures.Future] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        guard_momentum(self.state, [p for _, p in named])

    # Delegation keeps the wrapper a drop-in replacement (param_groups, state, add_param_group, ...).
    def __getattr__(self, name):
        return getattr(self.__dict__["optimizer"], name)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._counts[p] = self._counts.get(p, 0) + 1
        if self._counts[p] == self.backward_passes_per_step:
            self._submit_ready()

    def _ready(self, b: int) -> bool:
        return all(self._counts.get(p, 0) >= self.backward_passes_per_step for _, p in self._buckets[b])

    def _submit_ready(self, force: bool = False) -> None:
        # Buckets go out strictly in index order, so every rank issues the same collectives in order.
        b = len(self._futures)
        while b < len(self._buckets) and (force or self._ready(b)):
            named = []
            for name, p in self._buckets[b]:
                if p.grad is None:  # unused on this rank: contributes zeros, gets the average
                    p.grad = torch.zeros_like(p)
                named.append((name, p.grad))
            self._futures[b] = self.state.submit(named, lambda aggregates: aggregates)
            b += 1

    def synchronize(self) -> None:
        """Finish all exchanges and write the averaged gradients into ``p.grad``."""
        self._submit_ready(force=True)
        for b, fut in sorted(self._futures.items()):
            for (_, p), aggregate in zip(self._buckets[b], fut.wait()):
                p.grad.copy_(aggregate)
        self._futures.clear()
        self._counts.clear()

    def step(self, closure=None):
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def set_epoch(self, epoch: int) -> None:
        self.state.set_epoch(epoch)

    def stats(self) -> dict:
        return self.state.stats()

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "gradzip": self.state.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.state.load_state_dict(state["gradzip"])


def _buckets(named, cap_bytes):
    """Reverse parameter order (roughly the order backward produces gradients), split at ``cap_bytes``."""
    buckets, current, size = [], [], 0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
