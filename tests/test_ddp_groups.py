"""register() averages over DDP's own process group, through a group of gradzip's own with its ranks.

Real gloo jobs: DDP over two data-parallel subgroups of four ranks (as beside tensor parallelism), and
a state asked to use DDP's group itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gradzip
from tests.distributed import run_workers
from tests.workers import _flat, batch, small_model


def _steps(ddp, model, rank, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return _flat(model)


def over_subgroups(rank, world, folder):
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, as torch asks
    pair = pairs[rank // 2]
    out = {}
    for method in ("topk", "powersgd", "none"):
        model = small_model()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=pair, bucket_cap_mb=0.004)
        state = gradzip.register(ddp, method, **({"ratio": 0.5} if method == "topk" else {}))
        out[method] = _steps(ddp, model, rank)
        out[method + " ranks"] = dist.get_process_group_ranks(state.transport.group) if method != "none" else None
        out[method + " own"] = state.transport.group is not pair and state.transport.group is not dist.group.WORLD
        if method == "topk":  # saved under the global rank, as a script names its files; resumed by {rank}
            torch.save(state.state_dict(), f"{folder}/gradzip_{rank}.pt")
            saved = state.state_dict()
        state.close()
    dist.barrier()
    ddp = nn.parallel.DistributedDataParallel(small_model(), process_group=pair, bucket_cap_mb=0.004)
    resumed = gradzip.register(ddp, "topk", ratio=0.5, resume=f"{folder}/gradzip_{{rank}}.pt")
    out["resumed own residuals"] = all(torch.equal(resumed.tensors[k]["residual"], v["residual"])
                                       for k, v in saved["tensors"].items())
    resumed.close()
    return out


def test_ddp_over_a_subgroup_is_averaged_over_that_subgroup(tmp_path):
    results = run_workers(over_subgroups, 4, str(tmp_path))
    for method in ("topk", "powersgd", "none"):
        a, b, c, d = (r[method] for r in results)
        assert torch.equal(a, b) and torch.equal(c, d), method  # each pair agrees ...
        assert not torch.allclose(a, c), method  # ... and only within itself (different data)
    for rank, r in enumerate(results):
        assert r["topk ranks"] == r["powersgd ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
        assert r["topk own"] and r["powersgd own"]  # a group of gradzip's own: never DDP's
        assert r["resumed own residuals"]  # its own file, not its data-parallel peer rank's of the other pair


def given_ddps_group(rank, world):
    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)
    state = gradzip.register(ddp, "topk", group=ddp.process_group, ratio=0.5)
    own = state.transport.group
    seen = (own is not ddp.process_group, dist.get_process_group_ranks(own), state.dense_group is ddp.process_group)
    params = _steps(ddp, model, rank)
    state.close()
    return seen, params, own in dist.distributed_c10d._world.pg_names  # destroyed at close


def test_ddps_own_group_given_is_copied_and_released_at_close():
    results = run_workers(given_ddps_group, 2)
    for seen, params, alive in results:
        assert seen == (True, [0, 1], True) and not alive
    assert torch.equal(results[0][1], results[1][1])


def over_one_rank_groups(rank, world):
    alone = [dist.new_group([0]), dist.new_group([1])]  # data parallelism of one beside other parallelism
    model = small_model()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=alone[rank], bucket_cap_mb=0.004)
    state = gradzip.register(ddp, "topk", ratio=0.5)
    params = _steps(ddp, model, rank)
    size = state.world_size
    state.close()
    return params, size


def test_ddp_over_a_one_rank_group_averages_nothing():
    (a, size_a), (b, size_b) = run_workers(over_one_rank_groups, 2)
    assert size_a == size_b == 1
    assert not torch.allclose(a, b)  # each rank kept its own gradients (different data)
