"""auto's schedule: which stage and candidate each step of a tensor runs, as a pure function of the
tensor's :class:`AutoState`, the step and a :class:`ScheduleConfig` (no collectives, clocks or
contexts: :class:`~gradzip.compressors.auto.Auto` does the timing and the agreements)."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional

import torch

__all__ = ["AutoState", "ScheduleConfig", "Turn", "position", "schedule", "PLAN_STEPS", "REPETITION"]

# Verification: each repetition runs the plan for 4 steps and dense for 5.
PLAN_STEPS, DENSE_STEPS = 4, 5
REPETITION = PLAN_STEPS + DENSE_STEPS


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """What the schedule depends on besides a tensor's state: how many candidates, and auto's
    ``warmup``, ``trials`` and ``verify``."""

    candidates: int
    warmup: int
    trials: int
    verify: int

    @property
    def explore_steps(self) -> int:
        return self.trials * self.candidates


@dataclasses.dataclass
class AutoState:
    """One tensor's place in auto's schedule and what it measured.  Times are seconds on this rank,
    inf where not measured (NaN would make equal states compare unequal).

    The tensors are shared with the committed state and with :meth:`blank`: replace them, never write
    into them (the state commits an exchange's changes only when every rank's gradients were finite).
    """

    times: torch.Tensor  # (candidates, trials): the bucket's exchange time under each candidate
    periods: torch.Tensor  # (candidates, trials): whole exploration steps under each candidate
    active: torch.Tensor  # (candidates,) bool: still in the exploration race
    cost: torch.Tensor  # (candidates,): agreed exchange costs (min over ranks and trials)
    steps: torch.Tensor  # (2, verify): whole-step times of the plan and of dense per repetition
    step_cost: torch.Tensor  # (2,): agreed whole-step times [plan, dense] behind the choice
    explored: torch.Tensor  # (candidates,): agreed whole exploration steps (min over ranks and trials)
    begin: Optional[int] = None  # the step its exploration began (None: not yet)
    ran: Optional[int] = None  # the candidate the previous exploration step ran (its whole step is timed)
    plan: Optional[int] = None  # the candidate under verification
    choice: Optional[int] = None  # the final candidate
    best: Optional[int] = None  # the verified plan with the fastest whole step so far (its times: step_cost)

    # Saved under these names (the per-tensor state holds tensors only, for weights_only checkpoints).
    _INDICES = ("begin", "ran", "plan", "choice", "best")
    _TENSORS = ("times", "periods", "active", "cost", "steps", "step_cost", "explored")

    @classmethod
    def blank(cls, config: ScheduleConfig) -> "AutoState":
        """A tensor that has measured nothing yet."""
        def unmeasured(*shape):
            return torch.full(shape, math.inf, dtype=torch.float64)
        c, t = config.candidates, config.trials
        return cls(unmeasured(c, t), unmeasured(c, t), torch.ones(c, dtype=torch.bool), unmeasured(c),
                   unmeasured(2, config.verify), unmeasured(2), unmeasured(c))

    @classmethod
    def load(cls, get: Callable, blank: "AutoState") -> "AutoState":
        """From per-tensor state read by ``get(name)`` (``TensorContext.get`` or a state's ``dict.get``);
        what it lacks comes from ``blank``.  (Spelled out: it runs for every tensor on every step.)"""
        indices = [get("auto_" + name) for name in cls._INDICES]
        return cls(_or(get("auto_times"), blank.times), _or(get("auto_periods"), blank.periods),
                   _or(get("auto_active"), blank.active), _or(get("auto_cost"), blank.cost),
                   _or(get("auto_steps"), blank.steps), _or(get("auto_step_cost"), blank.step_cost),
                   _or(get("auto_explored"), blank.explored),
                   *(None if index is None else int(index) for index in indices))

    def saved(self, blank: "AutoState") -> dict:
        """The per-tensor state entries (None: absent, as every field still equal to ``blank``'s)."""
        out = {"auto_" + name: None if getattr(self, name) is None else torch.tensor(getattr(self, name))
               for name in self._INDICES}
        out.update(("auto_" + name, None if getattr(self, name) is getattr(blank, name) else getattr(self, name))
                   for name in self._TENSORS)
        return out


def _or(value, default):
    return default if value is None else value


class Turn(NamedTuple):
    """What one step of one tensor does: its ``stage`` ("warmup", "explore": a timed turn, "stand-in": a
    dropped candidate's turn, "decide": agree first, "verify", "chosen") and the ``candidate`` it runs
    (None: dense)."""

    stage: str
    candidate: Optional[int]


def position(state: AutoState, step: int, config: ScheduleConfig) -> Optional[int]:
    """Steps since the tensor's exploration began (None: still warming up)."""
    if state.begin is None:
        return None if step < config.warmup else 0
    return step - state.begin


def schedule(state: AutoState, step: int, config: ScheduleConfig) -> Turn:
    """The stage and candidate of this tensor's exchange at ``step``: warm-up, then ``trials`` rounds of
    one turn per candidate (a dropped candidate's turn runs the cheapest one still racing), the decision,
    ``verify`` repetitions of plan and dense steps, the decision again (a rejected plan's successor moves
    ``begin`` on by the verification's length and is verified the same way), then the choice for good."""
    if state.choice is not None:
        return Turn("chosen", state.choice)
    s = position(state, step, config)
    if s is None:
        return Turn("warmup", None)
    if s < config.explore_steps:
        turn = s % config.candidates
        if state.active[turn]:
            return Turn("explore", turn)
        return Turn("stand-in", int(torch.argmin(torch.where(state.active, state.cost, math.inf))))
    v = s - config.explore_steps
    if state.plan is None or v >= config.verify * REPETITION:
        return Turn("decide", None)
    return Turn("verify", state.plan if v % REPETITION < PLAN_STEPS else None)
