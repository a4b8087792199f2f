"""On NCCL, gradzip's thread and the caller's thread must not have collectives of two groups in flight
in an order that differs between ranks (PyTorch documents concurrent NCCL groups as unsafe: a hang).

Real 2-process gloo DDP jobs in which the groups are pretended to be NCCL (`collectives.backends_of`),
since this machine has no GPU: what the hook then does differently is what NCCL needs.
"""
from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn

import gradzip
from tests.distributed import run_workers
from tests.test_plain_allreduce import _train
from tests.workers import _flat, batch, small_model


@contextlib.contextmanager
def pretended_nccl(groups=None):
    """``backends_of`` says NCCL for ``groups`` (every group when None) while the block runs."""
    backends_of = gradzip.collectives.backends_of

    def pretended(group=None):
        chosen = groups is None or any(group is g or (group is None and g is dist.group.WORLD) for g in groups)
        return {"cuda": "nccl", "cpu": "nccl"} if chosen else backends_of(group)

    gradzip.collectives.backends_of = pretended
    try:
        yield
    finally:
        gradzip.collectives.backends_of = backends_of


def mixed_steps_on_pretended_nccl(rank, world, method, params):
    """Buckets plain in some steps beside buckets on gradzip's thread: over gloo, DDP's group takes
    the plain ones; with DDP's group pretended to be NCCL, gradzip's thread takes them all."""
    on_gloo = _train(rank, method, plain=True, **params)
    with pretended_nccl([dist.group.WORLD]):  # DDP's group, where register() lets the hook allreduce
        on_nccl = _train(rank, method, plain=True, **params)
        always = _train(rank, "fp16", plain=True)  # plain for ever: DDP's group even on NCCL
    own = _train(rank, method, plain=False, **params)
    return on_gloo, on_nccl, always, own


def test_on_nccl_buckets_plain_only_for_a_step_go_through_gradzips_thread():
    results = run_workers(mixed_steps_on_pretended_nccl, 2, "powersgd", {"dense_steps": 2})
    for on_gloo, on_nccl, always, own in results:
        # Over gloo the dense steps go through DDP's group, the others through gradzip's thread ...
        assert 0 < on_gloo[1]["plain_allreduces"] < on_gloo[1]["exchanges"]
        # ... which on NCCL go through gradzip's thread alone, with the same numbers as its own exchange.
        assert on_nccl[1]["plain_allreduces"] == 0 and on_nccl[1]["exchanges"] == own[1]["exchanges"]
        assert torch.equal(on_nccl[0], own[0])
        assert always[1]["plain_allreduces"] == always[1]["exchanges"] > 0
    assert torch.equal(results[0][1][0], results[1][1][0])


def last_hook_and_the_thread(rank, world):
    """Per step, whether the last bucket's future was complete when its hook returned: with gradzip's
    exchanges slowed down, over gloo and with every group pretended to be NCCL."""
    seen = {}
    for backend, context in (("gloo", contextlib.nullcontext()), ("nccl", pretended_nccl())):
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
        state = gradzip.GradzipState("topk", ratio=0.5)
        exchange = state.exchange

        def slow(named, out=None, withheld=()):  # on gradzip's thread: DDP's own collectives would come first
            time.sleep(0.2)
            return exchange(named, out, withheld)

        state.exchange = slow
        done = seen[backend] = []

        def hook(state, bucket):
            fut = gradzip.ddp_comm_hook(state, bucket)
            if bucket.is_last():
                done.append(fut.done())
            return fut

        ddp.register_comm_hook(state, hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with context:
            for step in range(3):
                x, y = batch(rank, step)
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
        state.close()
        seen[backend + " params"] = _flat(model)
    return seen


def test_on_nccl_the_last_buckets_hook_returns_once_gradzips_thread_has_issued_every_bucket():
    results = run_workers(last_hook_and_the_thread, 2)
    for seen in results:
        assert seen["nccl"] == [True, True, True]  # DDP's collectives after the last hook come after gradzip's
        assert seen["gloo"] == [False, False, False]  # gloo: no wait (the thread is 0.2 s behind)
        assert torch.equal(seen["gloo params"], seen["nccl params"])
    assert torch.equal(results[0]["nccl params"], results[1]["nccl params"])


def syncbn_decisions(rank, world):
    """Whether register() issues CUDA exchanges from backward's thread: with and without SyncBatchNorm,
    on gloo and on (pretended) NCCL."""
    seen = {}
    for name, context in (("gloo", contextlib.nullcontext), ("nccl", pretended_nccl)):
        for syncbn in (False, True):
            ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
            if syncbn:  # DDP takes SyncBatchNorm on GPU modules only: put in once DDP is built
                ddp.module[1] = nn.SyncBatchNorm(4)
            with context():
                state = gradzip.register(ddp, "topk")
            seen[name, syncbn] = state.issues_inline
            state.close()
    return seen


def test_syncbatchnorm_on_nccl_issues_every_exchange_from_backwards_thread():
    # SyncBatchNorm's backward allreduces between bucket hooks; on NCCL gradzip's collectives then go
    # out from that thread too (in program order on every rank), never from its own.
    for seen in run_workers(syncbn_decisions, 2):
        assert seen == {("gloo", False): False, ("gloo", True): False, ("nccl", False): False, ("nccl", True): True}


def diloco_decisions(rank, world):
    seen = {}
    for name, context in (("gloo", contextlib.nullcontext), ("nccl", pretended_nccl)):
        for overlap in (False, True):
            model = small_model()
            with context():
                outer = gradzip.DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2,
                                       overlap=overlap, compressor="topk", ratio=0.5)
            seen[name, overlap] = outer.state.issues_inline
            outer.state.close()
    return seen


def test_overlapped_diloco_on_nccl_issues_its_exchange_from_step():
    # The inner steps' own collectives (DDP within a node) go out from the caller's thread: on NCCL the
    # overlapped outer exchange does too, on gradzip's stream, instead of from gradzip's thread.
    for seen in run_workers(diloco_decisions, 2):
        assert seen == {("gloo", False): False, ("gloo", True): False, ("nccl", False): False, ("nccl", True): True}
