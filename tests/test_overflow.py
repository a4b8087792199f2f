"""Compression that overflows, and 16-bit dense averaging, in real 2-process gloo groups."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradzip
from tests.distributed import run_workers
from tests.workers import params_for

# Methods whose wire values can overflow fp16 where the input is finite: without error feedback (with it
# they are sent saturated and the excess kept: tests/test_amp.py).
OVERFLOWING = [
    ("topk", {"ratio": 0.5, "value_dtype": "float16", "feedback": "none"}),
    ("randomk", {"ratio": 0.5, "value_dtype": "float16", "feedback": "none"}),
    ("dgc", {"ratio": 0.5, "value_dtype": "float16", "min_numel": 1, "warmup_steps": 0, "feedback": "none"}),
    ("csc", {"value_dtype": "float16", "feedback": "none"}),
]


def _amp_worker(rank, world, name, params):
    """Train with GradScaler at a loss scale that first overflows fp16 on the wire, then fits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    params = {k: v for k, v in params.items() if k in gradzip.parameters_of(name)}
    state = gradzip.register(ddp, name, **params)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=10_000)
    gen = torch.Generator().manual_seed(rank)
    skipped, taken = 0, 0
    for _ in range(14):
        x = torch.randn(16, 32, generator=gen)
        before_params = [p.detach().clone() for p in model.parameters()]
        before_state = state.state_dict()
        opt.zero_grad()
        scale = scaler.get_scale()
        scaler.scale(ddp(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        if scaler.get_scale() < scale:  # found inf: the step was skipped, and must have changed nothing
            skipped += 1
            assert all(torch.equal(a, b) for a, b in zip(before_params, model.parameters()))
            after_state = state.state_dict()
            assert after_state["steps"] == before_state["steps"]
            for key, slot in before_state["tensors"].items():
                assert all(torch.equal(v, after_state["tensors"][key][n]) for n, v in slot.items())
        else:
            taken += 1
        for slot in state.tensors.values():
            assert all(torch.isfinite(v).all() for v in slot.values() if v.is_floating_point())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    result = {"skipped": skipped, "taken": taken, "params": [p.detach().clone() for p in model.parameters()],
              "nonfinite": state.stats()["nonfinite_exchanges"], "per_step": state.stats()["exchanges"] / 14}
    state.close()
    return result


@pytest.mark.parametrize("name,params", OVERFLOWING, ids=[n for n, _ in OVERFLOWING])
def test_gradscaler_backs_off_when_the_wire_overflows_and_state_stays_finite(name, params):
    ranks = run_workers(_amp_worker, 2, name, params)
    for r in ranks:
        # 2^24 times gradients of order 1e-2..1 overflows fp16 (65504) for several halvings, then fits.
        assert r["skipped"] >= 3, r
        assert r["taken"] >= 3, r  # once the scale fits, steps are taken
        assert r["nonfinite"] == r["skipped"] * r["per_step"]  # every bucket of each skipped step
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def _sum_overflow_worker(rank, world):
    out = {}
    for name, params in (("topk", {"ratio": 0.01}), ("randomk", {"ratio": 1.0}), ("dropping", {})):
        state = gradzip.GradzipState(name, **params)
        grad = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 1e-3
        grad[123] = 3e38  # finite on each rank; the sum of the two is not
        first = state.exchange([("w", grad)])[0].clone()
        out[name] = {"first": first, "state": {k: v.clone() for k, v in state.tensors.get("w", {}).items()},
                     "next": state.exchange([("w", grad * 1e-40)])[0].clone()}
        state.close()
    return out


def test_a_sparse_sum_that_overflows_is_caught_where_it_was_sent():
    # The finiteness check reads a sparsifier's aggregate only where something was sent (it is zero
    # elsewhere): the position whose sum overflowed is among those.
    for rank in run_workers(_sum_overflow_worker, 2):
        for name, got in rank.items():
            assert got["first"].isnan().all(), name
            assert got["state"] == {} or all(torch.isfinite(v).all() for v in got["state"].values()), name
            assert torch.isfinite(got["next"]).all(), name


def _fused_check_worker(rank, world):
    """A NaN on one rank only, in a tensor large enough that error feedback checks g + e itself."""
    out = {}
    for name in ("topk", "randomk", "efsignsgd", "powersgd", "none", "fp16"):  # the last two: no input check
        state = gradzip.GradzipState(name, **params_for(name))
        gen = torch.Generator().manual_seed(rank)
        step = lambda: [("big", torch.randn(600, 500, generator=gen)), ("small", torch.randn(40, generator=gen))]
        for _ in range(3):
            state.exchange(step())
        saved = {k: v.clone() for k, v in state.tensors.get("big", {}).items()}
        bad = step()
        if rank == 1:
            bad[0][1].view(-1)[299_000] = float("nan")
        aggregates = state.exchange(bad)
        out[name] = {"nan": all(a.isnan().all() for a in aggregates), "nonfinite": state.stats()["nonfinite_exchanges"],
                     "kept": all(torch.equal(v, state.tensors["big"][k]) for k, v in saved.items()),
                     "stateful": bool(saved),
                     "next": state.exchange(step())[0].clone()}
        state.close()
    return out


def test_a_nan_found_by_error_feedback_on_one_rank_skips_the_step_on_every_rank():
    ranks = run_workers(_fused_check_worker, 2)
    for name in ranks[0]:
        for rank in ranks:
            assert rank[name]["nan"] and rank[name]["kept"] and rank[name]["nonfinite"] == 1, name
            assert rank[name]["stateful"] == (name not in ("none", "fp16")), name
        assert torch.isfinite(ranks[0][name]["next"]).all() and torch.equal(ranks[0][name]["next"], ranks[1][name]["next"])


def _fp16_dense_worker(rank, world):
    out = {}
    for name in gradzip.compressors():
        state = gradzip.GradzipState(name, **params_for(name))
        grads = [("bias", torch.full((4,), 40000.0, dtype=torch.float16)),
                 ("weight", torch.full((64, 32), 40000.0, dtype=torch.float16))]
        out[name] = [a.clone() for a in state.exchange(grads)]
        state.close()
    return out


def test_sixteen_bit_gradients_are_divided_before_they_are_summed():
    """Two workers each holding 40000 in fp16 average to 40000 (PyTorch's fp16 hook divides first);
    summing first gives inf (65504 is fp16's largest value)."""
    ranks = run_workers(_fp16_dense_worker, 2)
    for name, aggregates in ranks[0].items():
        assert all(a.dtype == torch.float16 for a in aggregates), name
        # Finite, or (an unbiased quantiser's estimate above 65504) the whole step handled as overflow.
        assert all(torch.isfinite(a).all() for a in aggregates) or all(a.isnan().all() for a in aggregates), name
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(aggregates, ranks[1][name])), name
    exact = torch.full((4,), 40000.0, dtype=torch.float16)
    for name in ("none", "fp16", "powersgd", "auto"):  # dense, or the dense path of a compressing method
        assert all(torch.equal(a, torch.full_like(a, 40000.0)) for a in ranks[0][name]), name
    for name in ("dgc", "csc"):  # biases are sent densely
        assert torch.equal(ranks[0][name][0], exact), name
    assert sum(all(a.isnan().all() for a in aggs) for aggs in ranks[0].values()) <= 2  # qsgd, natural


def test_dense_fp32_average_is_the_same_whether_divided_first():
    """For 2 (a power of two) workers, dividing first changes no bit of an fp32 average."""
    state = gradzip.GradzipState("none")
    x = torch.randn(1000) * 1e3
    assert torch.equal(state.exchange([("x", x)])[0], x)
    assert not math.isnan(state.stats()["ratio"])
