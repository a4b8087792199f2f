"""Auto: measure which candidate method exchanges each bucket fastest on this run's link, check that it
makes whole training steps faster, then use it."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence, Union

import torch

from .base import AllReduce, Compressor, TensorContext
from .dense import NoCompression
from .registry import compressor_class, make, parse_spec, register

DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:rank=2,dense_steps=0", "topk:ratio=0.01")


# Verification: each repetition runs the plan for 4 steps and dense for 5, and times 3 whole steps of
# each: plan steps 1 to 4, and dense steps 2 to 5 (the first dense step flushes the residual through
# auto's own path, the others take the plain allreduce).
_PLAN_STEPS, _DENSE_STEPS, _TIMED = 4, 5, 3
_REPETITION = _PLAN_STEPS + _DENSE_STEPS
# A plan whose candidate made whole exploration steps this much faster than dense's is kept unverified:
# far beyond the noise, and verifying it would cost slow dense steps.
_CLEAR_WIN = 0.5


@register
class Auto(Compressor):
    """Choose per bucket whether to compress, and with which candidate, from timed trials; keep the
    choice only if whole training steps get faster.

    1. Exploration, after ``warmup`` dense steps: ``trials`` rounds of one step per candidate.  A step
       times the bucket's exchange under its candidate (from the start of the bucket's first tensor to
       the end of its last: the requests of a bucket are fused), one time shared by the bucket's
       tensors.  Each round after the first starts with one allreduce of the fastest times so far,

           cost_c = min over ranks and trials of time(c)

       (noise only adds time, and the rank that waited least for its peers measures the codec and the
       network without the skew all candidates suffer alike); candidates with ``cost_c > drop *
       min cost`` leave the race, and their later turns run the cheapest candidate instead, so every
       bucket stays on one schedule.
    2. Plan: ``p = argmin cost``, unless that is not ``margin`` faster than ``none`` or saves less than
       ``min_saving_ms`` per step (a bucket's gain within noise); then ``none``.
    3. Verification (``verify`` repetitions, when the plan compresses and ``none`` is a candidate):
       an exchange's time cannot show what a codec takes from backward or how much of the exchange
       backward already hid, so the plan must also win on the whole step.  Each repetition runs the
       plan for 4 steps, then dense for 5, timing 3 whole steps of each from the tensor's step clock
       (``ctx.periods``).  With T = mean over ranks of the median over repetitions, the bucket keeps
       its plan only if ``T_plan < (1 - step_margin) * T_dense``, else it sends densely.  Exploration
       steps are clocked too (T_c: min over trials and ranks); a plan with ``T_p < 0.5 T_none`` there
       is kept unverified.

    Every rank computes each decision from the same reduced vector, so all ranks agree.  A tensor that
    ends up dense is left to the integration's dense path (the DDP hook hands a bucket that is dense
    throughout to DDP's own allreduce), so where compression does not pay auto costs its trial steps
    and what any Python comm hook costs (1-3% of a step here: benchmarks/hook_overhead.py).

    ``candidates``: method specs ``"name:key=value,..."`` (a sequence, or one string separated by
    ``;``); they run under auto's ``feedback``, and the residual carries over when the candidate changes.
    A candidate is only chosen for tensors it compresses (PowerSGD leaves 1-D tensors dense), so give
    candidates that compress from the first step (PowerSGD ``dense_steps=0``, DGC ``warmup_epochs=0``).
    """

    name = "auto"
    default_feedback = "residual"
    deterministic = False  # the choice depends on measured times (but is identical on every rank)

    def __init__(self, candidates: Union[str, Sequence[str]] = DEFAULT_CANDIDATES, warmup: int = 1,
                 trials: int = 2, drop: float = 2.0, margin: float = 0.25, min_saving_ms: float = 5.0,
                 verify: int = 3, step_margin: float = 0.05, feedback: Optional[str] = None):
        super().__init__(feedback)
        if isinstance(candidates, str):
            candidates = [c for c in (part.strip() for part in candidates.split(";")) if c]
        if not isinstance(candidates, (list, tuple)) or not candidates or not all(isinstance(c, str) for c in candidates):
            raise ValueError(f"candidates must be a non-empty list of method specs like 'topk:ratio=0.01', "
                             f"got {candidates!r}")
        for field, value, least in (("warmup", warmup, 0), ("trials", trials, 1), ("verify", verify, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{field} must be an integer >= {least}, got {value!r}")
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 1 <= drop <= math.inf:
            raise ValueError(f"drop must be a number >= 1 (inf: never drop a candidate early), got {drop!r}")
        for field, value in (("margin", margin), ("step_margin", step_margin)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{field} must be a number with 0 <= {field} < 1, got {value!r}")
        if isinstance(min_saving_ms, bool) or not isinstance(min_saving_ms, (int, float)) or not 0 <= min_saving_ms < math.inf:
            raise ValueError(f"min_saving_ms must be a finite number >= 0, got {min_saving_ms!r}")
        built = []
        for spec in candidates:
            if compressor_class(spec.partition(":")[0].strip()) is type(self):  # unknown: the registry's error
                raise ValueError("auto cannot be its own candidate")
            try:
                name, params = parse_spec(spec)
                if "feedback" in params:
                    raise ValueError("give feedback to auto itself, not to a candidate")
                built.append(make(name, feedback=self.feedback, **params))
            except ValueError as exc:
                raise ValueError(f"candidate {spec!r}: {exc}") from None
        self.candidates = tuple(candidates)
        self.warmup = warmup
        self.trials = trials
        self.drop = float(drop)
        self.margin = float(margin)
        self.min_saving_ms = float(min_saving_ms)
        self.verify = verify
        self.step_margin = float(step_margin)
        self._built = built
        self._dense = NoCompression()
        self._none = next((i for i, c in enumerate(built) if c.name == "none"), None)

    def choices(self, tensors: dict) -> dict[str, str]:
        """Tensor name -> the candidate spec it uses, for every decided tensor of a state's ``tensors``."""
        return {key: self.candidates[int(slot["auto_choice"])] for key, slot in tensors.items() if "auto_choice" in slot}

    # -- where a tensor is in the schedule ---------------------------------------------------------------
    @property
    def _explore_steps(self) -> int:
        return self.trials * len(self._built)

    def _trials(self, ctx: TensorContext, name: str) -> torch.Tensor:
        """A (candidates, trials) record of times; inf: not measured (NaN breaks state equality)."""
        record = ctx.get(name)
        return torch.full((len(self._built), self.trials), math.inf, dtype=torch.float64) if record is None else record

    def _times(self, ctx: TensorContext) -> torch.Tensor:
        return self._trials(ctx, "auto_times")  # each candidate's bucket exchanges

    def _explored_steps(self, ctx) -> torch.Tensor:
        return self._trials(ctx, "auto_periods")  # whole steps under each candidate

    def _eligible(self, ctx: TensorContext) -> torch.Tensor:
        # A candidate that leaves this tensor dense (PowerSGD and a bias) is "none" under another name.
        return torch.tensor([c.name == "none" or self._sends(i, ctx) for i, c in enumerate(self._built)])

    def _active(self, ctx: TensorContext) -> torch.Tensor:
        active = ctx.get("auto_active")
        return torch.ones(len(self._built), dtype=torch.bool) if active is None else active

    def _position(self, ctx: TensorContext) -> Optional[int]:
        """Steps since this tensor's exploration began (None: still warming up)."""
        begin = ctx.get("auto_begin")
        if begin is None:
            return None if ctx.step < self.warmup else 0
        return ctx.step - int(begin)

    def _stage(self, ctx: TensorContext) -> tuple[str, Optional[int]]:
        """(stage, the candidate this step runs; None: dense).  Stages: "warmup", "explore" (timed),
        "stand-in" (a dropped candidate's turn), "decide" (agree first), "verify", "chosen"."""
        chosen = ctx.get("auto_choice")
        if chosen is not None:
            return "chosen", int(chosen)
        s = self._position(ctx)
        if s is None:
            return "warmup", None
        if s < self._explore_steps:
            turn = s % len(self._built)
            active = self._active(ctx)
            if active[turn]:
                return "explore", turn
            cost = torch.where(active, ctx.get("auto_cost"), math.inf)
            return "stand-in", int(torch.argmin(cost))
        plan = ctx.get("auto_plan")
        v = s - self._explore_steps
        if plan is None or v >= self.verify * _REPETITION:
            return "decide", None
        return "verify", int(plan) if v % _REPETITION < _PLAN_STEPS else None

    def compresses(self, ctx):
        stage, index = self._stage(ctx)
        if stage in ("warmup", "chosen", "verify"):
            return self._sends(index, ctx)
        return True  # exploring and agreeing need auto's own exchange

    def _sends(self, index: Optional[int], ctx) -> bool:
        """Whether candidate ``index`` compresses this tensor (``none`` and dense fall-backs do not)."""
        return index is not None and self._built[index].name != "none" and self._built[index].compresses(ctx)

    # -- the exchange ---------------------------------------------------------------------------------
    def exchange(self, x, ctx):
        agreed = yield from self._clock_and_agree(ctx)
        stage, index = self._stage(ctx)
        ctx.exchange[("auto_ran", ctx.key)] = (index, agreed)  # for payload_bytes
        if stage in ("explore", "stand-in"):
            ctx.set("auto_ran", torch.tensor(index))
        run = self._built[index].exchange if self._sends(index, ctx) else self._dense.exchange
        if stage != "explore":
            return (yield from run(x, ctx))
        start = ctx.exchange.setdefault("auto_start", time.perf_counter())  # the bucket's first tensor
        result = yield from run(x, ctx)
        # Tensors of one bucket with the same history share one record, and the last of them to finish
        # writes the bucket's whole exchange time into it: they then see the same costs and choose alike.
        times = self._times(ctx)
        slot = int(torch.isfinite(times[index]).sum())
        record = ctx.exchange.setdefault(("auto_times", tuple(times.reshape(-1).tolist())), times.clone())
        record[index, slot] = time.perf_counter() - start
        ctx.set("auto_times", record)
        return result

    def _clock_and_agree(self, ctx):
        """Record this step's clock readings, and agree with the other ranks where the schedule says so;
        returns the bytes the agreement sent."""
        s = self._position(ctx)
        if s is None:
            return 0
        if ctx.get("auto_begin") is None:
            ctx.set("auto_begin", torch.tensor(ctx.step))
        stage, _ = self._stage(ctx)
        if stage in ("explore", "stand-in"):
            if s > 0:
                self._record_explored_step(ctx)
            if s > 0 and s % len(self._built) == 0:  # a new round
                return (yield from self._agree_round(ctx))
        elif stage == "decide" and ctx.get("auto_plan") is None:
            self._record_explored_step(ctx)
            return (yield from self._agree_plan(ctx))
        elif stage in ("verify", "decide"):
            self._record_step(ctx, s - self._explore_steps)
            if stage == "decide":
                return (yield from self._agree_steps(ctx))
        return 0

    def _costs(self, times: torch.Tensor):
        """min over trials here, then (one allreduce of max of -t) min over ranks; inf: never measured.
        Noise on a shared machine only ever adds time, so the fastest trial is the estimate (as timeit)."""
        fastest = times.min(dim=1).values
        return -(yield AllReduce(-fastest.float(), op="max")).double()

    def _agree_round(self, ctx):
        """Drop the candidates more than ``drop`` times slower than the fastest so far."""
        measured = yield from self._costs(self._times(ctx))
        eligible = self._eligible(ctx)
        active = self._active(ctx) & eligible & torch.isfinite(measured)
        if not bool(active.any()):  # nothing measured anywhere (cannot happen in lockstep): keep racing
            active = eligible
        cost = torch.where(active, measured, math.inf)
        ctx.set("auto_active", active & (cost <= self.drop * cost.min()))
        ctx.set("auto_cost", measured)
        return len(self._built) * 4

    def _agree_plan(self, ctx):
        """The plan: the fastest candidate, if it clearly beats dense's exchange."""
        C = len(self._built)
        measured = yield from self._costs(torch.cat([self._times(ctx), self._explored_steps(ctx)]))
        measured, step_cost = measured[:C], measured[C:]
        cost = torch.where(self._active(ctx) & self._eligible(ctx), measured, math.inf)
        best = int(torch.argmin(cost))
        if self._none is not None:  # compared with dense's measured cost, even if it left the race
            saving = measured[self._none] - cost[best]
            if not (cost[best] < (1 - self.margin) * measured[self._none] and saving >= self.min_saving_ms / 1e3):
                best = self._none  # not clearly faster, too little to gain (or nothing measured): stay dense
        ctx.set("auto_cost", measured)
        for name in ("auto_times", "auto_active", "auto_periods", "auto_ran"):
            ctx.set(name, None)
        if not self._sends(best, ctx) or self.verify == 0 or self._none is None:
            ctx.set("auto_choice", torch.tensor(best))
        elif step_cost[best] < _CLEAR_WIN * step_cost[self._none]:
            ctx.set("auto_choice", torch.tensor(best))
            ctx.set("auto_step_cost", step_cost[[best, self._none]])
        else:
            ctx.set("auto_plan", torch.tensor(best))
            ctx.set("auto_steps", torch.full((2, self.verify), math.inf, dtype=torch.float64))
        return 2 * C * 4

    def _record_explored_step(self, ctx) -> None:
        """The step before this one ran candidate ``auto_ran`` everywhere: its whole step's time."""
        ran = ctx.get("auto_ran")
        if ran is None or not ctx.periods:
            return
        periods = self._explored_steps(ctx).clone()
        row = periods[int(ran)]
        slot = int(torch.isfinite(row).sum())
        if slot < self.trials:
            row[slot] = ctx.periods[-1]
            ctx.set("auto_periods", periods)

    def _record_step(self, ctx, v: int) -> None:
        """Time whole steps of each arm from the step clock (see the schedule at the top)."""
        phase, repetition = v % _REPETITION, v // _REPETITION
        if phase == _PLAN_STEPS - 1:  # plan steps 1 -> 4
            arm, clocked = 0, ctx.periods[-_TIMED:]
        elif phase == 0 and v > 0:  # dense steps 2 -> 5 of the repetition before
            arm, clocked, repetition = 1, ctx.periods[-_TIMED - 1:-1], repetition - 1
        else:
            return
        steps = ctx.get("auto_steps").clone()
        steps[arm, repetition] = sum(clocked) / _TIMED if len(clocked) == _TIMED else math.inf
        ctx.set("auto_steps", steps)

    def _agree_steps(self, ctx):
        """Keep the plan only if its whole step is ``step_margin`` faster than dense's."""
        steps = ctx.get("auto_steps")
        # The median over repetitions ignores a step that an evaluation or a checkpoint lengthened; the
        # mean over ranks (unlike a min) is not fooled by one rank's clock starting late on one step.
        medians = torch.stack([row[torch.isfinite(row)].median() if torch.isfinite(row).any()
                               else torch.tensor(math.inf, dtype=row.dtype) for row in steps])
        plan_s, dense_s = ((yield AllReduce(medians.float())).double() / ctx.world_size).tolist()
        keep = not math.isfinite(dense_s) or plan_s < (1 - self.step_margin) * dense_s
        ctx.set("auto_choice", ctx.get("auto_plan") if keep else torch.tensor(self._none))
        ctx.set("auto_step_cost", torch.tensor([plan_s, dense_s], dtype=torch.float64))
        for name in ("auto_plan", "auto_steps"):
            ctx.set(name, None)
        return 2 * 4

    def payload_bytes(self, ctx, kept=None):
        # After the exchange: what it ran (and agreed on); before it: what this step would run.
        index, agreed = ctx.exchange.get(("auto_ran", ctx.key), (self._stage(ctx)[1], 0))
        method = self._built[index] if self._sends(index, ctx) else self._dense
        return agreed + method.payload_bytes(ctx, kept)

    def params(self) -> dict:
        return {"candidates": self.candidates, "warmup": self.warmup, "trials": self.trials, "drop": self.drop,
                "margin": self.margin, "min_saving_ms": self.min_saving_ms, "verify": self.verify,
                "step_margin": self.step_margin, "feedback": self.feedback}
