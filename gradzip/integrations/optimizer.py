"""Horovod-style integration: wrap any optimizer so ``step()`` averages compressed gradients first.

For code that does not use DistributedDataParallel (Horovod's design: the optimizer, not a model wrapper,
averages the gradients).  Gradients are exchanged in buckets as soon as every gradient of a bucket is
accumulated (overlapping the rest of backward), on the state's single communication thread, in bucket
order on every rank.
"""
from __future__ import annotations

import logging
import sys
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from .. import feedback as _feedback
from ..state import GradzipState
from .momentum_guard import guard_momentum, release_momentum

__all__ = ["DistributedOptimizer"]

_log = logging.getLogger(__name__)


def _is_dtensor(p: torch.Tensor) -> bool:
    # DTensor's module takes half a second to import, in every process that imports gradzip: a
    # parameter can be a DTensor only once something else has imported it
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)  # None in an older torch
    return dtensor is not None and isinstance(p, dtensor)


class DistributedOptimizer(torch.optim.Optimizer):
    """``DistributedOptimizer(optimizer, model.named_parameters(), compressor="topk", ratio=0.01)``.

    A ``torch.optim.Optimizer`` that wraps ``optimizer`` (it is not copied: ``param_groups``, ``defaults``
    and ``state`` are the wrapped optimizer's own objects), so LR schedulers, ``torch.amp.GradScaler``,
    ``state_dict`` and hooks work as with any optimizer.  As with DDP, when ``backward()`` returns, ``p.grad``
    holds the gradient averaged over the workers (identical on every rank), so ``GradScaler.unscale_`` and
    ``clip_grad_norm_`` see the average.  gradzip's own compression state is ``gradzip_state``.

    ``backward_passes_per_step``: gradients of that many backward passes are accumulated locally and
    exchanged at the end of the last one (their sum is averaged over workers, as in Horovod).
    ``bucket_cap_mb`` bounds the fused buckets.  Other keyword arguments are :class:`GradzipState`'s
    (``grad_scaler=`` under ``torch.amp.GradScaler``: the exchange sees scaled gradients) and the
    compressor's parameters.
    Weight decay and any other optimizer term stay local: the optimizer applies them to the averaged
    gradient.  If any rank's gradients hold NaN or Inf, every rank gets NaN gradients for that step, so
    ``GradScaler`` skips it everywhere.
    """

    # GradScaler unscales and checks the averaged gradients itself, then calls step() (a fused inner
    # optimizer is then given unscaled gradients, which it handles).
    _step_supports_amp_scaling = False

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, compressor="none", *,
                 backward_passes_per_step: int = 1, bucket_cap_mb: float = 25.0,
                 group: Optional[dist.ProcessGroup] = None, seed: int = 0, **params):
        from collections import OrderedDict

        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a gradzip.DistributedOptimizer")
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        in_optimizer = [p for g in optimizer.param_groups for p in g["params"]]
        if any(map(_is_dtensor, in_optimizer)):
            raise ValueError("DistributedOptimizer needs plain (replicated) parameters, got DTensor shards "
                             "(FSDP2 / tensor parallel), which gradzip does not support; use it with "
                             "replicated models (no DDP) or gradzip.register() on a DDP model")
        if named_parameters is None:
            given = [(f"param.{i}", p) for i, p in enumerate(in_optimizer)]
        else:
            given = list(named_parameters)
            bad = next((item for item in given if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(
                item[0], str) and isinstance(item[1], torch.Tensor))), None)
            if bad is not None:
                what = (f"a pair of {', '.join(type(x).__name__ for x in bad)}" if isinstance(bad, (tuple, list))
                        and len(bad) == 2 else f"a {type(bad).__name__}")
                raise TypeError("named_parameters must give (name, parameter) pairs, as model.named_parameters() "
                                f"does; got {what}")
        seen: set = set()  # a tensor twice (tied weights): its first name, at its first place
        given = [(n, p) for n, p in given if not (p in seen or seen.add(p))]
        names = [n for n, _ in given]
        if len(set(names)) != len(names):
            raise ValueError("named_parameters has duplicate names; each parameter needs a unique name")
        known = set(in_optimizer)
        missing = [n for n, p in given if p not in known and p.requires_grad]
        if missing:
            raise ValueError(f"parameters not in the optimizer: {', '.join(missing[:5])}")
        unnamed = known - {p for _, p in given}
        trained = sum(p.requires_grad for p in unnamed)
        if trained:
            raise ValueError(f"{trained} parameter(s) of the optimizer are not in named_parameters: each needs a "
                             "name, or its gradient would not be averaged (name them all, e.g. with "
                             "model.named_parameters() of the model holding them)")
        named = [(n, p) for n, p in given if p.requires_grad]
        # Frozen now, perhaps trained later (a layer unfrozen during fine-tuning): hooked once it is; one
        # without a name then raises.
        self._frozen = [(n, p) for n, p in given if not p.requires_grad and p in known]
        self._unnamed_frozen = list(unnamed)
        # What torch.optim.Optimizer.__init__ sets up, except the parameters: param_groups, defaults and
        # state are properties reading the wrapped optimizer (its load_state_dict replaces the objects).
        self.optimizer = optimizer
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()  # step() runs the global and this wrapper's step hooks
        self._warned_capturable_if_run_uncaptured = True

        self.gradzip_state = GradzipState(compressor, group=group, seed=seed, **params)
        self.backward_passes_per_step = backward_passes_per_step
        self._cap_bytes = bucket_cap_mb * 2**20
        self._buckets: list = []
        self._bucket_of: dict = {}
        self._handles: list = []
        self._counts: dict = {}
        self._futures: dict[int, torch.futures.Future] = {}
        self._passes = 0                # backward passes that produced gradients since the last exchange
        self._callback_queued = False   # the end-of-backward callback of the running pass
        self._synchronized = False      # p.grad holds an average produced since the last step()
        self._add_parameters(named)
        _log.info("gradzip.DistributedOptimizer: %s; %d parameter tensors in %d buckets",
                  self.gradzip_state.describe(as_text=True), len(named), len(self._buckets))

    # param_groups, defaults and state are the wrapped optimizer's very objects.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    def __getattr__(self, name):
        # Anything else the wrapped optimizer has (its own methods and attributes).
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, compressor={self.gradzip_state.compressor.name!r})"

    def _add_parameters(self, named) -> None:
        """Bucket these parameters after the existing buckets and hook them."""
        first = len(self._buckets)
        self._buckets.extend(_buckets(named, self._cap_bytes))
        for b in range(first, len(self._buckets)):
            for _, p in self._buckets[b]:
                self._bucket_of[p] = b
        self._handles.extend(p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named)
        guard_momentum(self.gradzip_state, [p for _, p in named])

    # -- the exchange, driven by autograd ---------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.layout != torch.strided:
            name = next(n for n, q in self._buckets[self._bucket_of[p]] if q is p)
            raise ValueError(f"gradzip compresses dense gradients, and the parameter {name!r} has a sparse one "
                             "(nn.Embedding(sparse=True)?); make it dense (sparse=False)")
        if not self._callback_queued:
            # Runs when this backward pass ends, before backward() returns (as DDP's reducer does).
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._counts[p] = self._counts.get(p, 0) + 1
        if self._counts[p] == self.backward_passes_per_step:
            self._submit_ready()

    def _queue_end(self, *_) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        outer = _outer_node()
        if outer is not None:  # reentrant checkpointing: an inner pass ends inside the outer pass's node,
            outer.register_hook(self._queue_end)  # whose end, once that node is done, is the pass's
            return
        self._callback_queued = False
        self._passes += 1
        if self._passes >= self.backward_passes_per_step:
            self._finish()

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
            # The averages are written into p.grad itself, which no one reads before _finish waits.
            self._futures[b] = self.gradzip_state.submit(named, lambda aggregates: aggregates,
                                                         out=[g for _, g in named])
            b += 1

    def _pending(self) -> bool:
        return bool(self._counts or self._futures or self._passes)

    def _finish(self) -> None:
        """Submit the buckets still due (unused parameters: zeros), wait for all, write ``p.grad``."""
        if any(p.requires_grad for p in self._unnamed_frozen):
            raise ValueError("a parameter of the optimizer that has no name in named_parameters was unfrozen: its "
                             "gradient would not be averaged; name every parameter the optimizer steps")
        unfrozen = [(n, p) for n, p in self._frozen if p.requires_grad]
        if unfrozen:  # every rank unfreezes at the same step: their buckets go out after the others
            self._frozen = [(n, p) for n, p in self._frozen if not p.requires_grad]
            self._add_parameters(unfrozen)
        try:
            self._submit_ready(force=True)
            with torch.no_grad():
                for b, fut in sorted(self._futures.items()):
                    for (_, p), aggregate in zip(self._buckets[b], fut.wait()):
                        if aggregate is not p.grad:  # p.grad was replaced while the exchange ran
                            p.grad.copy_(aggregate)
        finally:
            self._futures.clear()
            self._counts.clear()
            self._passes = 0
        self._synchronized = True

    def synchronize(self) -> None:
        """Finish all exchanges and write the averaged gradients into ``p.grad``.

        The end of the backward pass that completes a step does this by itself, so this is needed only
        to average early (fewer than ``backward_passes_per_step`` passes) or gradients set without
        backward; when ``p.grad`` already holds this step's average it does nothing.
        """
        if self._synchronized and not self._pending():
            return
        self._finish()

    # -- torch.optim.Optimizer interface ----------------------------------------------------------------
    def step(self, closure=None, **kwargs):
        # Exchange here only what backward left pending (fewer passes than backward_passes_per_step), or
        # gradients that no backward produced since the last step (set by hand).  With a closure the
        # closure's own backward exchanges its gradients.
        if self._pending() or (closure is None and not self._synchronized):
            self._finish()
        try:
            if closure is None:
                return self.optimizer.step(**kwargs)
            return self.optimizer.step(closure, **kwargs)
        finally:
            self._synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._callback_queued or self._pending():
            self._discard()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def _discard(self) -> None:
        """Forget the passes counted since the last step: a backward that raised (out of memory, an
        interrupt) never reached its end, and its counts would make the next pass's buckets go out
        early or not at all.  Its exchanges are finished first, every bucket sent (zeros where no gradient
        came) so that ranks that stopped at different buckets still issue the same collectives: they write
        into ``p.grad``."""
        try:
            self._submit_ready(force=True)
        except Exception:  # noqa: BLE001 - a closed state: nothing to finish
            pass
        for fut in self._futures.values():
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - its gradients are being discarded with it
                pass
        self._futures.clear()
        self._counts.clear()
        self._passes = 0
        self._callback_queued = False
        self._synchronized = False

    def add_param_group(self, param_group: dict) -> None:
        """Add a parameter group to the wrapped optimizer; its parameters are exchanged like the others,
        in buckets after the existing ones, named by the group's ``param_names`` if it has them, else
        ``param_group{g}.{i}``."""
        groups = self.optimizer.param_groups
        g = len(groups)
        self.optimizer.add_param_group(param_group)
        added = groups[g]
        names = added.get("param_names") or [f"param_group{g}.{i}" for i in range(len(added["params"]))]
        pairs = list(zip(names, added["params"]))
        taken = {n for bucket in self._buckets for n, _ in bucket} | {n for n, _ in self._frozen}
        clash = [n for n, _ in pairs if n in taken]
        if clash or len({n for n, _ in pairs}) != len(pairs):
            groups.pop(g)
            raise ValueError(f"parameter names already in use: {', '.join(clash[:5]) or 'duplicates in the group'}")
        self._add_parameters([(n, p) for n, p in pairs if p.requires_grad])
        self._frozen.extend((n, p) for n, p in pairs if not p.requires_grad)

    def state_dict(self, *, all_ranks: bool = False) -> dict:
        """The wrapped optimizer's ``state_dict()`` plus ``"gradzip"``: ``gradzip_state.state_dict()``
        (``all_ranks=True``: every rank's part, a collective; see ``GradzipState.state_dict``)."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = dict(self.optimizer.state_dict())
        state_dict["gradzip"] = self.gradzip_state.state_dict(all_ranks=all_ranks)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict`; a plain state dict of the wrapped optimizer (no ``"gradzip"``)
        loads into it and leaves the gradzip state as it is, with a warning where that state is fresh
        and the method keeps error feedback (the residuals of the saved run are then lost)."""
        state_dict = dict(state_dict)
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        gradzip_state = state_dict.pop("gradzip", None)
        if "optimizer" in state_dict and "param_groups" not in state_dict:
            state_dict = state_dict["optimizer"]  # saved by gradzip < this version
        self.optimizer.load_state_dict(state_dict)
        if gradzip_state is not None:
            self.gradzip_state.load_state_dict(gradzip_state)
        elif not self.gradzip_state.steps and _feedback.scheme_of(self.gradzip_state.compressor).state_keys:
            warnings.warn("DistributedOptimizer.load_state_dict: this state dict holds no gradzip state (no "
                          "'gradzip' key), so gradzip's error feedback starts from zero; save "
                          "opt.state_dict() itself (or state_dict(all_ranks=True)) to resume it", stacklevel=2)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    # -- gradzip ----------------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.gradzip_state.set_epoch(epoch)

    def stats(self) -> dict:
        return self.gradzip_state.stats()

    def close(self) -> None:
        """Stop gradzip's communication thread (see :meth:`GradzipState.close`) and take gradzip's hooks
        off the parameters, so that a new wrapper of the same model exchanges them alone."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        release_momentum(self.gradzip_state, [p for bucket in self._buckets for _, p in bucket])
        self.gradzip_state.close()


def _outer_node():
    """The node of another backward pass inside which the pass ending now ran (reentrant activation
    checkpointing re-runs a segment's forward and backward there), or None (also where torch cannot say)."""
    current = getattr(torch._C, "_current_autograd_node", None)
    return current() if current is not None else None


def _buckets(named, cap_bytes):
    """Reverse parameter order (roughly the order backward produces gradients), split at ``cap_bytes``
    and where the device changes (a model spread over several GPUs of one process: a bucket is fused,
    and waited for, on one device)."""
    buckets, current, size = [], [], 0
    for name, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > cap_bytes or p.device != current[-1][1].device):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
