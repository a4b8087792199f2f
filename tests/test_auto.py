"""``auto``: timed trials choose the fastest candidate per bucket, identically on every rank."""
from __future__ import annotations


import pytest
import torch

import gradzip
from gradzip import feedback
from gradzip.collectives import Transport, simulate
from gradzip.compressors.base import TensorContext
from tests import workers
from tests.distributed import run_workers


class EmulatedLink(workers.DelayedTransport):
    """Sleeps ``latency_s + bytes * s_per_byte`` before each collective: a link of known speed."""

    def __init__(self, inner: Transport, latency_s: float, s_per_byte: float):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.latency_s, self.s_per_byte = latency_s, s_per_byte

    def delay_s(self, flat) -> float:
        return self.latency_s + flat.numel() * flat.element_size() * self.s_per_byte


def _train_on_link(latency_s, s_per_byte, candidates=None, steps=6):
    """Two thread workers exchanging a 512x512 weight and its bias; returns each rank's state."""
    params = {"warmup": 0, "trials": 1}
    if candidates is not None:
        params["candidates"] = candidates

    def work(rank, transport):
        state = gradzip.GradzipState("auto", transport=EmulatedLink(transport, latency_s, s_per_byte), **params)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            state.exchange([("w", torch.randn(512, 512, generator=gen)), ("b", torch.randn(512, generator=gen))])
        return state

    return workers.run_threads(2, work)


def _choices(state):
    return {key: spec.partition(":")[0] for key, spec in state.compressor.choices(state.tensors).items()}


def test_slow_link_chooses_a_compressed_candidate_on_every_rank():
    # 50 MB/s: the dense 1 MB weight takes 20 ms, PowerSGD's and Top-k's payloads well under 1 ms.
    states = _train_on_link(0.0, 20e-9)
    choices = [_choices(s) for s in states]
    assert choices[0] == choices[1]
    assert choices[0]["w"] in ("powersgd", "topk")
    cost = states[0].tensors["w"]["auto_cost"]
    assert cost[0] > 2 * cost.min()  # the measured dense cost really was the slow one


def test_latency_bound_link_stays_dense_and_leaves_the_bucket_to_a_plain_allreduce():
    # 30 ms per message and free bytes: PowerSGD's two rounds cost twice dense's one.
    states = _train_on_link(0.03, 0.0, candidates=["none", "powersgd:rank=2,dense_steps=0"], steps=4)
    for state in states:
        assert _choices(state) == {"w": "none", "b": "none"}
        assert "residual" not in state.tensors["w"]  # dropped when the decision sent it densely
        named = [("w", torch.zeros(512, 512)), ("b", torch.zeros(512))]
        assert not state.compressor.compresses(state.context("w", named[0][1]))
        assert state.sends_dense(named)


def _agree(per_rank_times, candidates=("none", "fp16"), trials=2):
    """Run the step that starts a new round on two ranks with the given measured times; returns each
    rank's staged updates."""
    compressor = gradzip.make("auto", candidates=list(candidates), warmup=0, trials=trials)
    gens, contexts = [], []
    for rank, times in enumerate(per_rank_times):
        ctx = TensorContext("w", torch.Size([8, 8]), torch.float32, step=9, rank=rank, world_size=2,
                            state={"auto_times": torch.tensor(times, dtype=torch.float64)})
        gens.append([feedback.exchange(compressor, torch.randn(8, 8), ctx)])
        contexts.append(ctx)
    outs = simulate(gens)
    assert all(o[0].aggregate.shape == (8, 8) for o in outs)
    return [ctx.updates for ctx in contexts]


def _choice(updates):
    return [None if u.get("auto_choice") is None else int(u["auto_choice"]) for u in updates]


def test_decision_takes_each_candidates_fastest_rank_and_agrees():
    # Medians: rank 0 says none 1.0, fp16 0.3; rank 1 says none 0.8, fp16 0.9.  Min over ranks:
    # none 0.8, fp16 0.3 -> fp16 on both ranks, although rank 1 alone would have kept dense.
    assert _choice(_agree([[[1.0, 1.0], [0.3, 0.3]], [[0.8, 0.8], [0.9, 0.9]]])) == [1, 1]
    # fp16 is faster, but not by the 25% margin: stay dense.
    assert _choice(_agree([[[0.5, 0.5], [0.47, 0.47]], [[0.6, 0.6], [0.6, 0.6]]])) == [0, 0]
    # fp16 is 4x faster but saves only 3 ms per step (< min_saving_ms = 5): stay dense.
    assert _choice(_agree([[[0.004, 0.004], [0.001, 0.001]]] * 2)) == [0, 0]
    assert _choice(_agree([[[0.010, 0.010], [0.001, 0.001]]] * 2)) == [1, 1]


def test_rounds_drop_slow_candidates_and_stop_early():
    inf = float("inf")
    three = ("none", "fp16", "topk:ratio=0.01")
    # After round one of two: none 1.0 and fp16 0.9 are more than twice topk's 0.3: topk is chosen now.
    early = _agree([[[1.0, inf], [0.9, inf], [0.3, inf]], [[1.1, inf], [1.0, inf], [0.4, inf]]], three)
    assert _choice(early) == [2, 2]
    # none 1.2 is dropped, fp16 0.6 and topk 0.5 race on: no choice yet, and this same step runs fp16's
    # second trial.
    race = _agree([[[1.2, inf], [0.6, inf], [0.5, inf]]] * 2, three)
    for updates in race:
        assert updates["auto_active"].tolist() == [False, True, True] and "auto_choice" not in updates
        assert torch.isfinite(updates["auto_times"]).sum(dim=1).tolist() == [1, 2, 1]


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="candidates must be a non-empty list"):
        gradzip.make("auto", candidates=[])
    with pytest.raises(ValueError, match="auto cannot be its own candidate"):
        gradzip.make("auto", candidates=["none", "auto"])
    with pytest.raises(ValueError, match="give feedback to auto itself"):
        gradzip.make("auto", candidates=["topk:feedback=none"])
    with pytest.raises(ValueError, match="unknown compressor 'tpk'"):
        gradzip.make("auto", candidates="none;tpk")
    with pytest.raises(ValueError, match="candidate 'topk:ratio=2': ratio must be"):
        gradzip.make("auto", candidates=["none", "topk:ratio=2"])
    with pytest.raises(ValueError, match="margin must be"):
        gradzip.make("auto", margin=1.0)
    with pytest.raises(ValueError, match="drop must be a number >= 1"):
        gradzip.make("auto", drop=0.5)
    with pytest.raises(ValueError, match="min_saving_ms must be a finite number >= 0"):
        gradzip.make("auto", min_saving_ms=-1)
    with pytest.raises(ValueError, match="trials must be an integer >= 1"):
        gradzip.make("auto", trials=0)
    assert gradzip.make("auto", candidates="none; fp16").candidates == ("none", "fp16")


def test_ddp_hook_sends_dense_buckets_through_a_plain_allreduce():
    results = run_workers(workers.ddp_auto_against_plain_ddp, 2, 6)
    for (plain, _), (auto, plain_per_step) in results:
        torch.testing.assert_close(auto, plain, rtol=1e-6, atol=1e-7)
        # Step 0 is warm-up (dense), step 1 the single trial, step 2 the decision (sent densely by
        # auto itself); from step 3 on every bucket goes through the plain allreduce.
        assert [n > 0 for n in plain_per_step] == [True, False, False, True, True, True]
    assert torch.equal(results[0][1][0], results[1][1][0])


def test_tensors_of_one_bucket_record_one_time():
    # A big and a tiny tensor in one exchange: each records the bucket's whole exchange time, so their
    # costs are identical (without this the tiny one, finishing first, saw only part of it).
    state = gradzip.GradzipState("auto", warmup=0, trials=1)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        state.exchange([("big", torch.randn(300, 300, generator=gen)), ("small", torch.randn(7, generator=gen))])
        if step < 4:
            big, small = state.tensors["big"]["auto_times"], state.tensors["small"]["auto_times"]
            assert torch.equal(big, small) and torch.isfinite(big).sum() == step + 1
    assert torch.equal(state.tensors["big"]["auto_cost"], state.tensors["small"]["auto_cost"])
