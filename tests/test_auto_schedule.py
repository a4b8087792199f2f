"""auto's schedule on its own: a pure function of one tensor's state, the step and the configuration."""
from __future__ import annotations

import dataclasses
import math

import torch

from gradzip.compressors.autoschedule import AutoState, ScheduleConfig, Turn, position, schedule

# Three candidates, one warm-up step, two exploration rounds (steps 1 to 6), two verifications of 9 steps.
CONFIG = ScheduleConfig(candidates=3, warmup=1, trials=2, verify=2)
BLANK = AutoState.blank(CONFIG)


def _state(**fields) -> AutoState:
    return dataclasses.replace(BLANK, **fields)


def test_warmup_until_the_warmup_steps_are_done():
    assert schedule(BLANK, 0, CONFIG) == Turn("warmup", None)
    assert position(BLANK, 0, CONFIG) is None
    # Past the warm-up a tensor that never began explores from its first turn (a late-joining tensor too).
    assert schedule(BLANK, 1, CONFIG) == Turn("explore", 0)
    assert schedule(BLANK, 7, CONFIG) == Turn("explore", 0)
    no_warmup = dataclasses.replace(CONFIG, warmup=0)
    assert schedule(BLANK, 0, no_warmup) == Turn("explore", 0)


def test_exploration_takes_one_turn_per_candidate_each_round():
    began = _state(begin=1)
    turns = [schedule(began, step, CONFIG) for step in range(1, 7)]
    assert turns == [Turn("explore", c) for c in (0, 1, 2, 0, 1, 2)]
    assert position(began, 6, CONFIG) == 5


def test_a_dropped_candidates_turn_runs_the_cheapest_one_still_racing():
    inf = math.inf
    # Round two: none left the race; fp16 (0.6) and topk (0.5) race on, so topk stands in for none.
    raced = _state(begin=1, active=torch.tensor([False, True, True]),
                   cost=torch.tensor([0.2, 0.6, 0.5], dtype=torch.float64))
    assert [schedule(raced, step, CONFIG) for step in range(4, 7)] == [
        Turn("stand-in", 2), Turn("explore", 1), Turn("explore", 2)]
    # The cheapest among the active ones: a dropped candidate's own low cost does not count.
    assert schedule(raced, 1, CONFIG) == Turn("stand-in", 2)
    unmeasured = _state(begin=1, active=torch.tensor([False, True, True]),
                        cost=torch.tensor([inf, inf, 0.4], dtype=torch.float64))
    assert schedule(unmeasured, 4, CONFIG) == Turn("stand-in", 2)


def test_decide_after_exploration_and_after_verification():
    began = _state(begin=1)
    assert schedule(began, 7, CONFIG) == Turn("decide", None)  # the plan is agreed on this step
    assert schedule(began, 50, CONFIG) == Turn("decide", None)  # however late (a resumed run)
    verifying = _state(begin=1, plan=2)
    assert schedule(verifying, 7 + 2 * 9, CONFIG) == Turn("decide", None)  # the verdict
    # No verification: a plan is never set, and the step after exploration decides for good.
    assert schedule(began, 7, dataclasses.replace(CONFIG, verify=0)) == Turn("decide", None)


def test_verification_alternates_four_plan_steps_and_five_dense_ones():
    verifying = _state(begin=1, plan=2)
    turns = [schedule(verifying, 7 + v, CONFIG) for v in range(2 * 9)]
    one = [Turn("verify", 2)] * 4 + [Turn("verify", None)] * 5
    assert turns == one + one


def test_chosen_is_final_whatever_the_step():
    chosen = _state(begin=1, choice=1, plan=None)
    for step in (0, 3, 7, 1000):
        assert schedule(chosen, step, CONFIG) == Turn("chosen", 1)
    assert schedule(_state(choice=0), 0, CONFIG) == Turn("chosen", 0)  # dense for good


def test_the_state_round_trips_through_its_saved_tensors():
    state = _state(begin=3, ran=1, plan=2, times=torch.tensor([[0.1, math.inf]] * 3, dtype=torch.float64),
                   active=torch.tensor([True, False, True]))
    saved = state.saved(BLANK)
    assert all(v is None or isinstance(v, torch.Tensor) for v in saved.values())
    assert saved["auto_choice"] is None and saved["auto_steps"] is None  # absent: equal to the blank state
    loaded = AutoState.load({k: v for k, v in saved.items() if v is not None}.get, BLANK)
    assert (loaded.begin, loaded.ran, loaded.plan, loaded.choice) == (3, 1, 2, None)
    assert torch.equal(loaded.times, state.times) and torch.equal(loaded.active, state.active)
    assert loaded.steps is BLANK.steps
