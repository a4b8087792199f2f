"""gradzip's thread, process group and hook lifecycle in real 2-process gloo jobs."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradzip
from gradzip.launcher import free_port
from tests.distributed import run_workers


def _comm_threads() -> int:
    return sum(t.name == "gradzip-comm" and t.is_alive() for t in threading.enumerate())


def _train(ddp, steps=3, seed=0):
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=gen)).pow(2).mean().backward()
        opt.step()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _close_worker(rank, world):
    seen = {}
    ddp = nn.parallel.DistributedDataParallel(_model())
    with gradzip.register(ddp, "topk", ratio=0.25) as state:
        _train(ddp)
        seen["threads_inside"] = _comm_threads()
        group = state.transport.group
    seen["threads_after_with"] = _comm_threads()
    seen["group_destroyed"] = group not in dist.distributed_c10d._world.pg_map
    try:
        _train(ddp, steps=1)
    except RuntimeError as exc:
        seen["after_close"] = str(exc)
    seen["stats_after_close"] = state.stats()["exchanges"]
    state.close()  # idempotent

    # Destroying the group a state talks over closes the state first.
    ddp2 = nn.parallel.DistributedDataParallel(_model())
    state2 = gradzip.register(ddp2, "efsignsgd")
    _train(ddp2)
    seen["threads_before_destroy"] = _comm_threads()
    dist.destroy_process_group(state2.transport.group)
    seen["threads_after_destroy"] = _comm_threads()
    return seen


def test_close_with_block_and_destroy_process_group_stop_the_thread():
    for seen in run_workers(_close_worker, 2):
        assert seen["threads_inside"] == 1 and seen["threads_after_with"] == 0
        assert seen["group_destroyed"]
        assert "closed" in seen["after_close"] and "\n" not in seen["after_close"]
        assert seen["stats_after_close"] == 3  # one bucket, 3 steps: still readable
        assert seen["threads_before_destroy"] == 1 and seen["threads_after_destroy"] == 0


SCRIPT = textwrap.dedent("""
    import datetime, json, sys, threading, torch, torch.distributed as dist
    from torch import nn
    import gradzip

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=17))
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    state = gradzip.register(ddp, sys.argv[1])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad(); ddp(torch.randn(8, 16)).sum().backward(); opt.step()
    alive = lambda: sum(t.name == "gradzip-comm" for t in threading.enumerate())
    before, rank = alive(), dist.get_rank()
    timeout = state.transport.group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    dist.destroy_process_group()
    with open(f"{sys.argv[2]}/rank{rank}.json", "w") as f:
        json.dump({"before": before, "after": alive(), "closed": state._closed, "timeout": timeout}, f)
""")


def test_destroy_process_group_closes_gradzip_and_the_job_exits_cleanly(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun"), "--master-port", str(free_port()), str(script),
                           "topk", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    # gradzip's own group keeps the script's timeout (a dead peer ends the job after 17 s, not 30 min).
    assert seen == [{"before": 1, "after": 0, "closed": True, "timeout": 17.0}] * 2


def _hook_worker(rank, world, name, params):
    """The same training through register() and through the plain (state, hook) pair."""
    results = {}
    for how in ("register", "plain"):
        ddp = nn.parallel.DistributedDataParallel(_model())
        if how == "register":
            state = gradzip.register(ddp, name, **params)
        else:
            state = gradzip.GradzipState(name, **params)
            ddp.register_comm_hook(state, gradzip.ddp_comm_hook)
        _train(ddp, steps=4)
        results[how] = [p.detach().clone() for p in ddp.parameters()]
        results[how + "_keys"] = sorted(state.steps)
        results[how + "_bytes"] = state.stats()["bytes_sent"]
        state.close()
    return results


@pytest.mark.parametrize("name,params", [("topk", {"ratio": 0.25}), ("powersgd", {"rank": 1, "dense_steps": 1}),
                                         ("efsignsgd", {}), ("none", {})])
def test_plain_state_and_hook_train_like_register(name, params):
    ranks = run_workers(_hook_worker, 2, name, params)
    for r in ranks:
        if name != "powersgd":  # PowerSGD seeds its first basis from the tensor's key, which differs
            assert all(torch.equal(a, b) for a, b in zip(r["register"], r["plain"]))
        assert r["register_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["plain_keys"] == ["param0", "param1", "param2", "param3"]
        assert r["plain_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["plain"], ranks[1]["plain"]))
    assert not all(torch.equal(a, b) for a, b in zip(ranks[0]["plain"], _model().parameters()))


def _early_state_worker(rank, world, path):
    """A state built before init_process_group (as Lightning users do), checkpointed and resumed in a new
    DDP wrapper: the keys it learns are the same, so training continues as if uninterrupted."""
    dist.destroy_process_group()
    state = gradzip.GradzipState("topk", ratio=0.25)  # no process group yet
    # A store of its own: a rank re-joining at the launcher's address could reach the other rank's old
    # store while that rank is still tearing it down ("Failed to recv, got 0 bytes").
    dist.init_process_group("gloo", store=dist.FileStore(f"{path}.store", world), rank=rank, world_size=world)
    ddp = nn.parallel.DistributedDataParallel(_model())
    ddp.register_comm_hook(state, gradzip.ddp_comm_hook)
    _train(ddp, steps=2)
    torch.save({"model": ddp.module.state_dict(), "gradzip": state.state_dict()}, f"{path}.{rank}")
    _train(ddp, steps=2, seed=1)
    straight = [p.detach().clone() for p in ddp.parameters()]
    state.close()

    saved = torch.load(f"{path}.{rank}", weights_only=True)
    model = _model()
    model.load_state_dict(saved["model"])
    ddp = nn.parallel.DistributedDataParallel(model)
    resumed = gradzip.GradzipState("topk", ratio=0.25)
    resumed.load_state_dict(saved["gradzip"])
    ddp.register_comm_hook(resumed, gradzip.ddp_comm_hook)
    _train(ddp, steps=2, seed=1)
    return straight, [p.detach().clone() for p in ddp.parameters()], world == resumed.world_size


def test_state_made_before_the_process_group_resumes_bit_for_bit(tmp_path):
    for straight, resumed, connected in run_workers(_early_state_worker, 2, str(tmp_path / "ckpt")):
        assert connected
        assert all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_register_refuses_models_that_are_not_ddp():
    with pytest.raises(ValueError, match=r"DistributedDataParallel model \(or torch.compile of one\), got Linear"
                       ".*FSDP.*HF Trainer.*"
                       r"gradzip.integrations.transformers.register\(trainer.*gradzip.DistributedOptimizer") as err:
        gradzip.register(nn.Linear(2, 2), "topk")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"DistributedDataParallel model \(or torch.compile of one\), got "
                       "torch.compile of Linear;"):
        gradzip.register(torch.compile(nn.Linear(2, 2)), "topk")


@pytest.mark.parametrize("seed", ["a", 1.5, True, None])
def test_a_seed_that_is_not_an_integer_is_refused(seed):
    with pytest.raises(ValueError, match=r"seed must be an integer \(the same on every rank\), got "):
        gradzip.GradzipState("topk", seed=seed)


def test_hook_refuses_a_state_that_is_not_gradzips():
    with pytest.raises(TypeError, match="needs a gradzip.GradzipState"):
        gradzip.ddp_comm_hook(None, None)


def test_a_state_dict_saved_by_another_rank_is_refused_unless_asked():
    state = gradzip.GradzipState("topk", ratio=0.5)
    state.exchange([("w", torch.randn(8, 8))])
    saved = state.state_dict()
    assert saved["rank"] == 0 and saved["tensors"]["w"]["residual"].abs().sum() > 0
    saved["rank"] = 1
    with pytest.raises(ValueError, match="saved by rank 1 and holds that rank's own residuals") as err:
        gradzip.GradzipState("topk", ratio=0.5).load_state_dict(saved)
    assert "\n" not in str(err.value)
    taken = gradzip.GradzipState("topk", ratio=0.5)
    taken.load_state_dict(saved, any_rank=True)
    assert torch.equal(taken.tensors["w"]["residual"], state.tensors["w"]["residual"])
    plain = gradzip.GradzipState("fp16")  # no per-rank state: any rank's counters load
    plain.exchange([("w", torch.randn(8, 8))])
    saved = plain.state_dict()
    saved["rank"] = 1
    gradzip.GradzipState("fp16").load_state_dict(saved)
