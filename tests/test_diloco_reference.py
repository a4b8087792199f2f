"""gradzip.DiLoCo against DiLoCo written here in plain torch, in a real 2-process gloo group.

The reference: each rank trains its replica with its own AdamW; every H steps each rank forms the
pseudo-gradient Δ_r = θ_g − θ_r, ``dist.all_reduce`` averages it, ``torch.optim.SGD(nesterov=True)``
steps a global fp32 copy θ_g with gradient Δ̄, and every replica loads θ_g.  gradzip's DiLoCo with
``compressor="none"`` must give the same replicas after every inner step and the same θ_g after every
sync: bit for bit (two ranks: the sum of two numbers does not depend on their order, and halving is exact).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gradzip
from tests.distributed import run_workers

H, SYNCS = 3, 5
# (outer lr, outer momentum): the paper's Nesterov step, plain averaging, and an outer lr above 1.
SETTINGS = ((0.7, 0.9), (1.0, 0.0), (1.3, 0.5))


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(7919 * step + rank)  # each rank its own data
    return torch.randn(8, 12, generator=g), torch.randint(0, 4, (8,), generator=g)


def _inner_step(model, opt, rank, step):
    x, y = _batch(rank, step)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).clone() for t in tensors])


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)


def _gradzip(rank, outer_lr, momentum, nesterov=True):
    model = _mlp(seed=rank)  # replicas start different: DiLoCo loads rank 0's
    inner = _inner(model)
    outer = gradzip.DiLoCo(model, inner, sync_every=H, compressor="none", outer_lr=outer_lr,
                           outer_momentum=momentum, nesterov=nesterov)
    replicas, theta_g = [], []
    for step in range(H * SYNCS):
        _inner_step(model, inner, rank, step)
        if outer.step():
            theta_g.append(_flat(outer.global_parameters().values()))
        replicas.append(_flat(model.parameters()))
    return replicas, theta_g, outer.stats()["syncs"]


def _reference(rank, world, outer_lr, momentum):
    model = _mlp(seed=rank)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    inner = _inner(model)
    global_params = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    outer = torch.optim.SGD(global_params, lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    replicas, theta_g, before_sync = [], [], []
    for step in range(H * SYNCS):
        _inner_step(model, inner, rank, step)
        if (step + 1) % H == 0:
            before_sync.append(_flat(model.parameters()))
            for g, p in zip(global_params, model.parameters()):
                delta = g.detach() - p.detach().float()
                dist.all_reduce(delta)
                g.grad = delta / world
            outer.step()
            with torch.no_grad():
                for g, p in zip(global_params, model.parameters()):
                    p.copy_(g)
            theta_g.append(_flat(global_params))
        replicas.append(_flat(model.parameters()))
    return replicas, theta_g, before_sync


def _compare(rank, world):
    out = {}
    for outer_lr, momentum in SETTINGS:
        got = _gradzip(rank, outer_lr, momentum)
        want = _reference(rank, world, outer_lr, momentum)
        out[(outer_lr, momentum)] = {"gradzip": got, "reference": want}
    # Heavy-ball instead of Nesterov must NOT match the Nesterov reference: the comparison can fail.
    out["heavy-ball"] = _gradzip(rank, 0.7, 0.9, nesterov=False)
    return out


def test_diloco_equals_a_plain_torch_reference_bit_for_bit():
    ranks = run_workers(_compare, 2)
    for setting in SETTINGS:
        for rank, result in enumerate(ranks):
            (replicas, theta_g, syncs), (ref_replicas, ref_theta_g, _) = (
                result[setting]["gradzip"], result[setting]["reference"])
            assert syncs == SYNCS and len(theta_g) == len(ref_theta_g) == SYNCS
            for step, (mine, ref) in enumerate(zip(replicas, ref_replicas)):
                assert torch.equal(mine, ref), (setting, rank, step, (mine - ref).abs().max().item())
            for sync, (mine, ref) in enumerate(zip(theta_g, ref_theta_g)):
                assert torch.equal(mine, ref), (setting, rank, sync)
        # Replicas trained on different data drift apart between syncs and are equal again after each.
        other = ranks[1][setting]["reference"]
        for sync, (a, b) in enumerate(zip(ranks[0][setting]["reference"][2], other[2])):
            assert not torch.equal(a, b), (setting, sync)
        for step in range(H * SYNCS):
            same = torch.equal(ranks[0][setting]["reference"][0][step], other[0][step])
            assert same == ((step + 1) % H == 0), (setting, step)
        # θ_g moved at every sync.
        thetas = ranks[0][setting]["reference"][1]
        assert all(not torch.equal(a, b) for a, b in zip(thetas, thetas[1:]))
    heavy = ranks[0]["heavy-ball"][1]
    nesterov = ranks[0][(0.7, 0.9)]["reference"][1]
    # First sync: heavy-ball moves θ_g by η·Δ̄, Nesterov by η·(1 + μ)·Δ̄.
    assert all(not torch.equal(a, b) for a, b in zip(heavy, nesterov))
