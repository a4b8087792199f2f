r"""DiLoCo: low-communication training, with gradzip compressing the outer exchange.

Each worker trains its own replica with its own (inner) optimizer; every ``sync_every`` steps the workers
average how far they moved and an outer optimizer moves a shared copy of the parameters by that much.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .compressors import make
from .state import GradzipState

__all__ = ["DiLoCo"]


def _partition(sizes: list[int], parts: int) -> list[range]:
    """Split tensor indices into ``parts`` contiguous non-empty runs whose element counts are balanced."""
    cum = [0, *itertools.accumulate(sizes)]  # cum[b]: elements before tensor b
    bounds = [0]
    for f in range(1, parts):
        target = cum[-1] * f / parts
        # Fragment f starts at tensor b: after the previous start, leaving one tensor per later fragment.
        candidates = range(bounds[-1] + 1, len(sizes) - (parts - f) + 1)
        bounds.append(min(candidates, key=lambda b: abs(cum[b] - target)))
    bounds.append(len(sizes))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class DiLoCo:
    r"""The outer loop of DiLoCo (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of
    Language Models"), with fragments synced at staggered steps as in Streaming DiLoCo (Douillard et al.
    2025, "Streaming DiLoCo with overlapping communication").  Call :meth:`step` after every
    ``inner_optimizer.step()``, the same number of times on every rank.

    Every worker keeps :math:`\theta_g` (fp32), the parameters as of the last sync.  When fragment
    :math:`f` is due, each worker forms the pseudo-gradient of each of its tensors,

    .. math::  \Delta_r = \theta_g - \theta_r \qquad (\theta_r\text{: this replica's parameters now}),

    gradzip exchanges it (``GradzipState.exchange``: the mean over ranks of the compressed
    :math:`\Delta_r`, with the method's error feedback), giving :math:`\bar\Delta`, and the outer step is
    SGD with Nesterov momentum :math:`\mu` and learning rate :math:`\eta`, as in PyTorch's SGD:

    .. math::  b \leftarrow \mu b + \bar\Delta, \qquad
               \theta_g \leftarrow \theta_g - \eta\,(\bar\Delta + \mu b)

    (without ``nesterov``: :math:`\theta_g \leftarrow \theta_g - \eta b`; with :math:`\mu = 0`:
    :math:`\theta_g \leftarrow \theta_g - \eta\bar\Delta`).  Then every replica loads :math:`\theta_g`.  All
    ranks get the same :math:`\bar\Delta` and do the same arithmetic in the same order, so replicas are
    bit-identical after each sync.  The inner optimizer's state stays local, as in the paper.

    ``fragments=F`` splits the parameters (in the model's order, balanced by element count) into F
    contiguous fragments; fragment f syncs at the inner steps t with
    :math:`(t - \lfloor fH/F \rfloor) \bmod H = 0`, H = ``sync_every``, with its own slice of :math:`b`.

    At construction every rank loads rank 0's parameters and buffers (of ``group``), so replicas start
    equal.  ``group``: the ranks whose replicas are averaged (None: all ranks, over the default group, so
    ``init_process_group(timeout=...)`` bounds how long a sync waits for a dead or stuck peer).
    Parameters with ``requires_grad=False`` at construction are not synced; buffers are not synced after
    construction.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *, sync_every: int,
                 compressor="none", outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 group: Optional[dist.ProcessGroup] = None, fragments: int = 1, overlap: bool = False,
                 seed: int = 0, **compressor_params):
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("DiLoCo takes the replica, not its DDP wrapper: pass ddp_model.module and "
                             "group= the ranks that hold the same replica slot on the other nodes")
        if not _is_int(sync_every) or sync_every < 1:
            raise ValueError(f"sync_every must be an int >= 1, got {sync_every!r}")
        if not isinstance(outer_lr, numbers.Real) or not outer_lr > 0:
            raise ValueError(f"outer_lr must be a number > 0, got {outer_lr!r}")
        if not isinstance(outer_momentum, numbers.Real) or not 0 <= outer_momentum < 1:
            raise ValueError(f"outer_momentum must be a number with 0 <= outer_momentum < 1, "
                             f"got {outer_momentum!r}")
        if overlap:
            raise ValueError("overlap=True (Streaming DiLoCo's exchange overlapped with inner steps) is not "
                             "implemented yet; use overlap=False")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        stepped = {id(p) for g in inner_optimizer.param_groups for p in g["params"]}
        if not any(id(p) in stepped for _, p in named):
            raise ValueError("inner_optimizer steps none of the model's trainable parameters; "
                             "build it from this model's parameters")
        if not _is_int(fragments) or not 1 <= fragments <= len(named):
            raise ValueError(f"fragments must be an int from 1 to the number of parameter tensors "
                             f"({len(named)}), got {fragments!r}")
        method = make(compressor, **compressor_params)
        if method.applies_momentum and outer_momentum > 0:
            raise ValueError(f"{method.name} applies momentum to the pseudo-gradient itself; use outer_momentum=0")

        self.sync_every, self.outer_lr = int(sync_every), float(outer_lr)
        self.outer_momentum, self.nesterov = float(outer_momentum), bool(nesterov)
        if group is None and dist.is_available() and dist.is_initialized():
            # Every collective runs on the caller's thread, in program order, so the default group is safe
            # to share; it also carries the timeout the script gave init_process_group.
            group = dist.group.WORLD
        self.group = group
        self.state = GradzipState(method, group=group, seed=seed)
        if self.state.world_size > 1:
            with torch.no_grad():
                for t in itertools.chain(model.parameters(), model.buffers()):
                    dist.broadcast(t, group_src=0, group=group)
        self.fragments = [[named[i] for i in run] for run in _partition([p.numel() for _, p in named], fragments)]
        self.offsets = [f * self.sync_every // fragments for f in range(fragments)]
        self.theta = {name: p.detach().to(torch.float32, copy=True) for name, p in named}
        self.momentum = {name: torch.zeros_like(t) for name, t in self.theta.items()} if outer_momentum else {}
        self.inner_steps = self.syncs = self.nonfinite_syncs = 0
        self.fragment_syncs = [0] * fragments
        self._ddp_bytes = sum(p.numel() * p.element_size() for _, p in named)

    @torch.no_grad()
    def step(self) -> tuple:
        """Count one inner step; sync the fragments that are due.  Returns their indices (empty: none)."""
        self.inner_steps += 1
        t, h = self.inner_steps, self.sync_every
        due = tuple(f for f, offset in enumerate(self.offsets) if (t - offset) % h == 0)
        if due:
            self._sync([pair for f in due for pair in self.fragments[f]])
            self.syncs += 1
            for f in due:
                self.fragment_syncs[f] += 1
        return due

    def _sync(self, named: list) -> None:
        deltas = [(name, self.theta[name] - p.float()) for name, p in named]
        try:
            means = self.state.exchange(deltas)
        except RuntimeError as exc:
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RuntimeError(f"DiLoCo: the sync at inner step {self.inner_steps} failed (a peer stopped, or did "
                               f"not reach it within the process group's timeout): {cause}") from exc
        if self.state.last_report.nonfinite:
            # Some replica's pseudo-gradient was NaN/Inf (or overflowed on the wire): theta_g and b stay,
            # and every replica of these tensors restarts from theta_g, so they stay identical.
            self.nonfinite_syncs += 1
        else:
            for (name, _), mean in zip(named, means):
                update = mean
                if self.outer_momentum:
                    buf = self.momentum[name].mul_(self.outer_momentum).add_(mean)
                    update = mean.add(buf, alpha=self.outer_momentum) if self.nesterov else buf
                self.theta[name].add_(update, alpha=-self.outer_lr)
        for name, p in named:
            p.copy_(self.theta[name])

    def stats(self) -> dict:
        """gradzip's counters for the outer exchanges (``bytes_sent`` per worker, ``ratio``, …) plus
        ``syncs``, ``fragment_syncs``, ``inner_steps``, ``nonfinite_syncs``, ``bytes_per_inner_step`` and
        ``ddp_bytes_per_inner_step`` (what plain DDP hands its allreduce each step, for comparison)."""
        s = self.state.stats()
        s.update(syncs=self.syncs, fragment_syncs=list(self.fragment_syncs), inner_steps=self.inner_steps,
                 nonfinite_syncs=self.nonfinite_syncs, ddp_bytes_per_inner_step=self._ddp_bytes,
                 bytes_per_inner_step=s["bytes_sent"] / self.inner_steps if self.inner_steps else 0.0)
        return s

    def state_dict(self) -> dict:
        """theta_g, the outer momentum, gradzip's state (error feedback) and the counters; loads with
        ``torch.load(..., weights_only=True)``.  The replica and the inner optimizer are saved by the script."""
        return {"sync_every": self.sync_every, "fragments": len(self.fragments), "inner_steps": self.inner_steps,
                "syncs": self.syncs, "nonfinite_syncs": self.nonfinite_syncs,
                "fragment_syncs": list(self.fragment_syncs),
                "theta": {k: v.clone() for k, v in self.theta.items()},
                "momentum": {k: v.clone() for k, v in self.momentum.items()},
                "gradzip": self.state.state_dict()}

    def load_state_dict(self, state: dict, *, any_rank: bool = False) -> None:
        """Load a :meth:`state_dict`.  theta_g and the momentum are equal on every rank, the error feedback
        is this rank's own: load each rank's own file (``any_rank``: see ``GradzipState.load_state_dict``)."""
        mine = (self.sync_every, len(self.fragments), sorted(self.theta), sorted(self.momentum))
        saved = (state["sync_every"], state["fragments"], sorted(state["theta"]), sorted(state["momentum"]))
        if mine != saved:
            raise ValueError("this DiLoCo state_dict was saved with another sync_every, fragments, "
                             "parameter set or outer momentum")
        for name in self.theta:
            self.theta[name].copy_(state["theta"][name])
        for name in self.momentum:
            self.momentum[name].copy_(state["momentum"][name])
        self.state.load_state_dict(state["gradzip"], any_rank=any_rank)
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.nonfinite_syncs = int(state["nonfinite_syncs"])
        self.fragment_syncs = [int(n) for n in state["fragment_syncs"]]
