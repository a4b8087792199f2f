"""Auto: measure which candidate method exchanges each bucket fastest on this run's link, check that it
makes whole training steps faster, then use it.

A policy above the candidates: each tensor's :class:`AutoState` and the pure :func:`schedule` of its
steps live in autoschedule.py; here are :class:`StepClock`, this rank's clock of whole steps (told by
:meth:`Compressor.observe_step`, never saved), and :class:`Auto`, which runs the candidates, times them
and agrees with the other ranks.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional, Sequence, Union

import torch

from .base import AllReduce, Compressor, TensorContext
from .dense import NoCompression
from .autoschedule import PLAN_STEPS, REPETITION, AutoState, ScheduleConfig, Turn, position, schedule
from .registry import compressor_class, make, parse_spec, register

__all__ = ["Auto", "AutoState", "ScheduleConfig", "Turn", "schedule", "position", "StepClock"]

DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:rank=2,dense_steps=0", "topk:ratio=0.01")

_log = logging.getLogger(__name__)  # a child of "gradzip": silent unless that logger is set to INFO


# Verification times 3 whole steps of each arm: plan steps 1 to 3, and dense steps 2 to 4 (the first
# dense step flushes the residual through auto's own path, the others take the plain allreduce).
_PLAN_TIMED, _DENSE_TIMED = slice(0, 3), slice(PLAN_STEPS + 1, PLAN_STEPS + 4)
# A plan whose candidate made whole exploration steps this much faster than dense's is kept unverified:
# far beyond the noise, and verifying it would cost slow dense steps.
_CLEAR_WIN = 0.5


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.1f} ms" if math.isfinite(seconds) else "unmeasured"


# -- timing on this rank ---------------------------------------------------------------------------------
class BucketExchange:
    """What the tensors of one exchange (one bucket) share on this rank, for this exchange only: when
    its timed part began, one record of times per measurement history, and what each tensor ran."""

    def __init__(self, keys: Optional[tuple] = None):
        self.keys = keys  # the bucket's tensors, as the state told the clock (None: not told)
        self.start: Optional[float] = None
        self.ran: dict = {}  # tensor key -> (step, candidate, bytes its agreement sent)
        self.logged = False  # its settled choices were logged
        self._records: dict = {}  # history of times -> (record, [(ctx, state)] sharing it)

    def timing_start(self) -> float:
        """The start of the bucket's timing: its first tensor's exchange (the requests are fused)."""
        if self.start is None:
            self.start = time.perf_counter()
        return self.start

    def record(self, ctx: TensorContext, state: AutoState, candidate: int, elapsed: float) -> list:
        """Record ``elapsed`` as the bucket's time under ``candidate``; returns every (ctx, state) whose
        times changed.  Tensors with the same history share one record, and the last of them to finish
        writes the bucket's whole exchange time into it: they then see the same costs and choose alike."""
        history = tuple(state.times.reshape(-1).tolist())
        record, members = self._records.get(history, (state.times, []))
        record = record.clone()
        record[candidate, int(torch.isfinite(state.times[candidate]).sum())] = elapsed
        members.append((ctx, state))
        self._records[history] = (record, members)
        for _, member in members:
            member.times = record
        return members


class StepClock:
    """This rank's clock of each tensor's exchange starts, told by :meth:`Auto.observe_step` for dense
    steps too: the intervals are whole training steps as this rank saw them.  Not saved: a resumed run
    starts a new clock.  It also hands each tensor the :class:`BucketExchange` it belongs to."""

    def __init__(self, keep: int = 1):
        self.keep = keep  # intervals kept per tensor: auto's verification reads them all at its end
        self._starts: dict[str, float] = {}
        self._steps: dict[str, tuple] = {}
        self._exchanges: dict[str, BucketExchange] = {}

    def start(self, keys: Sequence[str], now: float) -> None:
        """These tensors' exchange (one bucket) starts at ``now``."""
        bucket = BucketExchange(tuple(keys))
        for key in keys:
            last = self._starts.get(key)
            if last is not None:
                self._steps[key] = (self._steps.get(key, ()) + (now - last,))[-self.keep:]
            self._starts[key] = now
            self._exchanges[key] = bucket

    def step_times(self, key: str) -> tuple:
        """The latest whole-step times of this tensor, oldest first."""
        return self._steps.get(key, ())

    def exchange_of(self, key: str) -> BucketExchange:
        """The bucket exchange started last with this tensor; a new one of its own when none was started
        or this one already ran it (a caller that exchanges without telling the clock)."""
        bucket = self._exchanges.get(key)
        if bucket is None or key in bucket.ran:
            bucket = self._exchanges[key] = BucketExchange()
        return bucket

    def ran(self, key: str, step: int) -> Optional[tuple]:
        """(candidate, agreement bytes) of this tensor's exchange at ``step``, if it ran."""
        bucket = self._exchanges.get(key)
        entry = None if bucket is None else bucket.ran.get(key)
        return entry[1:] if entry is not None and entry[0] == step else None


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
    2. Plan: the contenders are the candidates ``margin`` faster than ``none`` that save at least
       ``min_saving_ms`` per step (a bucket's gain within noise), and whose whole exploration steps
       (``T_c``: this rank's :class:`StepClock`, min over trials and ranks) beat ``T_none``; none of
       them: ``none``.  Without verification ``p = argmin cost`` among them; with it, the contender of
       the fastest ``T_c`` goes first.
    3. Verification (``verify`` repetitions, when the plan compresses and ``none`` is a candidate):
       an exchange's time cannot show what a codec takes from backward or how much of the exchange
       backward already hid, so the plan must also win on the whole step.  Each repetition runs the
       plan for 4 steps, then dense for 5, timing 3 whole steps of each from this rank's
       :class:`StepClock` (the state tells :meth:`observe_step` when each bucket's exchange starts,
       dense ones included).  With T = mean over ranks of the median over repetitions, the bucket keeps
       its plan only if ``T_plan < (1 - step_margin) * T_dense``.  Then the next contender by ``T_c``
       is verified the same way (a Top-k whose codec slows the step may lose to fp16), unless a plan
       already won with a smaller ``T_c``, and the bucket takes the fastest plan that won, else sends
       densely.  A plan with ``T_p < 0.5 T_none`` is kept unverified.

    Every rank computes each decision from the same reduced vector, so all ranks agree.  A tensor that
    ends up dense is left to the integration's dense path (the DDP hook hands a bucket that is dense
    throughout to DDP's own allreduce), so where compression does not pay auto costs its trial steps
    and what any Python comm hook costs (1-3% of a step here: benchmarks/hook_overhead.py).

    ``candidates``: method specs ``"name:key=value,..."`` (a sequence, or one string separated by
    ``;``); they run under auto's ``feedback``, and the residual carries over when the candidate changes.
    A candidate is only chosen for tensors it compresses (PowerSGD leaves 1-D tensors dense), so give
    candidates that compress from the first step (PowerSGD ``dense_steps=0``, DGC ``warmup_epochs=0``).

    An instance clocks the steps of the one :class:`~gradzip.GradzipState` that holds it (tensors are
    known by their names), so give each state its own.
    """

    name = "auto"
    default_feedback = "residual"
    deterministic = False  # the choice depends on measured times (but is identical on every rank)
    measures_time = True

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
        built, plain = [], []
        for spec in candidates:
            if compressor_class(spec.partition(":")[0].strip()) is type(self):  # unknown: the registry's error
                raise ValueError("auto cannot be its own candidate")
            try:
                name, params = parse_spec(spec)
                if "feedback" in params:
                    raise ValueError("give feedback to auto itself, not to a candidate")
                built.append(make(name, feedback=self.feedback, **params))
                plain.append(make(name, feedback="none", **params) if "none" in built[-1].feedbacks else None)
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
        self._plain = plain  # each candidate without error feedback: what a plain allreduce may carry
        self._dense = NoCompression()
        self._none = next((i for i, c in enumerate(built) if c.name == "none"), None)
        self._schedule = ScheduleConfig(len(built), warmup, trials, verify)
        self._blank = AutoState.blank(self._schedule)
        self._clock = StepClock(keep=max(1, verify * REPETITION))
        self._decided: dict = {}  # tensor key -> its AutoState when it decided (for the log line)
        self._bucket_methods: dict = {}  # bucket keys -> (each key's recorded choice, the method on its route)

    delegates_buckets = True

    def keeps_on_host(self, name):
        return name.startswith("auto_")  # AutoState's: read by the host every step

    def bucket_method(self, keys, tensors):
        """Once every tensor of a bucket has chosen the same compressing candidate, for good, that
        candidate's bucket route, if it has one: from then on auto costs what its choice costs.  Before
        (exploring, verifying) and for a dense choice: None, the per-tensor route.  Cached per bucket,
        and looked up again only when a tensor's recorded choice is another object (it was decided, or a
        checkpoint was loaded), so a settled exchange reads no state."""
        marks = tuple(tensors.get(key, {}).get("auto_choice") for key in keys)
        cached = self._bucket_methods.get(tuple(keys))
        if cached is not None and all(a is b for a, b in zip(cached[0], marks)):
            return cached[1]
        chosen = {None if mark is None else int(mark) for mark in marks}
        method = None
        if len(chosen) == 1 and None not in chosen:
            candidate = self._built[chosen.pop()]
            method = candidate if candidate.name != "none" and candidate.bucketed else None
        self._bucket_methods[tuple(keys)] = (marks, method)
        return method

    def choices(self, tensors: dict) -> dict[str, str]:
        """Tensor name -> the candidate spec it uses, for every decided tensor of a state's ``tensors``."""
        chosen = {key: AutoState.load(slot.get, self._blank).choice for key, slot in tensors.items()}
        return {key: self.candidates[index] for key, index in chosen.items() if index is not None}

    def describe(self, tensors: dict) -> dict:
        return {"choices": self.choices(tensors)}

    # -- what was decided and why (GradzipState.describe, the log) ---------------------------------------
    def decision(self, slot: dict, step: int = 0) -> dict:
        """What auto decided for one tensor and why, from its per-tensor state ``slot`` (a state's
        ``tensors[key]``, or {} before it has any) at ``step``.  Times are seconds as auto recorded them,
        agreed over the ranks (None: not measured): ``exchange_s``, the bucket's exchange under each
        candidate (min over trials and ranks); ``explored_step_s``, whole steps while exploring under
        each; ``step_s``, the whole steps ``{"plan", "dense"}`` the choice rests on (None: not timed).
        ``choice`` is a candidate spec, None until decided; ``stage`` is the schedule's (``warmup``,
        ``explore``, ``stand-in``, ``decide``, ``verify``, ``chosen``); ``reason`` says why, in words."""
        state = AutoState.load(slot.get, self._blank)
        stage = schedule(state, step, self._schedule).stage
        plan_s, dense_s = state.step_cost.tolist()
        return {"choice": None if state.choice is None else self.candidates[state.choice], "stage": stage,
                "reason": self._reason(state) if state.choice is not None else self._progress(state, stage),
                "exchange_s": self._per_candidate(state.cost),
                "explored_step_s": self._per_candidate(state.explored),
                "step_s": {"plan": plan_s, "dense": dense_s} if math.isfinite(plan_s) and math.isfinite(dense_s)
                else None}

    def _per_candidate(self, times: torch.Tensor) -> dict:
        return {spec: float(t) if math.isfinite(t) else None for spec, t in zip(self.candidates, times.tolist())}

    def _progress(self, state: AutoState, stage: str) -> str:
        if stage == "warmup":
            return f"warming up: {self.warmup} dense step(s) before timing the candidates"
        if stage == "verify" or (stage == "decide" and state.plan is not None):
            return f"verifying {self.candidates[state.plan]}: its whole steps against dense ones"
        return f"exploring: {self.trials} timed step(s) per candidate"

    def _reason(self, state: AutoState) -> str:
        """Why ``state.choice`` (decided) was chosen, from what the decision recorded."""
        chosen, none, cost = state.choice, self._none, state.cost.tolist()
        plan_s, dense_s = state.step_cost.tolist()
        if none is None:
            return f"the cheapest exchange, {_ms(cost[chosen])} (no dense candidate to compare with)"
        if chosen == none:
            if math.isfinite(plan_s) and math.isfinite(dense_s):
                return (f"no verified plan made whole steps {self.step_margin:.0%} faster than dense "
                        f"(last: {_ms(plan_s)} against dense's {_ms(dense_s)})")
            return (f"no candidate's exchange was {self.margin:.0%} faster and {self.min_saving_ms:g} ms cheaper "
                    f"than dense's {_ms(cost[none])} with whole exploration steps faster than dense's")
        versus = f"exchange {_ms(cost[chosen])} against dense's {_ms(cost[none])}"
        if self.verify == 0:
            return f"the cheapest exchange that beat dense's (no verification): {versus}"
        if not (math.isfinite(plan_s) and math.isfinite(dense_s)):
            return f"the plan under verification when a resumed run lost the step clock: {versus}"
        explored = state.explored.tolist()
        if plan_s == explored[chosen] and dense_s == explored[none]:
            return (f"kept unverified: whole exploration steps {_ms(plan_s)}, under {_CLEAR_WIN:g} of dense's "
                    f"{_ms(dense_s)}; {versus}")
        return f"verified: whole steps {_ms(plan_s)} against dense's {_ms(dense_s)}; {versus}"

    def _settled(self, bucket: BucketExchange, ctx: TensorContext, state: AutoState) -> None:
        """Note that ``ctx``'s tensor decided in this exchange; once every tensor of its bucket has, log the
        bucket's choices (logger ``gradzip.compressors.auto``, INFO).  A step skipped for NaN or Inf at
        that moment takes the decision again, which is then logged again."""
        key = ctx.key
        self._decided[key] = state
        keys = bucket.keys if bucket.keys and key in bucket.keys else (key,)
        if bucket.logged or not _log.isEnabledFor(logging.INFO) or not all(k in self._decided for k in keys):
            return
        bucket.logged = True
        groups: dict = {}
        for k in keys:
            decided = self._decided[k]
            groups.setdefault((self.candidates[decided.choice], self._reason(decided)), []).append(k)
        name = keys[0] if len(keys) == 1 else f"{keys[0]} .. {keys[-1]} ({len(keys)} tensors)"
        parts = [f"{spec}" + ("" if len(groups) == 1 else f" for {len(members)} tensor(s)") + f" ({why})"
                 for (spec, why), members in groups.items()]
        _log.info("auto on rank %d settled bucket %s: %s", ctx.rank, name, "; ".join(parts))

    def observe_step(self, keys, now):
        self._clock.start(keys, now)

    # -- where a tensor is in the schedule ---------------------------------------------------------------
    def _load(self, ctx: TensorContext) -> AutoState:
        return AutoState.load(ctx.get, self._blank)

    def _save(self, ctx: TensorContext, state: AutoState) -> None:
        for name, value in state.saved(self._blank).items():
            ctx.set(name, value)

    def _turn(self, state: AutoState, ctx: TensorContext) -> Turn:
        return schedule(state, ctx.step, self._schedule)

    def _eligible(self, ctx: TensorContext) -> torch.Tensor:
        # A candidate that leaves this tensor dense (PowerSGD and a bias) is "none" under another name.
        return torch.tensor([c.name == "none" or self._sends(i, ctx) for i, c in enumerate(self._built)])

    def compresses(self, ctx):
        return self._compresses(self._load(ctx), ctx)

    def _compresses(self, state: AutoState, ctx) -> bool:
        stage, index = self._turn(state, ctx)
        if stage in ("warmup", "chosen", "verify"):
            return self._sends(index, ctx)
        return True  # exploring and agreeing need auto's own exchange

    def allreduce_dtype(self, ctx):
        return self._allreduce_dtype(self._load(ctx), ctx)

    def _allreduce_dtype(self, state: AutoState, ctx):
        """Dense steps in the gradient's dtype, and a half cast that runs outside exploration: auto runs
        it without error feedback (as PyTorch's fp16 and bf16 hooks do; its rounding error is far below
        the gradient noise), so the integration's plain allreduce in the half type carries it."""
        stage, index = self._turn(state, ctx)
        if stage not in ("warmup", "chosen", "verify"):
            return None
        if not self._sends(index, ctx):
            return ctx.dtype
        return None if self._plain[index] is None else self._plain[index].allreduce_dtype(ctx)

    def _sends(self, index: Optional[int], ctx) -> bool:
        """Whether candidate ``index`` compresses this tensor (``none`` and dense fall-backs do not)."""
        return index is not None and self._built[index].name != "none" and self._built[index].compresses(ctx)

    # -- the exchange ---------------------------------------------------------------------------------
    def exchange(self, x, ctx):
        state = self._load(ctx)
        changes = self._turn(state, ctx).stage not in ("warmup", "chosen")
        undecided = state.choice is None
        agreed = yield from self._clock_and_agree(state, ctx, x.device)
        stage, index = self._turn(state, ctx)
        bucket = self._clock.exchange_of(ctx.key)
        bucket.ran[ctx.key] = (ctx.step, index, agreed)  # for payload_bytes
        if undecided and state.choice is not None:
            self._settled(bucket, ctx, state)
        if stage in ("explore", "stand-in"):
            state.ran = index
        run = self._built[index].exchange if self._sends(index, ctx) else self._dense.exchange
        if stage == "explore":
            start = bucket.timing_start()
            result = yield from run(x, ctx)
            for member_ctx, member in bucket.record(ctx, state, index, time.perf_counter() - start):
                self._save(member_ctx, member)
        else:
            if changes:
                self._save(ctx, state)
            result = yield from run(x, ctx)
        # Sending densely (or as a plain half cast) from now on, decided within this exchange or before:
        # error feedback keeps no residual.
        result.settled_dense = self._allreduce_dtype(state, ctx) is not None or not self._compresses(state, ctx)
        return result

    def _clock_and_agree(self, state: AutoState, ctx, device: torch.device):
        """Record the step clock's readings, and agree with the other ranks where the schedule says so
        (by allreduces on ``device``, the gradients': a group of NCCL alone takes no CPU tensor);
        returns the bytes the agreement sent."""
        s = position(state, ctx.step, self._schedule)
        if s is None:
            return 0
        if state.begin is None:
            state.begin = ctx.step
        stage = self._turn(state, ctx).stage
        steps = self._clock.step_times(ctx.key)
        if stage in ("explore", "stand-in"):
            if s > 0:
                self._record_explored_step(state, steps)
            if s > 0 and s % len(self._built) == 0:  # a new round
                return (yield from self._agree_round(state, ctx, device))
        elif stage == "decide" and state.plan is None:
            self._record_explored_step(state, steps)
            return (yield from self._agree_plan(state, ctx, device))
        elif stage == "decide":
            state.steps = self._verified_steps(steps)
            return (yield from self._agree_steps(state, ctx, device))
        return 0

    def _costs(self, times: torch.Tensor, device: torch.device):
        """min over trials here, then (one allreduce of max of -t, on ``device``) min over ranks; inf: never
        measured.  Noise on a shared machine only ever adds time, so the fastest trial is the estimate
        (as timeit).  In host memory, as the times."""
        fastest = times.min(dim=1).values
        return -(yield AllReduce(-fastest.float().to(device), op="max")).cpu().double()

    def _agree_round(self, state: AutoState, ctx, device):
        """Drop the candidates more than ``drop`` times slower than the fastest so far."""
        measured = yield from self._costs(state.times, device)
        eligible = self._eligible(ctx)
        active = state.active & eligible & torch.isfinite(measured)
        if not bool(active.any()):  # nothing measured anywhere (cannot happen in lockstep): keep racing
            active = eligible
        cost = torch.where(active, measured, math.inf)
        state.active = active & (cost <= self.drop * cost.min())
        state.cost = measured
        return len(self._built) * 4

    def _agree_plan(self, state: AutoState, ctx, device):
        """The plan: among the candidates whose exchange clearly beats dense's and whose exploration steps
        were faster than dense's, the first in the verification order (the cheapest exchange if there is
        no verification)."""
        C = len(self._built)
        measured = yield from self._costs(torch.cat([state.times, state.periods]), device)
        measured, step_cost = measured[:C], measured[C:]
        state.cost, state.explored = measured, step_cost
        if self._none is not None:  # compared with dense's measured cost, even if it left the race
            # A candidate that leaves this tensor dense (PowerSGD and a bias) follows the bucket: all its
            # tensors then verify the same plans in the same order.
            worth = (state.active | ~self._eligible(ctx)) & self._worth(measured) & ~self._no_faster(step_cost, None)
            order = [i for i in self._verification_order(state) if worth[i]]
            # Without verification the cheapest exchange is final; with it, the likeliest winner goes first.
            cheapest = int(torch.argmin(torch.where(worth, measured, math.inf))) if order else self._none
            best = order[0] if order and self.verify > 0 else cheapest
        else:
            best = int(torch.argmin(torch.where(state.active & self._eligible(ctx), measured, math.inf)))
        state.times, state.active, state.periods, state.ran = (  # exploration's records are done with
            self._blank.times, self._blank.active, self._blank.periods, None)
        if best == self._none or self.verify == 0 or self._none is None:
            state.choice = best
        elif step_cost[best] < _CLEAR_WIN * step_cost[self._none]:
            state.choice, state.step_cost = best, step_cost[[best, self._none]]
        else:
            state.plan = best
        return 2 * C * 4

    def _worth(self, measured: torch.Tensor) -> torch.Tensor:
        """The candidates whose agreed exchange cost (the bucket's, shared by its tensors) clearly beats
        dense's: ``margin`` faster and ``min_saving_ms`` saved (the others would stay within its noise)."""
        dense = measured[self._none]
        return (measured < (1 - self.margin) * dense) & (dense - measured >= self.min_saving_ms / 1e3)

    def _verification_order(self, state: AutoState) -> list:
        """Candidates in the order their plans are verified: the fastest whole exploration step first
        (the likeliest winner, whose steps then rule out slower plans), ties (as unmeasured) by exchange
        cost, then candidate order."""
        keys = zip(state.explored.tolist(), state.cost.tolist(), range(len(self._built)))
        return [index for *_, index in sorted(keys)]

    def _no_faster(self, explored: torch.Tensor, best: Optional[int]) -> torch.Tensor:
        """The candidates whose whole exploration steps were no faster than dense's, or than those of
        ``best`` (a plan that won its verification): not worth a verification's slow dense steps.  Dense's
        exploration steps ran auto's own exchange, slower than the plain allreduce, so this errs towards
        verifying; inf (not measured, as after a resumed run) rules nothing out."""
        rival = explored[self._none] if best is None else torch.minimum(explored[self._none], explored[best])
        return torch.isfinite(explored) & (explored >= rival)

    def _record_explored_step(self, state: AutoState, steps: tuple) -> None:
        """The step before this one ran candidate ``state.ran`` everywhere: its whole step's time."""
        if state.ran is None or not steps:
            return
        periods = state.periods.clone()
        row = periods[state.ran]
        slot = int(torch.isfinite(row).sum())
        if slot < self.trials:
            row[slot] = steps[-1]
            state.periods = periods

    def _verified_steps(self, steps: tuple) -> torch.Tensor:
        """(2, verify): each repetition's mean whole step of the plan and of dense, read at the deciding
        step from the clock's record of the whole verification (its steps may have run on the
        integration's plain allreduce, which never reaches :meth:`exchange`); inf where the clock lost
        them (a resumed run)."""
        timed = self._blank.steps.clone()
        span = self.verify * REPETITION
        if len(steps) >= span:
            for r in range(self.verify):
                repetition = steps[len(steps) - span + r * REPETITION:][:REPETITION]
                for arm, part in enumerate((repetition[_PLAN_TIMED], repetition[_DENSE_TIMED])):
                    timed[arm, r] = sum(part) / len(part)
        return timed

    def _agree_steps(self, state: AutoState, ctx, device):
        """A plan wins if its whole step is ``step_margin`` faster than dense's; the next plan is then
        verified, until none is left, and the fastest winner (else dense) is the choice."""
        # The median over repetitions ignores a step that an evaluation or a checkpoint lengthened; the
        # mean over ranks (unlike a min) is not fooled by one rank's clock starting late on one step.
        medians = torch.stack([row[torch.isfinite(row)].median() if torch.isfinite(row).any()
                               else torch.tensor(math.inf, dtype=row.dtype) for row in state.steps])
        plan_s, dense_s = ((yield AllReduce(medians.float().to(device))).double() / ctx.world_size).tolist()
        state.steps = self._blank.steps
        if not math.isfinite(dense_s):  # the clock was lost (a resumed run): a verified winner, else the plan
            state.choice = state.best if state.best is not None else state.plan
            state.plan, state.best = None, None
            return 2 * 4
        wins = plan_s < (1 - self.step_margin) * dense_s
        if state.best is None or (wins and plan_s < float(state.step_cost[0])):
            state.step_cost = torch.tensor([plan_s, dense_s], dtype=torch.float64)
            state.best = state.plan if wins else None
        # The plans after this one in the verification order are those not tried yet.  A cheaper exchange
        # may slow the step (a codec taking backward's core), so every plan that beat dense's exchange gets
        # its turn, from this step on, unless its exploration steps were no faster than the winner's.
        order = self._verification_order(state)
        contenders = self._worth(state.cost) & ~self._no_faster(state.explored, state.best)
        left = [i for i in order[order.index(state.plan) + 1:] if contenders[i]]
        if left:
            state.plan = left[0]
            state.begin += self._schedule.verify * REPETITION
        else:
            state.choice = state.best if state.best is not None else self._none
            state.plan, state.best = None, None
        return 2 * 4

    def payload_bytes(self, ctx, kept=None):
        # After the exchange: what it ran (and agreed on); before it: what this step would run.
        ran = self._clock.ran(ctx.key, ctx.step)
        index, agreed = ran if ran is not None else (self._turn(self._load(ctx), ctx).candidate, 0)
        method = self._built[index] if self._sends(index, ctx) else self._dense
        return agreed + method.payload_bytes(ctx, kept)

    def params(self) -> dict:
        return {"candidates": self.candidates, "warmup": self.warmup, "trials": self.trials, "drop": self.drop,
                "margin": self.margin, "min_saving_ms": self.min_saving_ms, "verify": self.verify,
                "step_margin": self.step_margin, "feedback": self.feedback}
