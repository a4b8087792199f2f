"""``auto``: timed trials choose the fastest candidate per bucket, identically on every rank."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import gradzip
from gradzip import feedback
from gradzip.collectives import simulate
from gradzip.compressors.autoschedule import AutoState, ScheduleConfig, Turn, schedule
from gradzip.compressors.base import TensorContext
from tests import workers
from tests.distributed import run_workers


def _train_on_link(latency_s, s_per_byte, candidates=None, steps=6):
    """Two thread workers exchanging a 512x512 weight and its bias; returns each rank's state."""
    params = {"warmup": 0, "trials": 1, "verify": 1}
    if candidates is not None:
        params["candidates"] = candidates

    def work(rank, transport):
        state = gradzip.GradzipState("auto", transport=workers.EmulatedLink(transport, latency_s, s_per_byte), **params)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(steps):
            state.exchange([("w", torch.randn(512, 512, generator=gen)), ("b", torch.randn(512, generator=gen))])
        return state

    return workers.run_threads(2, work)


def _choices(state):
    return {key: spec.partition(":")[0] for key, spec in state.compressor.choices(state.tensors).items()}


def test_slow_link_chooses_a_compressed_candidate_on_every_rank():
    # 12.5 MB/s: the dense 1 MB weight takes 80 ms, PowerSGD's and Top-k's payloads about 1 ms; a loaded
    # machine (CI runs other tests beside this one) moves a step's compute by tens of milliseconds, which
    # at 50 MB/s (20 ms dense) once left the plan no faster than dense steps, so auto kept none.
    states = _train_on_link(0.0, 80e-9, steps=14)
    choices = [_choices(s) for s in states]
    assert choices[0] == choices[1]
    assert choices[0]["w"] in ("powersgd", "topk")
    cost = states[0].tensors["w"]["auto_cost"]
    assert cost[0] > 2 * cost.min()  # the measured dense cost really was the slow one
    plan_s, dense_s = states[0].tensors["w"]["auto_step_cost"].tolist()
    assert plan_s < 0.95 * dense_s  # and whole steps were faster with it


def test_latency_bound_link_stays_dense_and_leaves_the_bucket_to_a_plain_allreduce():
    # 30 ms per message and free bytes: PowerSGD's two rounds cost twice dense's one.
    states = _train_on_link(0.03, 0.0, candidates=["none", "powersgd:rank=2,dense_steps=0"], steps=4)
    for state in states:
        assert _choices(state) == {"w": "none", "b": "none"}
        assert "residual" not in state.tensors["w"]  # dropped when the decision sent it densely
        named = [("w", torch.zeros(512, 512)), ("b", torch.zeros(512))]
        assert not state.compressor.compresses(state.context("w", named[0][1]))
        assert state.plain_allreduce_dtype(named) == torch.float32


def _agree(per_rank_state, position, candidates=("none", "fp16"), trials=2, periods=(), **params):
    """Run one step of one tensor on two ranks, ``position`` steps after its exploration began, from
    the given per-rank :class:`AutoState` fields and whole-step times ``periods`` (told to each rank's
    auto as the starts of this tensor's exchanges; one list for every rank, or a list per rank); returns
    each rank's staged state."""
    gens, contexts, blanks = [], [], []
    for rank, fields in enumerate(per_rank_state):
        compressor = gradzip.make("auto", candidates=list(candidates), warmup=0, trials=trials, **params)
        clock = periods[rank] if periods and isinstance(periods[0], (list, tuple)) else periods
        for now in [sum(clock[:i]) for i in range(len(clock) + 1)]:
            compressor.observe_step(["w"], 100.0 + now)
        blank = AutoState.blank(ScheduleConfig(len(candidates), 0, trials, compressor.verify))
        state = dataclasses.replace(blank, begin=20 - position, **{
            k: v if isinstance(v, int) else torch.tensor(v, dtype=torch.bool if k == "active" else torch.float64)
            for k, v in fields.items()})
        saved = {k: v for k, v in state.saved(blank).items() if v is not None}
        ctx = TensorContext("w", torch.Size([8, 8]), torch.float32, step=20, rank=rank, world_size=2, state=saved)
        gens.append([feedback.exchange(compressor, torch.randn(8, 8), ctx)])
        contexts.append(ctx)
        blanks.append(blank)
    outs = simulate(gens)
    assert all(o[0].aggregate.shape == (8, 8) for o in outs)
    return [AutoState.load(ctx.get, blank) for ctx, blank in zip(contexts, blanks)]


def _plan(per_rank_times, candidates=("none", "fp16"), trials=2):
    """The plan each rank takes at the end of exploration from these measured times."""
    states = _agree([{"times": t} for t in per_rank_times], trials * len(candidates), candidates, trials)
    return [s.choice if s.choice is not None else s.plan for s in states]


def test_plan_takes_each_candidates_fastest_rank_and_agrees():
    # Rank 0 says none 1.0, fp16 0.3; rank 1 says none 0.8, fp16 0.9.  Min over ranks: none 0.8,
    # fp16 0.3 -> fp16 on both ranks, although rank 1 alone would have kept dense.
    assert _plan([[[1.0, 1.0], [0.3, 0.3]], [[0.8, 0.8], [0.9, 0.9]]]) == [1, 1]
    # fp16 is faster, but not by the 25% margin: stay dense.
    assert _plan([[[0.5, 0.5], [0.47, 0.47]], [[0.6, 0.6], [0.6, 0.6]]]) == [0, 0]
    # fp16 is 4x faster but saves only 3 ms per step (< min_saving_ms = 5): stay dense.
    assert _plan([[[0.004, 0.004], [0.001, 0.001]]] * 2) == [0, 0]
    assert _plan([[[0.010, 0.010], [0.001, 0.001]]] * 2) == [1, 1]


def test_a_compressing_plan_is_verified_and_a_dense_one_is_final():
    times = [[[1.0, 1.0], [0.3, 0.3]]] * 2
    for state in _agree([{"times": times[0]}] * 2, 4):
        assert state.plan == 1 and state.choice is None
        assert state.steps.shape == (2, 3) and not torch.isfinite(state.steps).any()
        assert not torch.isfinite(state.times).any()  # exploration's records are dropped
    dense = [[[0.5, 0.5], [0.47, 0.47]]] * 2
    assert all(s.choice == 0 and s.plan is None for s in _agree([{"times": dense[0]}] * 2, 4))
    # Without verification the plan is final at once.
    assert all(s.choice == 1 for s in _agree([{"times": times[0]}] * 2, 4, verify=0))


def test_rounds_drop_slow_candidates_and_their_turns_run_the_cheapest():
    inf = float("inf")
    three = ("none", "fp16", "topk:ratio=0.01")
    # After round one of two: none 1.0 and fp16 0.9 are more than twice topk's 0.3: both leave the race.
    # This step is none's turn: topk stands in, untimed, so every bucket keeps one schedule.
    given = [[[1.0, inf], [0.9, inf], [0.3, inf]], [[1.1, inf], [1.0, inf], [0.4, inf]]]
    early = _agree([{"times": t} for t in given], 3, three)
    for state, times in zip(early, given):
        assert state.active.tolist() == [False, False, True] and state.choice is None
        assert state.times.tolist() == times
    # none 1.2 is dropped, fp16 0.6 and topk 0.5 race on.
    race = _agree([{"times": [[1.2, inf], [0.6, inf], [0.5, inf]]}] * 2, 3, three)
    for state in race:
        assert state.active.tolist() == [False, True, True]
    # The next step is fp16's turn, and it is timed.
    nxt = _agree([{"times": [[1.2, inf], [0.6, inf], [0.5, inf]], "active": [False, True, True],
                   "cost": [1.2, 0.6, 0.5]}] * 2, 4, three)
    for state in nxt:
        assert torch.isfinite(state.times).sum(dim=1).tolist() == [1, 2, 1]


def test_a_plan_far_ahead_on_whole_exploration_steps_is_kept_unverified():
    times = [[1.0, 1.0], [0.3, 0.3]]
    for fp16_step, verified in ((0.1, False), (0.2, True)):  # dense's exploration step: 0.3 s
        fields = {"times": times, "periods": [[0.3, 0.35], [fp16_step, 0.25]]}
        for state in _agree([fields] * 2, 4):
            assert (state.plan is not None) == verified and (state.choice is not None) != verified
            if not verified:
                assert state.choice == 1
                assert state.step_cost.tolist() == pytest.approx([fp16_step, 0.3])


def _clocked(repetitions):
    """Whole-step times of a verification, as the clock sees them: per repetition (plan step, dense
    step), 4 plan steps then 5 dense ones (the first dense step, flushing the residual, is not timed)."""
    return [t for plan, dense in repetitions for t in [plan] * 4 + [9.9] + [dense] * 4]


def _verified(per_rank, candidates=("none", "fp16"), fields=None, **params):
    """(each rank's choice, the agreed step costs) at the deciding step after a verification whose
    steps each rank's clock saw as ``per_rank`` (a list of (plan, dense) per repetition)."""
    fields = fields or {"plan": 1, "cost": [1.0, 0.3]}
    repetitions = len(per_rank[0])
    explore = 2 * len(candidates)
    states = _agree([fields] * 2, explore + 9 * repetitions, candidates, verify=repetitions,
                    periods=[_clocked(r) for r in per_rank], **params)
    return [s.choice for s in states], states[0].step_cost.tolist(), states


def test_verification_keeps_a_plan_only_if_whole_steps_are_faster():
    choice, cost, _ = _verified([[(0.080, 0.1)]] * 2)
    assert choice == [1, 1] and cost == pytest.approx([0.080, 0.1])  # exchanged as float32
    # Less than step_margin (5%) faster: dense.
    assert _verified([[(0.098, 0.1)]] * 2)[0] == [0, 0]
    assert _verified([[(0.098, 0.1)]] * 2, step_margin=0.0)[0] == [1, 1]
    # The mean over ranks, identical on both: one rank's lucky clock does not carry the plan.
    choice, cost, _ = _verified([[(0.12, 0.1)], [(0.06, 0.1)]])
    assert choice == [1, 1] and cost == pytest.approx([0.09, 0.1])
    assert _verified([[(0.12, 0.1)], [(0.08, 0.1)]])[0] == [0, 0]
    # The median over repetitions: a step an evaluation lengthened (0.5 s) does not count.
    assert _verified([[(0.08, 0.1), (0.5, 0.1), (0.085, 0.1)]] * 2)[0] == [1, 1]
    # No clock (a resumed run lost it): nothing is measured, and the plan stands.
    assert [s.choice for s in _agree([{"plan": 1, "cost": [1.0, 0.3]}] * 2, 4 + 9, verify=1)] == [1, 1]
    # ... unless an earlier plan already won its verification: that one.
    three = ("none", "fp16", "topk:ratio=0.01")
    resumed = {"plan": 1, "best": 2, "cost": [1.0, 0.5, 0.3], "step_cost": [0.08, 0.1]}
    assert [s.choice for s in _agree([resumed] * 2, 6 + 9, three, verify=1)] == [2, 2]


def test_a_rejected_plan_hands_verification_to_the_next_candidate_that_passed():
    """Top-k's exchange was cheapest but its step no faster than dense's: fp16, whose exchange also beat
    dense's clearly, is verified next, from the deciding step on; the fastest plan that won is chosen,
    and dense when none did."""
    three = ("none", "fp16", "topk:ratio=0.01")
    rejected = {"plan": 2, "cost": [1.0, 0.5, 0.3]}
    choice, _, states = _verified([[(0.099, 0.1)]] * 2, three, rejected)
    for state in states:
        assert (state.choice, state.plan) == (None, 1)
        assert state.begin == 20 - 6  # the deciding step (20) is the first plan step of fp16's verification
        assert not torch.isfinite(state.steps).any()
        assert schedule(state, 20, ScheduleConfig(3, 0, 2, 1)) == Turn("verify", 1)
    # fp16 then loses too: nothing is left after it (Top-k was tried first), so dense.
    assert _verified([[(0.099, 0.1)]] * 2, three, dict(rejected, plan=1))[0] == [0, 0]
    # fp16 only 10% faster than dense's exchange (margin 25%): not a plan, so dense after Top-k.
    assert _verified([[(0.099, 0.1)]] * 2, three, dict(rejected, cost=[1.0, 0.9, 0.3]))[0] == [0, 0]
    # A plan that wins is remembered while the next one is verified; the faster winner is the choice.
    for state in _verified([[(0.08, 0.1)]] * 2, three, rejected)[2]:
        assert (state.choice, state.plan, state.best) == (None, 1, 2)
        assert state.step_cost.tolist() == pytest.approx([0.08, 0.1])
    after_topk = {"plan": 1, "best": 2, "cost": [1.0, 0.5, 0.3], "step_cost": [0.08, 0.1]}
    choice, cost, _ = _verified([[(0.07, 0.1)]] * 2, three, after_topk)
    assert choice == [1, 1] and cost == pytest.approx([0.07, 0.1])
    choice, cost, _ = _verified([[(0.09, 0.1)]] * 2, three, after_topk)
    assert choice == [2, 2] and cost == pytest.approx([0.08, 0.1])


def test_exploration_steps_order_the_verifications_and_spare_the_hopeless_ones():
    """Top-k's exchange is cheapest, but fp16's whole exploration steps were the fastest: fp16 is
    verified first, and once it wins, Top-k (explored slower than fp16) is not verified at all.  A plan
    whose exploration steps were no faster than dense's is never verified."""
    three = ("none", "fp16", "topk:ratio=0.01")
    times = [[1.0, 1.0], [0.5, 0.5], [0.3, 0.3]]
    explored = {"times": times, "periods": [[0.10, 0.11], [0.08, 0.09], [0.09, 0.09]]}
    for state in _agree([explored] * 2, 6, three):
        assert (state.plan, state.choice) == (1, None)
        assert state.explored.tolist() == pytest.approx([0.10, 0.08, 0.09])
    # Without verification the cheapest exchange is final, as before.
    assert [s.choice for s in _agree([explored] * 2, 6, three, verify=0)] == [2, 2]
    # fp16 wins its verification: Top-k is spared, fp16 is the choice.
    fp16_first = {"plan": 1, "cost": [1.0, 0.5, 0.3], "explored": [0.10, 0.08, 0.09]}
    choice, cost, _ = _verified([[(0.08, 0.1)]] * 2, three, fp16_first)
    assert choice == [1, 1] and cost == pytest.approx([0.08, 0.1])
    # fp16 loses it: Top-k, faster than dense in exploration, still gets its turn.
    for state in _verified([[(0.099, 0.1)]] * 2, three, fp16_first)[2]:
        assert (state.plan, state.choice, state.best) == (2, None, None)
    # Exploration steps no faster than dense's: no plan, dense without a verification.
    slow = {"times": times, "periods": [[0.10, 0.11], [0.10, 0.12], [0.11, 0.13]]}
    assert [(s.choice, s.plan) for s in _agree([slow] * 2, 6, three)] == [(0, None)] * 2


def test_verification_on_a_real_slow_link_keeps_the_plan_unless_it_slows_the_step():
    # Two processes over gloo, every exchange through an emulated 3.1 MB/s link.  Exploration (steps 0
    # and 1) picks Top-k's exchange (under 4 ms against 175 ms dense) every time; whole steps then
    # decide.  Top-k's exploration step under half of dense's (about 15 ms against 185): kept
    # unverified.  A codec that slows whole steps as much in exploration (+250 ms) loses there, with no
    # verification; one that slows them a little in exploration (+110 ms: two thirds of dense's step,
    # between half of it and all of it) and more later is verified, and loses its verification.  Each
    # exploration step is timed once, so the slow link leaves every outcome 30 ms or more from its edge
    # (some 60 ms of noise in the direction that would cross it): a loaded machine (CI runs other tests
    # beside this one) moves a step's compute by tens of milliseconds.
    for busy_s, busy_exploring_s, expected in ((0.0, None, "topk:ratio=0.01"), (0.25, None, "none"),
                                               (0.25, 0.11, "none")):
        results = run_workers(workers.auto_on_a_slow_link, 2, 13, busy_s, busy_exploring_s)
        params, choices, costs, residual = results[0]
        assert set(choices.values()) == {expected}, (busy_s, choices, costs)
        assert all(torch.equal(r[0], params) and r[1] == choices for r in results[1:])
        step_cost = costs["0.weight"]
        assert (step_cost is None) == (busy_s > 0 and busy_exploring_s is None), costs
        if step_cost is not None:
            plan_s, dense_s = step_cost.tolist()
            assert (plan_s < dense_s) == (expected != "none")
        assert residual == (expected != "none")  # a dense choice leaves no residual behind


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
    with pytest.raises(ValueError, match="step_margin must be a number with 0 <= step_margin < 1"):
        gradzip.make("auto", step_margin=-0.1)
    with pytest.raises(ValueError, match="verify must be an integer >= 0"):
        gradzip.make("auto", verify=1.5)
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
