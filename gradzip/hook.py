"""DistributedDataParallel integration: ``state = gradzip.register(ddp_model, "powersgd", rank=2)``.

The hook hands each bucket's gradients (layer by layer, so methods that need a layer's shape get it) to
the state's communication thread and returns a future at once, so compression and exchange overlap the
rest of backward.  DDP launches bucket hooks in bucket order on every rank and the thread serves them
first-in first-out, so the collectives of all buckets are issued in the same order on every rank — even
for multi-phase methods such as PowerSGD, whose chained future callbacks reorder them in PyTorch's hook.
"""

from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .optimizer import guard_momentum, own_group
from .state import GradzipState

__all__ = ["register"]


def register(ddp_model: DistributedDataParallel, compressor="none", *, group: "Optional[dist.ProcessGroup]" = None,
             seed: int = 0, **params) -> GradzipState:
    """Install gradzip as ``ddp_model``'s communication hook and return its state.

    By default gradzip talks over a process group of its own (see :func:`own_group`).
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"register() needs a DistributedDataParallel model, got {type(ddp_model).__name__}")
    gradzip_group = own_group(group)
    state = GradzipState(compressor, group=gradzip_group, seed=seed, **params)
    state.param_names = {p: name for name, p in ddp_model.module.named_parameters()}
    # Buckets that are sent densely go through a plain allreduce on DDP's own group, which gradzip's
    # thread never uses (two threads issuing collectives on one group could interleave them differently
    # on different ranks).
    ddp_group = getattr(ddp_model, "process_group", None)
    state.dense_group = ddp_group if ddp_group is not None and ddp_group is not gradzip_group else None
    ddp_model.register_comm_hook(state, _comm_hook)
    guard_momentum(state, ddp_model.module.parameters())
    return state


def _comm_hook(state: GradzipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    grads = bucket.gradients()
    named = [(state.param_names[p], g) for p, g in zip(bucket.parameters(), grads)]
    buffer = bucket.buffer()
    if state.dense_group is not None and state.sends_dense(named):
        state.record_dense(named)
        # Divided before the allreduce, here, rather than in the callback on gloo's thread, which must
        # take the GIL for it: about 1% of an unthrottled step (benchmarks/hook_overhead.py).
        buffer.div_(dist.get_world_size(state.dense_group))
        fut = dist.all_reduce(buffer, group=state.dense_group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    def write_back(aggregates):
        for g, aggregate in zip(grads, aggregates):  # grads are views into the bucket's buffer
            g.copy_(aggregate)
        return buffer

    return state.submit(named, write_back)
