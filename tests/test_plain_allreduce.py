"""fp16, bf16 and dense buckets take DDP's own C++ allreduce path, with gradzip's numerics.

Real 2-process gloo DDP jobs: the plain path must give the same parameters, bit for bit, as gradzip's
own exchange on its communication thread, count the same bytes, and leave non-finite steps identical
on every rank.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from tests.distributed import run_workers
from tests.workers import _flat, batch, small_model


def _train(rank, method, *, plain: bool, direct: bool = False, steps: int = 5, poison=None, **params):
    """Train the small model; ``plain=False`` forces gradzip's own exchange for every bucket.
    ``direct``: the state is handed to DDP as a (state, hook) pair, as Lightning does.  ``poison``:
    (rank, step) whose first gradient gets a NaN.  Returns parameters, stats, and every step's
    gradients after the exchange."""
    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    if direct or not plain:
        state = gradzip.GradzipState(method, **params)
        if not plain:
            state.param_names = {p: name for name, p in model.named_parameters()}
            state.transport  # connected now, which names its dense group: none then, so that the hook
            state.dense_group = None  # submits every bucket to gradzip's thread
        ddp.register_comm_hook(state, gradzip.ddp_comm_hook)
    else:
        state = gradzip.register(ddp, method, **params)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grads = []
    for step in range(steps):
        x, y = batch(rank, step)
        if poison == (rank, step):
            x = x.clone()
            x[0, 0] = float("nan")
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        if torch.isfinite(grads[-1]).all():  # as GradScaler would: skip a non-finite step
            opt.step()
    stats = state.stats()
    stats["buckets"] = state.bucket_stats()
    stats["steps"] = dict(state.steps)
    stats["always_plain"] = len(state.always_plain)  # buckets decided once for every step
    state.close()
    return _flat(model), stats, grads


def compare_paths(rank, world, method, params):
    plain = _train(rank, method, plain=True, **params)
    own = _train(rank, method, plain=False, **params)
    direct = _train(rank, method, plain=True, direct=True, **params)
    return plain, own, direct


@pytest.mark.parametrize("method", ["fp16", "bf16"])
def test_plain_path_equals_gradzips_exchange_bit_for_bit(method):
    results = run_workers(compare_paths, 2, method, {})
    for plain, own, direct in results:
        assert torch.equal(plain[0], own[0]) and torch.equal(direct[0], own[0])
        assert plain[1]["exchanges"] == own[1]["exchanges"] > 0
        assert plain[1]["plain_allreduces"] == plain[1]["exchanges"]  # every bucket took DDP's path
        assert direct[1]["plain_allreduces"] == direct[1]["exchanges"]  # also without register()
        assert own[1]["plain_allreduces"] == 0
        # Decided at a bucket's first step, then without reading its tensors; the same step counts.
        assert plain[1]["always_plain"] == len(plain[1]["buckets"]) > 1 and own[1]["always_plain"] == 0
        assert plain[1]["steps"] == own[1]["steps"] and set(plain[1]["steps"].values()) == {5}
        assert sorted(direct[1]["steps"].values()) == sorted(plain[1]["steps"].values())  # named param<i> there
        # Per bucket: every exchange counted once, on the path it took.
        for run, plain_share in ((plain, 1), (own, 0)):
            assert sum(b["exchanges"] for b in run[1]["buckets"]) == run[1]["exchanges"]
            assert all(b["plain"] == plain_share * b["exchanges"] and b["hook_s"] > 0 for b in run[1]["buckets"])
        # The same payload counted either way, 2 bytes per element for the half types; gradzip's own
        # exchange adds its non-finite flag to the wire.
        for key in ("payload_bytes", "dense_bytes", "elements_sent"):
            assert plain[1][key] == own[1][key], key
        assert plain[1]["wire_bytes"] == plain[1]["payload_bytes"] < own[1]["wire_bytes"]
        assert 2 * plain[1]["wire_bytes"] == plain[1]["dense_bytes"]
    assert torch.equal(results[0][0][0], results[1][0][0])  # ranks agree


class _Opaque(nn.Module):
    """A model whose output is an object DDP does not look into."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return types.SimpleNamespace(logits=self.net(x))


class _WithLeaf(nn.Module):
    """A model that returns one of its parameters as it is, beside its logits."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return {"logits": self.net(x), "scale": self.scale}


def none_left_to_ddp(rank, world):
    """``none`` through register() (DDP's own allreduce), gradzip's own exchange, and DDP alone; then
    which steps register()'s state counts: synced backward steps only."""
    plain = _train(rank, "none", plain=True)
    own = _train(rank, "none", plain=False)
    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    alone = _flat(model)

    ddp = nn.parallel.DistributedDataParallel(small_model(), bucket_cap_mb=0.004)
    state = gradzip.register(ddp, "none")
    hooks = list(ddp._comm_hooks)
    x, y = batch(rank, 0)
    nn.functional.cross_entropy(ddp(x), y).backward()  # counted
    with ddp.no_sync():
        nn.functional.cross_entropy(ddp(x), y).backward()  # accumulated, not exchanged
    with torch.no_grad():
        ddp(x)
    ddp(x)  # never backpropagated: DDP reduces nothing
    out = ddp(x)
    nn.functional.cross_entropy(out, y).backward(retain_graph=True)  # counted once, however many
    out.sum().backward()  # ... outputs or backward passes reach it: DDP reduced once
    counted = state.stats()
    opaque = nn.parallel.DistributedDataParallel(_Opaque(small_model()))
    opaque_state = gradzip.register(opaque, "none")
    for _ in range(2):
        nn.functional.cross_entropy(opaque(x).logits, y).backward()
    counted["opaque"] = opaque_state.stats()["exchanges"]
    with_leaf = nn.parallel.DistributedDataParallel(_WithLeaf(small_model()))
    leaf_state = gradzip.register(with_leaf, "none")
    for _ in range(3):
        out = with_leaf(x)
        nn.functional.cross_entropy(out["logits"] * out["scale"], y).backward()
    counted["with_leaf"] = leaf_state.stats()["exchanges"]
    counted["hooks_on_leaf"] = len(with_leaf.module.scale._backward_hooks or {})
    try:
        gradzip.register(ddp, "topk")
        again = None
    except ValueError as e:
        again = str(e)
    state.close()
    return plain, own, alone, hooks, counted, again


def test_none_leaves_ddps_own_allreduce_and_counts_what_it_sends():
    results = run_workers(none_left_to_ddp, 3)  # 3 ranks: DDP's x * (1/3) is not gradzip's x / 3 in every bit
    for plain, own, alone, hooks, counted, again in results:
        assert hooks == []  # no Python hook: DDP's C++ allreduce
        assert torch.equal(plain[0], alone)  # DDP's own bits
        assert torch.allclose(own[0], alone, rtol=1e-5, atol=1e-7)  # gradzip's exchange: the same average
        elements = sum(p.numel() for p in small_model().parameters())
        # One plain allreduce a step of every gradient (one dtype), 4 bytes an element.
        assert plain[1]["exchanges"] == plain[1]["plain_allreduces"] == plain[1]["collectives"] == 5
        assert plain[1]["payload_bytes"] == plain[1]["wire_bytes"] == plain[1]["dense_bytes"] == 5 * 4 * elements
        assert plain[1]["elements"] == plain[1]["elements_sent"] == 5 * elements
        assert plain[1]["steps"] == own[1]["steps"] and set(plain[1]["steps"].values()) == {5}
        assert [(b["tensors"], b["elements"], b["exchanges"], b["plain"]) for b in plain[1]["buckets"]] == [
            (len(plain[1]["steps"]), elements, 5, 5)]
        assert counted["exchanges"] == 2 and counted["wire_bytes"] == 2 * 4 * elements
        assert counted["opaque"] == 2  # counted at its forwards
        assert counted["with_leaf"] == 3 and counted["hooks_on_leaf"] == 0  # no hook left on a parameter
        assert again.startswith("gradzip.register() was already called on this DDP model")
    assert torch.equal(results[0][0][0], results[1][0][0])


def test_half_casts_with_error_feedback_keep_gradzips_exchange():
    results = run_workers(compare_paths, 2, "fp16", {"feedback": "residual"})
    for plain, own, direct in results:
        assert plain[1]["plain_allreduces"] == direct[1]["plain_allreduces"] == 0  # a residual is kept
        assert plain[1]["always_plain"] == 0
        assert torch.equal(plain[0], own[0])


def nonfinite_step(rank, world):
    return _train(rank, "fp16", plain=True, poison=(1, 2))


def test_a_nonfinite_input_gives_every_rank_the_same_nonfinite_gradients():
    results = run_workers(nonfinite_step, 2)
    (p0, s0, g0), (p1, s1, g1) = results
    assert s0["plain_allreduces"] == s0["exchanges"]
    for step, (a, b) in enumerate(zip(g0, g1)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
        assert bool(torch.isfinite(a).all()) == (step != 2)  # only the poisoned step, on both ranks
    assert torch.equal(p0, p1)  # both skipped the same step


def test_plain_allreduce_dtype_rules():
    # The rule itself (the hook uses it only where it has a group to allreduce on).
    g = torch.randn(6, 4)
    for method, feedback, expected in [("fp16", None, torch.float16), ("bf16", None, torch.bfloat16),
                                       ("none", None, torch.float32), ("fp16", "residual", None),
                                       ("topk", None, None), ("qsgd", None, None)]:
        state = gradzip.GradzipState(method, feedback=feedback)
        assert state.plain_allreduce_dtype([("w", g), ("b", g[0])]) == expected, (method, feedback)
    # DGC's momentum correction accumulates even on dense warm-up steps.
    assert gradzip.GradzipState("dgc").plain_allreduce_dtype([("w", g)]) is None


def test_no_plain_path_without_torch_distributed():
    assert not dist.is_initialized()
    state = gradzip.GradzipState("fp16")
    assert state.dense_group is None


def auto_chooses_fp16(rank, world):
    # auto with one candidate: step 0 warm-up, step 1 its trial (keeping a rounding residual), step 2
    # the decision, which flushes that residual through gradzip's exchange and keeps none; then DDP's path.
    params = {"candidates": ["fp16"], "warmup": 1, "trials": 1}
    plain = _train(rank, "auto", plain=True, steps=7, **params)
    own = _train(rank, "auto", plain=False, steps=7, **params)
    return plain, own


def test_auto_runs_a_chosen_half_cast_without_feedback_on_ddps_path():
    for plain, own in run_workers(auto_chooses_fp16, 2):
        assert torch.equal(plain[0], own[0])  # the same numbers on either path
        plain_per_bucket = [b["plain"] for b in plain[1]["buckets"] if b["exchanges"] == 6]
        assert plain_per_bucket and all(n == 4 for n in plain_per_bucket)  # steps 3 to 6
        assert own[1]["plain_allreduces"] == 0
        assert plain[1]["always_plain"] == 0  # auto's choice may change: decided step by step

