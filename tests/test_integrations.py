"""DistributedOptimizer and DDP-hook behaviour that needs no second process (or uses threads as workers)."""
from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import gradzip
from tests import workers
from tests.distributed import run_workers


def _model():
    return workers.small_model()


def test_dgc_with_optimizer_momentum_is_a_checked_error():
    model = _model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), "dgc")
    x, y = workers.batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match="momentum=0"):
        opt.step()


def test_dgc_with_plain_sgd_and_local_weight_decay_steps():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4),
                                       model.named_parameters(), "dgc", min_numel=0)
    x, y = workers.batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert "momentum" in next(iter(opt.gradzip_state.tensors.values()))


def test_world_size_one_applies_compression_and_feedback():
    # Gradient masking on a single node: nothing is exchanged, but only the top 10% is applied.
    model = _model()
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       "topk", ratio=0.1)
    x, y = workers.batch(0, 0)
    loss = nn.functional.cross_entropy(model(x), y)
    names, params = zip(*model.named_parameters())
    raw = dict(zip(names, torch.autograd.grad(loss, params, retain_graph=True)))  # no hooks: the local gradient
    loss.backward()  # p.grad holds what was applied when backward returns
    opt.synchronize()  # nothing pending: does nothing
    for name, p in model.named_parameters():
        sent = p.grad
        assert int((sent != 0).sum()) == max(1, -(-raw[name].numel() // 10))
        torch.testing.assert_close(sent + opt.gradzip_state.tensors[name]["residual"], raw[name])
    stats = opt.stats()
    assert stats["world_size"] == 1
    kept = sum(max(1, -(-p.numel() // 10)) for p in model.parameters())
    assert stats["density"] == kept / sum(p.numel() for p in model.parameters())
    assert stats["compress_s"] > 0 and stats["decompress_s"] > 0


def test_backward_passes_per_step_averages_the_accumulated_sum():
    def work(rank, transport):
        model = _model()
        opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                           "none", backward_passes_per_step=2, transport=transport)
        local = [torch.zeros_like(p) for p in model.parameters()]
        for micro in range(2):
            x, y = workers.batch(rank, micro)
            loss = nn.functional.cross_entropy(model(x), y)
            for acc, g in zip(local, torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)):
                acc += g
            loss.backward()  # the second one exchanges the accumulated sum before it returns
        return local, [p.grad.clone() for p in model.parameters()]

    results = workers.run_threads(2, work)
    for i in range(len(results[0][0])):
        expected = (results[0][0][i] + results[1][0][i]) / 2
        torch.testing.assert_close(results[0][1][i], expected)
        assert torch.equal(results[0][1][i], results[1][1][i])


def test_parameter_unused_on_one_rank_gets_the_average():
    def work(rank, transport):
        model = _model()
        opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                           "topk", ratio=0.5, transport=transport)
        x, y = workers.batch(rank, 0)
        out = model(x)
        loss = nn.functional.cross_entropy(out, y) if rank == 0 else out.sum() * 0 + model[0](x).sum() * 0
        loss.backward()
        opt.synchronize()
        return [p.grad.clone() for p in model.parameters()]

    a, b = workers.run_threads(2, work)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


_SKIPPED_BRANCH_METHODS = [("topk", {"ratio": 0.3, "bucketed": False}), ("topk", {"ratio": 0.3, "bucketed": True}),
                           ("dgc", {"ratio": 0.3, "min_numel": 0, "warmup_epochs": 0})]


def test_a_parameter_a_rank_did_not_use_keeps_its_error_feedback_under_ddp():
    """find_unused_parameters=True: a rank withholds the feedback state of a parameter it did not use in
    the step; DDP drops the result of one no rank used, so nothing of what it is owed is lost, and one
    used by another rank still gets the average."""
    scenarios = [(name, params, uses) for uses in (workers.branch_on_even_steps, workers.branch_on_rank0_odd_steps)
                 for name, params in _SKIPPED_BRANCH_METHODS]
    results = run_workers(workers.ddp_with_a_skipped_branch, 2, scenarios)
    for i, (name, params, uses) in enumerate(scenarios):
        runs = [results[rank][i] for rank in range(2)]
        assert torch.equal(runs[0][1], runs[1][1]), (name, params, uses.__name__)
        for rank, (steps, _) in enumerate(runs):
            for step, (before, after, moved) in enumerate(steps):
                used = uses(rank, step)
                assert moved == any(uses(r, step) for r in range(2)), (name, params, uses.__name__, rank, step)
                assert before.keys() == after.keys() or step == 0
                kept = all(torch.equal(before[k], after[k]) for k in before)
                assert kept != used or step == 0, (name, params, uses.__name__, rank, step)
            # not vacuous: the branch is owed something when it is skipped
            assert any(v.abs().sum() > 0 for v in steps[3][0].values()), (name, params, rank)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.random.fork_rng():  # the same weights every time, the test process's RNG untouched
            torch.manual_seed(0)
            self.trunk, self.branch, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x, branch):
        h = torch.relu(self.trunk(x))
        return self.head(self.branch(h) if branch else h)


@pytest.mark.parametrize("bucketed", [False, True])
def test_what_ddp_delivers_plus_what_is_owed_is_every_gradient_with_unused_parameters(tmp_path, bucketed):
    """One rank, find_unused_parameters=True, Top-k with its residual: at every synced step, for every
    parameter DDP delivers a result to, delivered + owed now == accumulated gradient + owed before (a
    branch used only in a no_sync() micro-step counts as used, as DDP counts it); a parameter no backward
    reached since its last exchange gets nothing and keeps what it is owed, bit for bit."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model, reference = _Branchy(), _Branchy()
        ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.0001)
        state = gradzip.register(ddp, "topk", ratio=0.3, bucketed=bucketed)
        # per step: whether each micro-step (the last one synced) runs the branch
        plan = [(True,), (False, True), (True, False), (False,), (False, False), (True,)]
        owed = {}
        for step, micro in enumerate(plan):
            ddp.zero_grad()
            reference.zero_grad()
            for i, branch in enumerate(micro):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + i))
                reference(x, branch).square().sum().backward()
                with ddp.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    ddp(x, branch).square().sum().backward()
            for name, p in model.named_parameters():
                g = dict(reference.named_parameters())[name].grad
                residual = state.tensors[name]["residual"]
                before = owed.get(name, torch.zeros_like(residual))
                if g is None:  # no backward reached it since its last exchange
                    assert p.grad is None and torch.equal(residual, before), (step, name)
                else:
                    torch.testing.assert_close(p.grad + residual, g + before, rtol=0, atol=0)
                owed[name] = residual.clone()
        assert any(owed[f"branch.{k}"].abs().sum() > 0 for k in ("weight", "bias"))
        state.close()  # takes its hooks off the parameters
        assert not any(p._backward_hooks for p in model.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compiled", ["inside", "outside"])
def test_a_compiled_model_keeps_its_own_parameter_names(tmp_path, compiled):
    """``DDP(torch.compile(model))`` and ``torch.compile(DDP(model))``: the state is keyed by the model's
    own parameter names, so a checkpoint does not depend on compiling; the exchange is gradzip's."""
    with workers.one_rank_group("gloo", tmp_path):
        model = _model()
        if compiled == "inside":
            ddp = net = nn.parallel.DistributedDataParallel(torch.compile(model, backend="eager"))
        else:
            ddp = nn.parallel.DistributedDataParallel(model)
            net = torch.compile(ddp, backend="eager")
        with gradzip.register(net, "topk", ratio=0.3) as state:
            assert ddp._comm_hooks, "no hook on the DDP model"
            x, y = workers.batch(0, 0)
            nn.functional.cross_entropy(net(x), y).backward()
            assert state.stats()["exchanges"] > 0 and state.stats()["plain_allreduces"] == 0
            saved = state.state_dict()
            assert sorted(saved["tensors"]) == sorted(n for n, _ in model.named_parameters())
        if compiled == "inside":  # a state saved when gradzip named them _orig_mod.<name> resumes as it was
            old = {**saved, "tensors": {f"_orig_mod.{k}": v for k, v in saved["tensors"].items()},
                   "steps": {f"_orig_mod.{k}": v for k, v in saved["steps"].items()}}
            again = nn.parallel.DistributedDataParallel(torch.compile(model, backend="eager"))
            with gradzip.register(again, "topk", ratio=0.3, resume=old) as resumed:
                assert resumed.steps == saved["steps"] and resumed.tensors.keys() == saved["tensors"].keys()


def test_sparse_gradients_are_refused_in_one_line(tmp_path):
    """nn.Embedding(sparse=True) gives sparse gradients, which no method compresses: register() refuses it
    before any step (but for 'none', which leaves DDP's own allreduce), and the hook of a state handed
    to DDP directly refuses the sparse bucket."""
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(20, 4, sparse=True), nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(self.emb(x).mean(1))

    with workers.one_rank_group("gloo", tmp_path):
        message = r"compresses dense gradients, and Embedding 'emb' \(sparse=True\) gives sparse ones, which 'topk'"
        with pytest.raises(ValueError, match=message) as err:
            gradzip.register(nn.parallel.DistributedDataParallel(Bag()), "topk")
        assert "\n" not in str(err.value)
        with gradzip.register(nn.parallel.DistributedDataParallel(Bag()), "none") as state:
            assert state.compressor.name == "none"
        ddp = nn.parallel.DistributedDataParallel(Bag())
        ddp.register_comm_hook(gradzip.GradzipState("topk"), gradzip.ddp_comm_hook)
        with pytest.raises(ValueError, match=r"compresses dense gradients, and the parameter param\d gives sparse"):
            ddp(torch.randint(0, 20, (3, 5))).sum().backward()
        model = Bag()
        opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), "topk")
        with pytest.raises(ValueError, match="compresses dense gradients, and the parameter 'emb.weight' has a sparse"):
            model(torch.randint(0, 20, (3, 5))).sum().backward()


def test_optimizer_rejects_bad_arguments():
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        gradzip.DistributedOptimizer(sgd, model.named_parameters(), backward_passes_per_step=0)
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not in the optimizer"):
        gradzip.DistributedOptimizer(sgd, other.named_parameters())
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        gradzip.register(model, "topk")
    with pytest.raises(TypeError, match=r"named_parameters must give \(name, parameter\) pairs, as "
                                        r"model.named_parameters\(\) does; got a Parameter"):
        gradzip.DistributedOptimizer(sgd, list(model.parameters()))  # parameters() where named_parameters() goes


def test_optimizer_state_dict_resumes_exactly():
    def run(opt_state=None, steps=range(4)):
        model = _model()
        if opt_state is not None:
            model.load_state_dict(opt_state[0])
        opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                           "topk", ratio=0.1)
        if opt_state is not None:
            opt.load_state_dict(opt_state[1])
        for step in steps:
            opt.zero_grad()
            x, y = workers.batch(0, step)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model.state_dict(), opt.state_dict()

    whole = run()
    half = run(steps=range(2))
    resumed = run(half, steps=range(2, 4))
    for k in whole[0]:
        assert torch.equal(whole[0][k], resumed[0][k])


def test_checkpoint_restored_in_fresh_processes_continues_bit_for_bit(tmp_path):
    names = ["none", "topk", "dgc", "csc", "powersgd"]  # one launch runs them all in turn
    whole = run_workers(workers.train_with_checkpoints, 2, names, 8, None, str(tmp_path))
    run_workers(workers.train_with_checkpoints, 2, names, 4, None, str(tmp_path))
    resumed = run_workers(workers.train_with_checkpoints, 2, names, 8, 4, str(tmp_path))
    for rank in range(2):
        for i, name in enumerate(names):
            assert torch.equal(whole[rank][i], resumed[rank][i]), (name, rank)
