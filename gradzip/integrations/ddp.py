"""DistributedDataParallel integration: a communication hook.

Two ways to install it, with the same numerics (but for ``none``, see below):

    state = gradzip.register(ddp_model, "powersgd", rank=2)
    ddp_model.register_comm_hook(gradzip.GradzipState("topk", ratio=0.01), gradzip.ddp_comm_hook)

With ``none`` the first installs no hook: DDP's own allreduce is that exchange (DDP's bits, which for N
ranks not a power of two differ from the hook's division by N in the last bit of some elements), and
the state counts it.
The second is what frameworks that take a ``(state, hook)`` pair use (Lightning's
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``).  The hook hands each bucket's gradients (layer by
layer, so methods that need a layer's shape get it) to the state's communication thread and returns a
future at once, so compression and exchange overlap the rest of backward.  DDP launches bucket hooks in
bucket order on every rank and the thread serves them first-in first-out, so the collectives of all
buckets are issued in the same order on every rank — even for multi-phase methods such as PowerSGD,
whose chained future callbacks reorder them in PyTorch's hook.
"""

import functools
import logging
import os
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.nn.parallel.distributed import _find_tensors

from .. import collectives, devices
from ..state import GradzipState
from .momentum_guard import guard_momentum

__all__ = ["register", "ddp_comm_hook", "uncompiled"]

_log = logging.getLogger(__name__)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (its ``OptimizedModule``'s ``_orig_mod``), or ``module`` itself:
    the same parameters, under the names the uncompiled model gives them."""
    while isinstance(module, torch.nn.Module) and hasattr(module, "_orig_mod"):
        module = module._orig_mod
    return module


def register(ddp_model: DistributedDataParallel, compressor="none", *, group: "Optional[dist.ProcessGroup]" = None,
             seed: int = 0, resume=None, **params) -> GradzipState:
    """Install gradzip as ``ddp_model``'s communication hook and return its state.

    Where DDP's own allreduce is the exchange for ever (``none``; ``fp16`` or ``bf16`` without error
    feedback on gradients already in that dtype) no hook is installed: DDP averages in C++ and the
    state counts each synced backward step as one plain allreduce of every gradient per dtype.

    gradzip averages over DDP's process group (over ``group`` when given), through a process group of
    its own with the same ranks: its thread's collectives never meet DDP's own on one group (a given
    ``group`` other than DDP's is used as it is; the copy of a DDP group of fewer than all ranks lives
    until ``destroy_process_group()``).  The state's keys are
    the model's parameter names.  Use the state as a context manager, or call ``state.close()``, to
    stop its thread early; otherwise that happens at ``destroy_process_group()`` or interpreter exit.

    ``resume``: continue from a saved state instead of a fresh one — a ``state_dict`` (either form), or
    the path of a file holding one, alone or under a ``"gradzip"`` key of a whole checkpoint;
    ``{rank}`` in the path is replaced by this rank (its global rank).  A file that is missing or holds
    no gradzip state raises, so a resumed run never silently starts its error feedback from zero.

    Under ``torch.amp.GradScaler`` pass ``grad_scaler=scaler`` (a :class:`GradzipState` argument, as are
    the other keywords besides the compressor's parameters): the hook sees scaled gradients.
    """
    given, ddp_model = ddp_model, uncompiled(ddp_model)  # torch.compile(DDP(model)): the hook is the DDP's
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(
            f"gradzip.register() needs a torch.nn.parallel.DistributedDataParallel model (or torch.compile "
            f"of one), got {'torch.compile of ' if given is not ddp_model else ''}{type(ddp_model).__name__}; "
            "gradzip compresses DDP's gradient allreduce (FSDP and FSDP2 shard gradients with reduce-scatter, "
            "which it does not support); with HF Trainer (whose callbacks get the unwrapped model) use "
            "gradzip.integrations.transformers.register(trainer, method, ...); without DDP, wrap the optimizer "
            "in gradzip.DistributedOptimizer")
    hooks = getattr(ddp_model, "_comm_hooks", None)
    if hooks or getattr(ddp_model, "_gradzip_counted", None) is not None:  # DDP's own error says only "once"
        hook = hooks[0][0] if hooks else ddp_comm_hook
        had = ("gradzip.register() was already called on this DDP model" if hook is ddp_comm_hook else
               f"this DDP model already has the communication hook {getattr(hook, '__qualname__', hook)}")
        raise ValueError(f"{had}, and DDP takes one hook per model: keep the state the first register() "
                         "returned, or wrap the module in a new DistributedDataParallel")
    ddp_group = getattr(ddp_model, "process_group", None)
    own = None
    if dist.is_initialized() and ddp_group is not None and (
            group is ddp_group or (group is None and ddp_group is not dist.group.WORLD)):
        if dist.get_world_size(ddp_group) == 1:
            group = ddp_group  # one rank: nothing is exchanged, nothing to keep apart
        else:
            group, destroyable = collectives.group_of_ranks(ddp_group)
            own = group if destroyable else None
    state = GradzipState(compressor, group=group, seed=seed, **params)
    state.adopt_group(own)
    # DDP(torch.compile(model)) names them as the model does: a checkpoint does not depend on compiling
    state.param_names = {p: name for name, p in uncompiled(ddp_model.module).named_parameters()}
    # Buckets that are sent densely go through a plain allreduce on DDP's own group, which gradzip's
    # thread never uses (two threads issuing collectives on one group could interleave them differently
    # on different ranks).
    gradzip_group = getattr(state.transport, "group", None)
    state.dense_group = ddp_group if ddp_group is not None and ddp_group is not gradzip_group else None
    if resume is not None:
        # {rank}: the global rank, as a script names its files (two ranks of one data-parallel rank, in
        # different subgroups beside tensor parallelism, have each their own)
        state.load_state_dict(_saved_state(resume, dist.get_rank() if dist.is_initialized() else state.rank))
    if (any(isinstance(m, torch.nn.SyncBatchNorm) for m in ddp_model.module.modules())
            and not state.transport.issues_beside_other_groups(torch.device("cuda"))):
        # SyncBatchNorm's backward allreduces on backward's thread, between bucket hooks: gradzip's
        # collectives go out from there too, so that every rank issues both in program order.
        state.issues_inline = True
    reduced = _reduced_by_ddp_itself(state, ddp_model)
    if reduced is not None:
        ddp_model._gradzip_counted = _DDPAllreduceCount(state, reduced)
        ddp_model.register_forward_hook(ddp_model._gradzip_counted.after_forward)
    else:
        _refuse_sparse_gradients(state, ddp_model.module)
        ddp_model.register_comm_hook(state, ddp_comm_hook)
    guard_momentum(state, ddp_model.module.parameters())
    if reduced is None and ddp_model.find_unused_parameters and not ddp_model.static_graph:
        state.local_use = _LocalUse(ddp_model)
    _log.info("gradzip.register: %s", state.describe(as_text=True))
    return state


def _reduced_by_ddp_itself(state: GradzipState, ddp_model: DistributedDataParallel) -> Optional[list]:
    """The parameters DDP reduces, where DDP's own allreduce (C++, no Python hook) is exactly this
    state's exchange for ever — ``none``, or fp16 and bf16 without feedback on gradients already in
    that dtype — on DDP's own group; None otherwise.

    A Python communication hook costs a step even when it only calls ``allreduce``: on an H100,
    PyTorch's own ``allreduce_hook`` took 1.5x DDP's step on a 101M-parameter GPT at world size 1,
    gradzip's ``none`` 1.38x.  Left to DDP, ``none`` is DDP, bit for bit: DDP multiplies each gradient
    by 1/N where gradzip's exchange divides by N (the same bits for N a power of two, the last bit of
    some elements otherwise)."""
    params = getattr(ddp_model, "_module_parameters", None)
    if (state.dense_group is None or params is None or getattr(ddp_model, "_use_python_reducer", False)
            or getattr(ddp_model, "_delay_all_reduce_params", None)):  # reduced after backward, by DDP's own hook
        return None
    params = [p for p in params if p.requires_grad]
    if not params or any(state.always_plain_dtype(p.dtype) != p.dtype for p in params):
        return None
    return params


class _DDPAllreduceCount:
    """Counts DDP's own allreduce in the state, as the hook's plain allreduce counts itself: each step
    whose loss is backpropagated through the model's output with DDP syncing (grad enabled, not in
    ``no_sync()``, as DDP itself decides in its forward) is one plain allreduce of every gradient DDP
    reduces, one record per dtype (DDP's buckets never mix dtypes).  It costs one Python call in
    forward and one when backward reaches the output, not one per bucket."""

    def __init__(self, state: GradzipState, params: list):
        self.state = state
        by_dtype = {}
        for p in params:
            by_dtype.setdefault(p.dtype, []).append(p)
        self.by_dtype = {dtype: (tuple(state.param_names[p] for p in ps), sum(p.numel() for p in ps))
                         for dtype, ps in by_dtype.items()}
        self.pending = None

    def after_forward(self, ddp_model, inputs, output):
        if not (torch.is_grad_enabled() and ddp_model.require_backward_grad_sync):
            return
        token = self.pending = object()

        def reached(grad):  # on backward's thread, before any bucket is reduced
            if self.pending is token:
                self.pending = None
                self.count()

        # Only outputs that backward passes through and then lets go of: a hook on a leaf (a parameter
        # returned as it is) would stay on it for good, one more every step.
        reached_by_backward = [t for t in _find_tensors(output) if t.grad_fn is not None]
        for tensor in reached_by_backward:
            tensor.register_hook(reached)
        if not reached_by_backward:  # nothing to hook (opaque objects, leaves): counted at its forward,
            self.count()  # where DDP prepared the reduction

    def count(self):
        for dtype, (keys, elements) in self.by_dtype.items():
            self.state.record_plain(keys, elements, dtype.itemsize, dtype)
            self.state.record_bucket_of(keys, elements, exchanges=1, plain=1)


class _LocalUse:
    """Which parameters this rank's backward reached since their bucket was last exchanged, as DDP's
    reducer marks them used under ``find_unused_parameters=True`` (its own record is on the device,
    and complete only after the last bucket): a hook on each parameter's gradient notes it, before
    DDP's hook on the same gradient can make its bucket ready.  Like DDP's, the record includes the
    ``no_sync()`` steps since the last synced one; a bucket's exchange takes its parameters' marks.

    The hook withholds the others' error feedback (:meth:`GradzipState.exchange`'s ``withheld``):
    DDP drops the result of a parameter no rank used, and with it the part of its residual sent.
    A parameter without the hook (frozen when ``register`` ran) is never withheld."""

    def __init__(self, ddp_model: DistributedDataParallel):
        self.used: set = set()
        self.watched = {p for p in ddp_model.module.parameters() if p.requires_grad}
        self.handles = [p.register_hook(functools.partial(self._reached, p)) for p in self.watched]

    def _reached(self, param, grad):
        if grad is not None:  # an undefined gradient: DDP does not count the parameter used either
            self.used.add(param)

    def unused(self, named_params) -> list:
        """The names of the parameters not reached since their last exchange; takes their marks."""
        named_params = list(named_params)
        unused = [name for name, p in named_params if p in self.watched and p not in self.used]
        self.used.difference_update(p for _, p in named_params)
        return unused

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles, self.watched = [], set()


def _saved_state(resume, rank: int) -> dict:
    """The gradzip state_dict that ``register(resume=...)`` names (see there)."""
    if isinstance(resume, (str, os.PathLike)):
        path = os.fspath(resume).replace("{rank}", str(rank))
        if not os.path.exists(path):
            raise FileNotFoundError(f"register(resume={path!r}): no such file; pass the file a gradzip "
                                    "state_dict was saved to, or resume=None to start a fresh state")
        saved = torch.load(path, map_location="cpu", weights_only=True)
    else:
        saved, path = resume, "the given dict"
    if isinstance(saved, dict) and "compressor" not in saved and isinstance(saved.get("gradzip"), dict):
        saved = saved["gradzip"]
    if not isinstance(saved, dict) or "compressor" not in saved:
        raise ValueError(f"register(resume=...): {path} holds no gradzip state_dict (state.state_dict(), "
                         "alone or under a 'gradzip' key); resume=None starts a fresh state")
    return saved


def _names(state: GradzipState, params) -> list:
    """The state keys of a bucket's parameters.

    ``register()`` gives the model's parameter names.  A state handed to DDP directly has none, so each
    parameter is named ``param<i>`` in the order DDP first hands it over: on the first step DDP's
    buckets follow the model's parameter order (reversed), the same on every rank and in every run of
    the same script, so a checkpointed state finds its tensors again after a restart.
    """
    names = state.param_names
    if names is None:
        names = state.param_names = {}
    missing = [p for p in params if p not in names]
    if missing:
        for p in missing:
            names[p] = f"param{len(names)}"
        guard_momentum(state, missing)
    return [names[p] for p in params]


def _refuse_sparse_gradients(state: GradzipState, module: torch.nn.Module) -> None:
    """Raise (closing ``state``) where ``module`` trains an embedding that makes sparse gradients."""
    sparse = [f"{type(m).__name__} {name!r}" for name, m in uncompiled(module).named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        state.close()
        raise ValueError(_sparse_refused(f"{', '.join(sparse)} (sparse=True)", state.compressor.name))


def _sparse_refused(what: str, method: str) -> str:
    return (f"gradzip compresses dense gradients, and {what} gives sparse ones, which {method!r} cannot "
            "take; make it dense (sparse=False), or use method 'none' (DDP's own allreduce)")


def ddp_comm_hook(state: GradzipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``ddp_model.register_comm_hook(gradzip.GradzipState(...), gradzip.ddp_comm_hook)``."""
    if not isinstance(state, GradzipState):
        raise TypeError(f"gradzip.ddp_comm_hook needs a gradzip.GradzipState as its state, got {type(state).__name__}")
    start = time.perf_counter()
    state.transport  # connect now (a state built before init_process_group): its dense group is then known
    buffer = bucket.buffer()
    if buffer.layout != torch.strided:  # register() refuses the usual source; a state handed to DDP directly
        names = _names(state, bucket.parameters())
        raise ValueError(_sparse_refused(f"the parameter {names[0]}", state.compressor.name))
    # A bucket that is one plain allreduce for ever (none; fp16 and bf16 without feedback) is decided
    # once: later steps touch none of its tensors in Python (some 100 per bucket in a transformer).
    cached = state.always_plain.get((bucket.index(), buffer.data_ptr(), buffer.numel()))
    if cached is not None and state.dense_group is not None:
        keys, elements, element_bytes, wire = cached
        state.record_plain(keys, elements, element_bytes, wire)
        fut = _plain_allreduce(buffer, wire, state.dense_group)
        state.record_bucket_of(keys, elements, exchanges=1, plain=1, hook_s=time.perf_counter() - start)
        return fut
    grads = bucket.gradients()
    params = bucket.parameters()
    named = list(zip(_names(state, params), grads))
    withheld = () if state.local_use is None else state.local_use.unused(zip((k for k, _ in named), params))
    dense_group = state.dense_group
    wire = state.plain_allreduce_dtype(named) if dense_group is not None else None
    always = wire is not None and state.always_plain_dtype(buffer.dtype) == wire
    # A bucket that is plain only for now (warm-up, tensors the method leaves alone, auto's choice)
    # shares its steps with buckets on gradzip's thread, which runs behind the hook: issued here, two
    # groups would have collectives in flight in an order that differs between ranks, which only
    # gloo takes safely.  Elsewhere (NCCL) it goes to the thread like the others, in bucket order.
    if wire is not None and (always or collectives.issues_beside_other_groups(dense_group, buffer.device)):
        if always:
            state.always_plain[(bucket.index(), buffer.data_ptr(), buffer.numel())] = (
                tuple(key for key, _ in named), sum(g.numel() for g in grads), buffer.element_size(), wire)
        state.record_dense(named, wire)
        fut = _plain_allreduce(buffer, wire, dense_group)
        state.record_bucket(named, exchanges=1, plain=1, hook_s=time.perf_counter() - start)
        return fut

    # The aggregates are written into the gradients' views of the bucket's buffer, which DDP reads.
    fut = state.submit(named, lambda aggregates: buffer, out=grads, withheld=withheld)
    if bucket.is_last() and not state.transport.issues_beside_other_groups(buffer.device):
        # DDP's reducer issues collectives of its own on its group once the last bucket's hook returns
        # (the map of used parameters, with find_unused_parameters) while gradzip's thread may still be
        # issuing earlier buckets': on NCCL, two groups in flight in an order that differs between ranks.
        # The hook returns once the thread has issued them all; backward's end waits for them anyway.
        # A wait on the host alone: the future's own wait() would also hold backward's stream behind
        # gradzip's, and with it whatever backward has left to run after this hook.
        issued = threading.Event()
        fut.add_done_callback(lambda _: issued.set())
        issued.wait()
    state.record_bucket(named, hook_s=time.perf_counter() - start)  # the thread counts the exchange
    return fut


def _plain_allreduce(buffer: torch.Tensor, wire: torch.dtype, group) -> torch.futures.Future[torch.Tensor]:
    """Average ``buffer`` with one allreduce in ``wire`` dtype on DDP's C++ path, as PyTorch's own hooks
    do: no hop through gradzip's thread.  Divided before the allreduce, here, rather than in the
    callback on gloo's thread, which must take the GIL for it (about 1% of an unthrottled step:
    benchmarks/hook_overhead.py); a 16-bit sum of x / N cannot overflow where the mean does not.
    x / 1 == x, so a single rank divides nothing."""
    n = dist.get_world_size(group)
    if n > 1:
        buffer.div_(n)
    if wire == buffer.dtype:
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    # Divided in fp32 and rounded once to the wire type, as gradzip's own fp16 and bf16 do.  In place,
    # then cast: on CPUs a division writing fp16 directly takes twice as long as both.
    sent = buffer.to(wire)
    fut = dist.all_reduce(sent, group=group, async_op=True).get_future()
    if devices.cuda(buffer):
        # Cast back into the bucket in one kernel, as PyTorch's fp16 hook does: DDP then copies each
        # gradient's slice within one dtype (a memcpy), where a half result would cost a casting
        # kernel per gradient (H200, a GPT of 101 tensors: 666 launches a step against 579).
        return fut.then(lambda f: buffer.copy_(f.value()[0]))
    # On CPUs the half-precision sum itself is the result: DDP copies each gradient's slice of it into
    # p.grad, casting on the way, so the bucket need not be written first (a pass fewer).
    return fut.then(lambda f: f.value()[0])
