"""gradzip.DistributedOptimizer as a torch.optim.Optimizer: LR schedulers, GradScaler, clipping, state_dict,
zero_grad, add_param_group, and averaged gradients in p.grad when backward() returns.

The distributed checks run in one pair of real gloo processes (``_scenarios``, shared by the tests through
a module fixture); each scenario reports its own error, so one broken feature fails only its test.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from tests.workers import run_scenarios
from tests import workers
from tests.distributed import run_workers

STEPS = 4


# -- workers (run in the spawned processes) ---------------------------------------------------------------
def _flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _local_grads(loss, params):
    """The local gradient, without accumulating into p.grad (so without gradzip's hooks)."""
    return [g.clone() for g in torch.autograd.grad(loss, params, retain_graph=True)]


def _averaged(tensors, world):
    out = []
    for t in tensors:
        t = t.clone()
        dist.all_reduce(t)
        out.append(t / world)
    return out


def _loss(model, rank, step):
    x, y = workers.batch(rank, step)
    return nn.functional.cross_entropy(model(x), y)


def _backward_and_expected(model, rank, step, world):
    """Backward of step's loss through the wrapper's hooks: p.grad as it returns, and the average of the
    ranks' local gradients it should hold."""
    loss = _loss(model, rank, step)
    expected = _averaged(_local_grads(loss, list(model.parameters())), world)
    loss.backward()
    return _grads(model), expected


def _make_scheduler(kind, opt):
    if kind == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if kind == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + 3 * step))
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=STEPS)  # also cycles momentum


def scenario_schedulers(rank, world, tmp):
    """Each scheduler with the wrapper against the same scheduler on a plain SGD fed the manual average."""
    out = {}
    for kind in ("step", "lambda", "onecycle"):
        model, reference = workers.small_model(), workers.small_model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        opt = gradzip.DistributedOptimizer(inner, model.named_parameters(), "none")
        sched = _make_scheduler(kind, opt)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        ref_sched = _make_scheduler(kind, ref_opt)
        lrs, inner_lrs = [], []
        for step in range(STEPS):
            opt.zero_grad()
            _loss(model, rank, step).backward()
            lrs.append(opt.param_groups[0]["lr"])
            inner_lrs.append(inner.param_groups[0]["lr"])
            opt.step()
            sched.step()
            ref_opt.zero_grad()
            _loss(reference, rank, step).backward()
            for p, g in zip(reference.parameters(), _averaged([p.grad for p in reference.parameters()], world)):
                p.grad.copy_(g)
            ref_opt.step()
            ref_sched.step()
        out[kind] = {"lrs": lrs, "inner_lrs": inner_lrs, "params": _flat(model), "reference": _flat(reference),
                     "same_groups": opt.param_groups is inner.param_groups}
    return out


def scenario_grad_scaler(rank, world, tmp):
    """GradScaler on CPU; at step 2 only the last rank's gradients overflow."""
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       "topk", ratio=0.25)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    rows = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, rank, step)
        if step == 2 and rank == world - 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        before = _flat(model)
        residuals = {k: v["residual"].clone() for k, v in opt.gradzip_state.tensors.items()}
        scaler.step(opt)
        scaler.update()
        rows.append({"finite_after_backward": finite, "stepped": not torch.equal(before, _flat(model)),
                     "scale": scaler.get_scale(), "params": _flat(model), "residuals": residuals})
    return rows


def scenario_unscale_clip(rank, world, tmp):
    """scaler.unscale_ + clip_grad_norm_ + scaler.step: the norm is the averaged gradient's, on every rank."""
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    rows = []
    for step in range(3):
        opt.zero_grad()
        loss = _loss(model, rank, step)
        local = _local_grads(loss, list(model.parameters()))
        expected_norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in _averaged(local, world)]))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
        clipped = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        scaler.step(opt)
        scaler.update()
        rows.append({"norm": norm.clone(), "expected_norm": expected_norm, "clipped": clipped,
                     "params": _flat(model)})
    return rows


def scenario_grad_after_backward(rank, world, tmp):
    """p.grad holds the average when backward() returns; step() then exchanges nothing more."""
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none")
    rows = []
    for step in range(2):
        opt.zero_grad()
        loss = _loss(model, rank, step)
        expected = _averaged(_local_grads(loss, list(model.parameters())), world)
        loss.backward()
        grads = _grads(model)
        exchanges = opt.stats()["exchanges"]
        opt.synchronize()
        opt.step()
        rows.append({"grads": grads, "expected": expected,
                     "exchanges_in_step": opt.stats()["exchanges"] - exchanges, "params": _flat(model)})
    return rows


def scenario_accumulate(rank, world, tmp):
    """backward_passes_per_step=2: the first pass stays local, the second averages the accumulated sum."""
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       "none", backward_passes_per_step=2)
    rows = []
    for step in range(2):
        opt.zero_grad()
        local = [torch.zeros_like(p) for p in model.parameters()]
        after_first = None
        for micro in range(2):
            loss = _loss(model, rank, 2 * step + micro)
            for acc, g in zip(local, _local_grads(loss, list(model.parameters()))):
                acc += g
            loss.backward()
            if micro == 0:
                after_first = (_grads(model), [a.clone() for a in local], opt.stats()["exchanges"])
        rows.append({"after_first": after_first, "grads": _grads(model), "expected": _averaged(local, world)})
        opt.step()
    return rows


def scenario_zero_grad(rank, world, tmp):
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none")
    _loss(model, rank, 0).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    zeroed = _grads(model)
    loss = _loss(model, rank, 1)
    expected = _averaged(_local_grads(loss, list(model.parameters())), world)
    loss.backward()
    after_zeros = _grads(model)
    opt.step()
    opt.zero_grad(set_to_none=True)
    none_explicit = _grads(model)
    _loss(model, rank, 2).backward()
    opt.step()
    opt.zero_grad()
    none_default = _grads(model)
    return {"zeroed": zeroed, "after_zeros": after_zeros, "expected": expected,
            "none_explicit": none_explicit, "none_default": none_default, "params": _flat(model)}


def scenario_add_param_group(rank, world, tmp):
    """Fine-tuning: the head joins the optimizer later, with its own lr; its gradients are averaged too."""
    model = workers.small_model()
    body, head = model[:4], model[4]
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(body.parameters(), lr=0.1), body.named_parameters(), "none")
    _loss(model, rank, 0).backward()
    opt.step()
    opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
    opt.zero_grad()
    grads, expected = _backward_and_expected(model, rank, 1, world)
    opt.step()
    return {"grads": grads, "expected": expected, "params": _flat(model), "lrs": [g["lr"] for g in opt.param_groups],
            "inner_groups": len(opt.optimizer.param_groups), "names": sorted(opt.gradzip_state.steps)}


def scenario_unfreeze(rank, world, tmp):
    """Fine-tuning: the body is frozen when the wrapper is built and unfrozen after a step; from that step on
    its gradients are averaged too (before, they stayed each rank's own and the replicas drifted)."""
    model = workers.small_model()
    for p in model[:4].parameters():
        p.requires_grad_(False)
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none")
    _loss(model, rank, 0).backward()
    opt.step()
    for p in model[:4].parameters():
        p.requires_grad_(True)
    opt.zero_grad()
    grads, expected = _backward_and_expected(model, rank, 1, world)
    opt.step()
    opt.zero_grad()
    _loss(model, rank, 2).backward()  # the next step: through the hooks it now has
    opt.step()
    return {"grads": grads, "expected": expected, "params": _flat(model), "names": sorted(opt.gradzip_state.steps)}


def scenario_rewrapped(rank, world, tmp):
    """A new wrapper of the same model after close(): the old one's hooks are gone (before, every backward
    still reached its closed state, which raised)."""
    model = workers.small_model()
    old = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none")
    _loss(model, rank, 0).backward()
    old.step()
    old.close()
    new = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(), "none")
    new.zero_grad()
    grads, expected = _backward_and_expected(model, rank, 1, world)
    new.step()
    return {"grads": grads, "expected": expected, "old": old.stats()["exchanges"], "new": new.stats()["exchanges"]}


def scenario_duplicates(rank, world, tmp):
    """A parameter named twice (tied weights, named_parameters(remove_duplicate=False)) is exchanged once a
    pass, under its first name: with two passes a step, its bucket waits for the second pass."""
    model = workers.small_model()
    named = list(model.named_parameters()) + [("tied", model[0].weight)]
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named, "none",
                                       backward_passes_per_step=2)
    losses = [_loss(model, rank, step) for step in range(2)]
    expected = _averaged([a + b for a, b in zip(*(_local_grads(loss, list(model.parameters())) for loss in losses))],
                         world)
    losses[0].backward()
    pending_after_one = sorted(opt._futures)
    losses[1].backward()
    grads = _grads(model)
    opt.step()
    return {"grads": grads, "expected": expected, "pending_after_one": pending_after_one,
            "names": sorted(opt.gradzip_state.steps)}


def scenario_reentrant_checkpoint(rank, world, tmp):
    """Reentrant activation checkpointing (use_reentrant=True, as HF models' gradient checkpointing has
    it): each checkpointed segment's backward is a pass of its own inside the outer one; the exchange
    ends with the outer one (before, it ran at each segment's end, sending zeros for the rest)."""
    from torch.utils.checkpoint import checkpoint
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none",
                                       bucket_cap_mb=0.001)
    x, y = workers.batch(rank, 0)

    def loss_of(m):  # a reentrant segment passes gradients only where an input requires them
        h = checkpoint(m[:2], x.detach().requires_grad_(), use_reentrant=True)
        h = checkpoint(m[2:4], h, use_reentrant=True)
        return nn.functional.cross_entropy(checkpoint(m[4], h, use_reentrant=True), y)  # every gradient inner

    expected = _averaged(_local_grads(_loss(model, rank, 0), list(model.parameters())), world)
    loss_of(model).backward()
    grads = _grads(model)
    exchanges = opt.stats()["exchanges"]
    opt.step()
    return {"grads": grads, "expected": expected, "exchanges": exchanges, "buckets": len(opt._buckets)}


def scenario_failed_backward(rank, world, tmp):
    """A backward that raises partway (its end-of-backward callback never runs), on each rank after other
    buckets, then zero_grad and a normal step: no rank waits for a bucket another never sent, and that
    step's gradients are averaged when backward returns, as if nothing had failed."""
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "none",
                                       bucket_cap_mb=0.001)  # a bucket a layer: some go out before the failure

    def fail(grad):
        raise RuntimeError("interrupted")

    x, y = workers.batch(rank, 0)
    cut = 2 if rank == 0 else 4  # the ranks stop at different buckets
    hidden = model[:cut](x)
    hidden.register_hook(fail)
    try:
        nn.functional.cross_entropy(model[cut:](hidden), y).backward()
        failed = False
    except RuntimeError:
        failed = True
    opt.zero_grad()
    grads, expected = _backward_and_expected(model, rank, 1, world)
    opt.step()
    return {"failed": failed, "grads": grads, "expected": expected, "params": _flat(model)}


def _checkpointed_run(rank, path, resume):
    model = workers.small_model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), "topk", ratio=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    first = 0
    if resume:
        saved = torch.load(path, weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        first = saved["step"]
    for step in range(first, STEPS):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        sched.step()
        if not resume and step == 1:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step + 1}, path)
    return model, opt


def scenario_state_dict(rank, world, tmp):
    path = os.path.join(tmp, f"rank{rank}.pt")
    whole, opt = _checkpointed_run(rank, path, resume=False)
    resumed, opt2 = _checkpointed_run(rank, path, resume=True)
    saved = opt.state_dict()
    # A plain inner-optimizer state dict loads into the wrapped optimizer and leaves gradzip's state alone.
    residuals = {k: v["residual"].clone() for k, v in opt2.gradzip_state.tensors.items()}
    opt2.load_state_dict(opt.optimizer.state_dict())
    untouched = residuals.keys() == opt2.gradzip_state.tensors.keys() and all(
        torch.equal(v, opt2.gradzip_state.tensors[k]["residual"]) for k, v in residuals.items())
    return {"whole": _flat(whole), "resumed": _flat(resumed), "keys": sorted(saved),
            "momentum_in_state": all("momentum_buffer" in s for s in saved["state"].values()) and bool(saved["state"]),
            "gradzip_steps": saved["gradzip"]["steps"], "plain_load_leaves_gradzip": untouched,
            "lr": opt2.param_groups[0]["lr"]}


SCENARIOS = ["schedulers", "grad_scaler", "unscale_clip", "grad_after_backward", "accumulate", "zero_grad",
             "add_param_group", "unfreeze", "rewrapped", "duplicates", "reentrant_checkpoint", "failed_backward",
             "state_dict"]


def _scenarios(rank, world, tmp):
    return run_scenarios({name: globals()[f"scenario_{name}"] for name in SCENARIOS}, rank, world, tmp)


# -- tests ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_workers(_scenarios, 2, str(tmp_path_factory.mktemp("ckpt")), timeout=180)


def _result(ranks, name):
    for r in ranks:
        if isinstance(r[name], dict) and "error" in r[name]:
            pytest.fail(f"scenario {name} raised:\n{r[name]['error']}")
    return [r[name] for r in ranks]


def _assert_equal_lists(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_is_a_torch_optimizer_sharing_the_wrapped_optimizers_objects():
    model = workers.small_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = gradzip.DistributedOptimizer(inner, model.named_parameters(), "topk", ratio=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups and opt.defaults is inner.defaults and opt.state is inner.state
    assert isinstance(opt.gradzip_state, gradzip.GradzipState)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _loss(model, 0, 0).backward()
    opt.step()
    sched.step()
    assert calls == ["pre", "post"]
    assert inner.param_groups[0]["lr"] == 0.05
    assert all("momentum_buffer" in inner.state[p] for p in model.parameters())
    # load_state_dict replaces the inner optimizer's containers: the wrapper still sees the current ones
    opt.load_state_dict(opt.state_dict())
    assert opt.param_groups is inner.param_groups and opt.state is inner.state


def test_lr_schedulers_change_the_step(ranks):
    a, b = _result(ranks, "schedulers")
    for kind in ("step", "lambda", "onecycle"):
        for r in (a, b):
            assert r[kind]["same_groups"]
            assert r[kind]["lrs"] == r[kind]["inner_lrs"]
            assert len(set(r[kind]["lrs"])) == STEPS, (kind, r[kind]["lrs"])
            torch.testing.assert_close(r[kind]["params"], r[kind]["reference"], rtol=1e-5, atol=1e-6)
        assert torch.equal(a[kind]["params"], b[kind]["params"])


def test_grad_scaler_skips_an_overflow_on_one_rank_on_every_rank(ranks):
    a, b = _result(ranks, "grad_scaler")
    assert a[2]["finite_after_backward"] is False  # rank 0's own gradients were finite: it got the NaNs
    for r in (a, b):
        assert [row["stepped"] for row in r] == [True, True, False, True]
        assert [row["scale"] for row in r] == [2.0**10, 2.0**10, 2.0**9, 2.0**9]
        # the poisoned exchange left this rank's error-feedback residuals as they were
        assert r[2]["residuals"].keys() == r[1]["residuals"].keys() and r[1]["residuals"]
        _assert_equal_lists(list(r[2]["residuals"].values()), list(r[1]["residuals"].values()))
    for x, y in zip(a, b):
        assert torch.equal(x["params"], y["params"])


def test_unscale_clip_and_step_see_the_averaged_gradient(ranks):
    a, b = _result(ranks, "unscale_clip")
    for x, y in zip(a, b):
        assert torch.equal(x["norm"], y["norm"])
        torch.testing.assert_close(x["norm"], x["expected_norm"])
        assert x["norm"] > 0.05 and x["clipped"] <= 0.05 * (1 + 1e-5)
        assert torch.equal(x["params"], y["params"])


def test_grad_holds_the_average_when_backward_returns(ranks):
    a, b = _result(ranks, "grad_after_backward")
    for x, y in zip(a, b):
        _assert_equal_lists(x["grads"], y["grads"])
        for g, e in zip(x["grads"], x["expected"]):
            torch.testing.assert_close(g, e)
        assert x["exchanges_in_step"] == 0
        assert torch.equal(x["params"], y["params"])


def test_backward_passes_per_step_averages_the_accumulated_sum_at_the_last_backward(ranks):
    a, b = _result(ranks, "accumulate")
    for x, y in zip(a, b):
        first_grads, first_local, exchanges = x["after_first"]
        for g, l in zip(first_grads, first_local):
            torch.testing.assert_close(g, l)  # the first pass stays local
        _assert_equal_lists(x["grads"], y["grads"])
        for g, e in zip(x["grads"], x["expected"]):
            torch.testing.assert_close(g, e)


def test_zero_grad_both_ways(ranks):
    a, b = _result(ranks, "zero_grad")
    for r in (a, b):
        assert all(g is not None and not g.any() for g in r["zeroed"])
        assert all(g is None for g in r["none_explicit"]) and all(g is None for g in r["none_default"])
        for g, e in zip(r["after_zeros"], r["expected"]):
            torch.testing.assert_close(g, e)
    _assert_equal_lists(a["after_zeros"], b["after_zeros"])
    assert torch.equal(a["params"], b["params"])


def test_add_param_group_hooks_and_buckets_the_new_parameters(ranks):
    a, b = _result(ranks, "add_param_group")
    for r in (a, b):
        assert r["lrs"] == [0.1, 0.05] and r["inner_groups"] == 2
        assert {"param_group1.0", "param_group1.1"} <= set(r["names"])
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)
    _assert_equal_lists(a["grads"], b["grads"])
    assert torch.equal(a["params"], b["params"])


def test_parameters_unfrozen_later_are_averaged(ranks):
    a, b = _result(ranks, "unfreeze")
    for r in (a, b):
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)
        assert {"0.weight", "0.bias", "4.weight"} <= set(r["names"])
    assert torch.equal(a["params"], b["params"])


def test_a_new_wrapper_after_close_exchanges_alone(ranks):
    for r in _result(ranks, "rewrapped"):
        assert r["old"] == r["new"] > 0  # one step each: the closed one counted no more
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)


def test_a_parameter_named_twice_is_exchanged_once_a_pass(ranks):
    for r in _result(ranks, "duplicates"):
        assert r["pending_after_one"] == [] and "tied" not in r["names"] and "0.weight" in r["names"]
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)


def test_reentrant_checkpointing_exchanges_once_a_backward(ranks):
    a, b = _result(ranks, "reentrant_checkpoint")
    for r in (a, b):
        assert r["exchanges"] == r["buckets"], r  # each bucket once, when the outer backward ends
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)
    _assert_equal_lists(a["grads"], b["grads"])


def test_a_backward_that_raised_leaves_the_next_step_averaged(ranks):
    a, b = _result(ranks, "failed_backward")
    for r in (a, b):
        assert r["failed"]
        for g, e in zip(r["grads"], r["expected"]):
            torch.testing.assert_close(g, e)
    assert torch.equal(a["params"], b["params"])


def test_frozen_parameters_need_no_name_until_they_are_unfrozen():
    """An optimizer over model.parameters() and names for the trainable ones only: fine while the others
    stay frozen; one of them unfrozen raises at the step (its gradient would not be averaged)."""
    model = workers.small_model()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       [(n, p) for n, p in model.named_parameters() if p.requires_grad], "none")
    _loss(model, 0, 0).backward()
    opt.step()
    model[0].weight.requires_grad_(True)
    opt.zero_grad()
    with pytest.raises(ValueError, match="has no name in named_parameters was unfrozen"):
        _loss(model, 0, 1).backward()
    opt.close()


def test_a_tied_tensor_keeps_its_first_place():
    """Named twice, a tensor is bucketed where its first name stands (buckets go out in reverse order of
    the names, as backward makes gradients): not last, which would hold every bucket until backward ends."""
    model = workers.small_model()
    named = list(model.named_parameters())
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named + [("tied", named[0][1])],
                                       "none", bucket_cap_mb=0.001)
    assert [n for bucket in opt._buckets for n, _ in bucket] == [n for n, _ in reversed(named)]
    opt.close()


def test_a_closed_wrapper_of_momentum_leaves_the_parameters_to_the_next():
    """DGC marks its parameters against optimizers with momentum; closed, it lets go of them, so a new
    wrapper with AdamW and Top-k steps them."""
    model = workers.small_model()
    dgc = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "dgc")
    dgc.close()
    adam = gradzip.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1), model.named_parameters(), "topk")
    _loss(model, 0, 0).backward()
    adam.step()
    adam.close()


def test_optimizer_parameters_without_a_name_are_refused():
    model = workers.small_model()
    extra = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1)
    with pytest.raises(ValueError, match="1 parameter.s. of the optimizer are not in named_parameters: each needs a "
                                         "name, or its gradient would not be averaged") as err:
        gradzip.DistributedOptimizer(opt, model.named_parameters())
    assert "\n" not in str(err.value)


def test_state_dict_saves_loads_weights_only_and_resumes_bit_for_bit(ranks):
    a, b = _result(ranks, "state_dict")
    for r in (a, b):
        assert r["keys"] == ["gradzip", "param_groups", "state"]
        assert r["momentum_in_state"] and r["gradzip_steps"]
        assert torch.equal(r["whole"], r["resumed"])
        assert r["plain_load_leaves_gradzip"]
        assert r["lr"] == pytest.approx(0.1 * 0.7**STEPS)
    assert torch.equal(a["whole"], b["whole"])


def test_importing_gradzip_leaves_dtensor_unimported():
    """DTensor's module costs half a second in every process that imports gradzip (each torchrun worker):
    gradzip asks for it only where something else has imported it."""
    import subprocess
    import sys
    code = "import sys, gradzip; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


def test_dtensor_parameters_are_refused(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    with workers.one_rank_group("gloo", tmp_path):
        shard = nn.Parameter(distribute_tensor(torch.zeros(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)]))
        plain = nn.Parameter(torch.zeros(3))
        with pytest.raises(ValueError, match="got DTensor shards"):
            gradzip.DistributedOptimizer(torch.optim.SGD([plain, shard], lr=0.1), compressor="topk")
        gradzip.DistributedOptimizer(torch.optim.SGD([plain], lr=0.1), compressor="topk").gradzip_state.close()


def test_a_bucket_holds_one_device():
    """A model spread over devices in one process: buckets split where the device changes (in backward's
    order), as well as at the cap (meta tensors stand for a second device here)."""
    from gradzip.integrations.optimizer import _buckets
    named = [("a", torch.zeros(4)), ("b", torch.zeros(4, device="meta")), ("c", torch.zeros(4, device="meta")),
             ("d", torch.zeros(4))]
    assert [[n for n, _ in b] for b in _buckets(named, cap_bytes=1 << 20)] == [["d"], ["c", "b"], ["a"]]
    assert [[n for n, _ in b] for b in _buckets(named, cap_bytes=20)] == [["d"], ["c"], ["b"], ["a"]]
