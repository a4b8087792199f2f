r"""DiLoCo: low-communication training, with gradzip compressing the outer exchange.

Each worker trains its own replica with its own (inner) optimizer; every ``sync_every`` steps the workers
average how far they moved and an outer optimizer moves a shared copy of the parameters by that much.
"""
from __future__ import annotations

import functools
import itertools
import logging
import numbers
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import devices
from ..compressors import make
from ..state import GradzipState
from .ddp import uncompiled

__all__ = ["DiLoCo", "check_options", "OPTIONS"]

_log = logging.getLogger(__name__)


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


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# DiLoCo's options that do not depend on the model: (check, what the value must be).
OPTIONS = {
    "sync_every": (lambda v: _is_int(v) and v >= 1, "an int >= 1"),
    "fragments": (lambda v: _is_int(v) and v >= 1, "an int from 1 to the number of parameter tensors"),
    "outer_lr": (lambda v: _is_number(v) and v > 0, "a number > 0"),
    "outer_momentum": (lambda v: _is_number(v) and 0 <= v < 1, "a number with 0 <= outer_momentum < 1"),
    "nesterov": (lambda v: isinstance(v, bool), "True or False"),
    "overlap": (lambda v: isinstance(v, bool), "True or False"),
    "merge_alpha": (lambda v: _is_number(v) and 0 <= v < 1, "a number with 0 <= merge_alpha < 1"),
}


def check_options(**options) -> None:
    """Raise a one-line ValueError for a bad value of a :class:`DiLoCo` option in ``OPTIONS`` (or a bad
    combination of them); ``gradzip train --outer`` calls it too, to fail before any worker starts."""
    for key, value in options.items():
        check, what = OPTIONS[key]
        if not check(value):
            raise ValueError(f"{key} must be {what}, got {value!r}")
    if options.get("overlap") and options.get("sync_every", 2) < 2:
        raise ValueError("overlap=True needs sync_every >= 2 (a fragment's exchange is merged one inner step "
                         f"after it starts, before the fragment is due again), got {options['sync_every']}")
    if options.get("merge_alpha") and not options.get("overlap"):
        raise ValueError("merge_alpha mixes a late exchange into the replica: it needs overlap=True")


def _unless(bad, target: torch.Tensor, new: torch.Tensor) -> None:
    """``target = new`` unless ``bad``: a device bool (then a select there, nothing read on the host) or a
    host one already known to be False."""
    target.copy_(torch.where(bad, target, new) if isinstance(bad, torch.Tensor) else new)


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

    ``overlap=True`` is Streaming DiLoCo's overlapped exchange with delay :math:`\tau = 1`: a due fragment's
    :math:`\Delta_r` is taken at step t and exchanged on gradzip's communication thread (and its own
    process group) while the script computes inner step t+1; the outer step then gives the new
    :math:`\theta_g`, and at step t+1 the replica merges it with what it learned meanwhile,

    .. math::  \theta_r \leftarrow \alpha\,\theta_r + (1 - \alpha)\,\theta_g \qquad (\alpha = ``merge\_alpha``)

    (:math:`\alpha = 0`: the replica takes :math:`\theta_g` and is bit-identical across ranks again; the
    inner step made during the exchange is dropped for that fragment).  It needs ``sync_every >= 2``, so a
    fragment's merge comes before it is due again.  :meth:`wait` merges an exchange still in flight (call it
    before using the model after the last step).

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
                 compressor="none", outer_lr: float = 0.7, outer_momentum: float = 0.5, nesterov: bool = True,
                 group: Optional[dist.ProcessGroup] = None, fragments: int = 1, overlap: bool = False,
                 merge_alpha: float = 0.0, seed: int = 0, **compressor_params):
        model = uncompiled(model)  # torch.compile(model): state named as the model's own parameters
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ValueError("DiLoCo takes the replica, not its DDP wrapper: pass ddp_model.module and "
                             "group= the ranks that hold the same replica slot on the other nodes")
        check_options(sync_every=sync_every, fragments=fragments, outer_lr=outer_lr, outer_momentum=outer_momentum,
                      nesterov=nesterov, overlap=overlap, merge_alpha=merge_alpha)
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        stepped = {id(p) for g in inner_optimizer.param_groups for p in g["params"]}
        if not any(id(p) in stepped for _, p in named):
            raise ValueError("inner_optimizer steps none of the model's trainable parameters; "
                             "build it from this model's parameters")
        if fragments > len(named):
            raise ValueError(f"fragments must be an int from 1 to the number of parameter tensors "
                             f"({len(named)}), got {fragments!r}")
        method = make(compressor, **compressor_params)
        if method.applies_momentum and outer_momentum > 0:
            raise ValueError(f"{method.name} applies momentum to the pseudo-gradient itself; use outer_momentum=0")

        self.sync_every, self.outer_lr = int(sync_every), float(outer_lr)
        self.outer_momentum, self.nesterov = float(outer_momentum), bool(nesterov)
        self.overlap, self.merge_alpha = bool(overlap), float(merge_alpha)
        if group is None and not overlap and dist.is_available() and dist.is_initialized():
            # Every collective runs on the caller's thread, in program order, so the default group is safe
            # to share; it also carries the timeout the script gave init_process_group.  Overlapped
            # exchanges run on gradzip's thread: GradzipState then makes a group of its own.
            group = dist.group.WORLD
        self.group = group
        self.state = GradzipState(method, group=group, seed=seed)
        if overlap and not self.state.transport.issues_beside_other_groups(torch.device("cuda")):
            # On NCCL the overlapped exchange is issued from step() on gradzip's stream, not from its
            # thread: the inner steps' own collectives (DDP within a node, a script's) then keep program
            # order beside it on every rank.  The GPU still overlaps them; the bucket route waits for nothing.
            self.state.issues_inline = True
        self._pending: Optional[tuple] = None  # overlap: (fragments, their step, the exchange's future)
        # overlap: the pseudo-gradients in flight, kept until the exchange is waited for.  Made on the
        # caller's stream and read on gradzip's, freed earlier their memory would go back to the
        # caller's stream at once, where the next inner step could write it before they were read.
        self._sent: Optional[list] = None
        if self.state.world_size > 1:
            source = 0 if group is None else dist.get_global_rank(group, 0)  # (group_src: torch >= 2.6 only)
            with torch.no_grad():
                for t in itertools.chain(model.parameters(), model.buffers()):
                    dist.broadcast(t, src=source, group=group)
        self.fragments = [[named[i] for i in run] for run in _partition([p.numel() for _, p in named], fragments)]
        self.offsets = [f * self.sync_every // fragments for f in range(fragments)]
        self.theta = {name: p.detach().to(torch.float32, copy=True) for name, p in named}
        self.momentum = {name: torch.zeros_like(t) for name, t in self.theta.items()} if outer_momentum else {}
        self.inner_steps = self.syncs = 0
        self._nonfinite_syncs = 0
        self._skips_on_device: Optional[torch.Tensor] = None  # merges' device skip flags, summed there
        self.fragment_syncs = [0] * fragments
        self._ddp_bytes = sum(p.numel() * p.element_size() for _, p in named)
        _log.info("gradzip.DiLoCo: sync_every=%d, fragments=%d, outer_lr=%g, outer_momentum=%g, overlap=%s; "
                  "outer exchange: %s", self.sync_every, fragments, self.outer_lr, self.outer_momentum, self.overlap,
                  self.state.describe(as_text=True))

    @torch.no_grad()
    def step(self) -> tuple:
        """Count one inner step; sync the fragments that are due (with ``overlap``: start their exchange, and
        merge the one started at the previous step).  Returns the due fragments' indices (empty: none)."""
        self.inner_steps += 1
        self._merge()
        t, h = self.inner_steps, self.sync_every
        due = tuple(f for f, offset in enumerate(self.offsets) if (t - offset) % h == 0)
        if due:
            named = self._tensors(due)
            deltas = [(name, self.theta[name] - p.float()) for name, p in named]
            if self.overlap:
                names = [name for name, _ in named]
                # compiles=False: a kernel compiled in-process meanwhile would change how the inner steps
                # running beside the exchange round (torch.compiler.is_compiling() is process-wide)
                on = next((d.device for _, d in deltas if devices.cuda(d)), None)  # the future's device
                self._pending = (due, t, self.state.submit(deltas, functools.partial(self._outer_step_written, names, on),
                                                           compiles=False))
                self._sent = deltas
            else:
                self._load(named, self._exchange(deltas, t))
            self.syncs += 1
            for f in due:
                self.fragment_syncs[f] += 1
        return due

    def _tensors(self, fragments) -> list:
        """(name, parameter) of every tensor of these fragments, in order."""
        return [pair for f in fragments for pair in self.fragments[f]]

    def _exchange(self, deltas: list, step: int) -> bool:
        """Exchange the pseudo-gradients and take the outer step; returns whether it was skipped."""
        try:
            return self._outer_step([name for name, _ in deltas], self.state.exchange(deltas))
        except RuntimeError as exc:
            raise self._failed(exc, step) from exc

    @staticmethod
    def _failed(exc: BaseException, step: int) -> RuntimeError:
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return RuntimeError(f"DiLoCo: the sync at inner step {step} failed (a peer stopped, or did not reach it "
                            f"within the process group's timeout): {cause}")

    def _outer_step(self, names: list, means: list):
        """theta_g -= outer_lr * (Nesterov) momentum step on the mean pseudo-gradients; runs on gradzip's
        thread under ``overlap``.  Returns whether the exchange was not finite and nothing moved: a bool,
        or where the exchange left that on the device (the bucket route), a device bool, the step then
        taken or not by a select there, so that issuing it waits for nothing."""
        bad = self.state.last_report.nonfinite
        if not isinstance(bad, torch.Tensor) and bad:
            # Some replica's pseudo-gradient was NaN/Inf (or overflowed on the wire): theta_g and b stay,
            # and every replica of these tensors restarts from theta_g, so they stay identical.
            return True
        for name, mean in zip(names, means):
            update = mean
            if self.outer_momentum:
                buf = self.momentum[name].mul(self.outer_momentum).add_(mean)
                update = mean.add(buf, alpha=self.outer_momentum) if self.nesterov else buf
                _unless(bad, self.momentum[name], buf)
            _unless(bad, self.theta[name], self.theta[name].add(update, alpha=-self.outer_lr))
        return bad

    def _outer_step_written(self, names: list, device, means: list) -> tuple:
        """:meth:`_outer_step` under ``overlap``: (whether it skipped, the tensors it may have written on
        ``device``, the future's GPU).  Those tensors are what orders a CUDA-aware future: waiting on it
        makes the waiter's stream wait for gradzip's stream's writes to the devices of the tensors in its
        value, and a bool has none (one on another GPU than the future's it refuses)."""
        written = [self.theta[n] for n in names] + [self.momentum[n] for n in names if n in self.momentum]
        return self._outer_step(names, means), [t for t in written if t.device == device]

    def _load(self, named: list, skipped, alpha: float = 0.0) -> None:
        """Every replica takes theta_g for these tensors (mixed with its own by ``alpha``; not after a
        skipped exchange).  ``skipped`` a device bool (the bucket route's): decided by a select there,
        and counted there, so that a merge waits for nothing on the host."""
        on_device = isinstance(skipped, torch.Tensor)
        if on_device:
            counted = self._skips_on_device
            self._skips_on_device = skipped.long() if counted is None else counted.add_(skipped)
        else:
            self._nonfinite_syncs += int(skipped)
        for name, p in named:
            theta = self.theta[name].to(p.dtype)
            if alpha and (on_device or not skipped):
                mixed = p.mul(alpha).add_(theta, alpha=1 - alpha)
                p.copy_(torch.where(skipped, theta, mixed) if on_device else mixed)
            else:
                p.copy_(theta)

    @property
    def nonfinite_syncs(self) -> int:
        """Syncs whose exchange was not finite on some rank: skipped on every rank."""
        if self._skips_on_device is not None:  # read on the host here, where a count is asked for
            self._nonfinite_syncs += int(self._skips_on_device)
            self._skips_on_device = None
        return self._nonfinite_syncs

    @nonfinite_syncs.setter
    def nonfinite_syncs(self, count: int) -> None:
        self._nonfinite_syncs, self._skips_on_device = int(count), None

    def _settle(self) -> Optional[bool]:
        """Wait for the exchange in flight (theta_g is then current); None when there is none."""
        if self._pending is None:
            return None
        _, step, fut = self._pending
        try:
            return fut.wait()[0]  # the caller's stream now waits for gradzip's: the inputs may go
        except RuntimeError as exc:
            self._pending = None
            raise self._failed(exc, step) from exc
        finally:  # after a failure gradzip's stream may still read them: the job is ending anyway
            self._sent = None

    def _merge(self) -> None:
        skipped = self._settle()
        if skipped is not None:
            due, _, _ = self._pending
            self._pending = None
            self._load(self._tensors(due), skipped, self.merge_alpha)

    @torch.no_grad()
    def wait(self) -> None:
        """``overlap``: finish the exchange in flight and merge it into the replica now (after the last
        step, before evaluating or saving the model).  Without one: nothing."""
        self._merge()

    def global_parameters(self) -> dict:
        """theta_g by parameter name (fp32, equal on every rank; each fragment as of its last sync), after
        any exchange in flight has updated it.  The live tensors: copy them to keep them."""
        self._settle()
        return self.theta

    def close(self) -> None:
        """Finish any exchange in flight and stop gradzip's thread and process group (also done at exit)."""
        try:
            self._settle()
        finally:
            self.state.close()

    def stats(self) -> dict:
        """gradzip's counters for the outer exchanges (``bytes_sent`` per worker, ``ratio``, …) plus
        ``syncs``, ``fragment_syncs``, ``inner_steps``, ``nonfinite_syncs``, ``bytes_per_inner_step`` and
        ``ddp_bytes_per_inner_step`` (what plain DDP hands its allreduce each step, for comparison)."""
        s = self.state.stats()
        s.update(syncs=self.syncs, fragment_syncs=list(self.fragment_syncs), inner_steps=self.inner_steps,
                 nonfinite_syncs=self.nonfinite_syncs, ddp_bytes_per_inner_step=self._ddp_bytes,
                 bytes_per_inner_step=s["bytes_sent"] / self.inner_steps if self.inner_steps else 0.0)
        return s

    def state_dict(self, *, all_ranks: bool = False) -> dict:
        """theta_g, the outer momentum, gradzip's state (error feedback) and the counters; loads with
        ``torch.load(..., weights_only=True)``.  ``all_ranks=True`` (a collective) holds every rank's error
        feedback, so that one file serves every rank, also on another number of ranks.  The replica and the inner optimizer are saved by the script.
        An overlapped exchange in flight is finished first and saved as pending: it merges into the replica
        at the next :meth:`step`, in the resumed run as in this one."""
        skipped = self._settle()
        pending = [] if self._pending is None else list(self._pending[0])
        return {"pending": pending, "pending_step": self._pending[1] if pending else 0,
                "pending_skipped": bool(skipped),
                "sync_every": self.sync_every, "fragments": len(self.fragments), "inner_steps": self.inner_steps,
                "syncs": self.syncs, "nonfinite_syncs": self.nonfinite_syncs,
                "fragment_syncs": list(self.fragment_syncs),
                "theta": {k: v.clone() for k, v in self.theta.items()},
                "momentum": {k: v.clone() for k, v in self.momentum.items()},
                "gradzip": self.state.state_dict(all_ranks=all_ranks)}

    def load_state_dict(self, state: dict, *, any_rank: bool = False) -> None:
        """Load a :meth:`state_dict`.  theta_g and the momentum are equal on every rank, the error feedback
        is this rank's own: load each rank's own file, or one saved with ``all_ranks=True``
        (``any_rank``: see ``GradzipState.load_state_dict``)."""
        lacking = [key for key in ("sync_every", "fragments", "theta", "momentum", "gradzip", "inner_steps", "syncs",
                                   "nonfinite_syncs", "fragment_syncs") if key not in state]
        if lacking:
            raise ValueError(f"not a DiLoCo state_dict (from DiLoCo.state_dict()): it has no {', '.join(lacking)}")
        mine = (self.sync_every, len(self.fragments), sorted(self.theta), sorted(self.momentum))
        saved = (state["sync_every"], state["fragments"], sorted(state["theta"]), sorted(state["momentum"]))
        if mine != saved:
            raise ValueError("this DiLoCo state_dict was saved with another sync_every, fragments, "
                             "parameter set or outer momentum")
        reshaped = [name for kind in ("theta", "momentum") for name, t in getattr(self, kind).items()
                    if tuple(state[kind][name].shape) != tuple(t.shape)]
        if reshaped:
            raise ValueError(f"this DiLoCo state_dict holds other shapes for {', '.join(reshaped[:5])}: it was "
                             "saved for another model")
        if state.get("pending") and not self.overlap:
            raise ValueError("this DiLoCo state_dict holds an overlapped exchange to merge: load it with overlap=True")
        self._settle()  # an exchange in flight would write theta_g and b after they are loaded
        self.state.load_state_dict(state["gradzip"], any_rank=any_rank)  # first: it checks what it loads
        for name in self.theta:
            self.theta[name].copy_(state["theta"][name])
        for name in self.momentum:
            self.momentum[name].copy_(state["momentum"][name])
        self.inner_steps, self.syncs = int(state["inner_steps"]), int(state["syncs"])
        self.nonfinite_syncs = int(state["nonfinite_syncs"])
        self.fragment_syncs = [int(n) for n in state["fragment_syncs"]]
        self._pending = None
        if state.get("pending"):
            done: torch.futures.Future = torch.futures.Future()
            done.set_result((bool(state["pending_skipped"]), []))  # as _outer_step_written's
            self._pending = (tuple(int(f) for f in state["pending"]), int(state["pending_step"]), done)
