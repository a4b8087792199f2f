"""Auto: measure which candidate method exchanges each bucket fastest on this run's link, then use it."""
from __future__ import annotations

import math
import time
from typing import Optional, Sequence, Union

import torch

from . import compressor_class, make, parse_spec, register
from .base import AllReduce, Compressor, TensorContext
from .dense import NoCompression

DEFAULT_CANDIDATES = ("none", "fp16", "powersgd:rank=2,dense_steps=0", "topk:ratio=0.01")


@register
class Auto(Compressor):
    """Choose per bucket whether to compress, and with which candidate, from timed trial exchanges.

    After ``warmup`` dense steps, exploration runs in rounds: each round exchanges every tensor once with
    each candidate still in the race, one candidate per step.  Each tensor times its own exchange, from
    the moment the bucket's exchange started to the moment the bucket's last tensor got its result (the
    requests of a bucket are fused): the bucket's exchange time under that candidate, shared by its
    tensors.  At the start of every later round every tensor allreduces its
    per-candidate fastest times (max over negated values), i.e. takes

        cost_c = min over ranks and trials of time(c)

    (noise only adds time; and the rank that waited least for its peers measures the codec and the
    network without the skew every candidate suffers alike).  Candidates with ``cost_c > drop * min
    cost`` leave the race.  After ``trials`` rounds, or when one candidate is left, the tensor keeps
    ``argmin cost`` for the rest of the run, unless that is not at least ``margin`` faster than
    ``none`` and does not save at least ``min_saving_ms`` per step: then it stays dense (an exchange's
    time does not show what the codec takes from backward, and a small bucket's gain is within noise).
    Every rank computes these choices from the same reduced vector, so all ranks agree.  A tensor that
    ends up dense is left to the integration's dense path (the DDP hook hands a bucket that is dense
    throughout to DDP's own allreduce), so auto costs nothing where compression does not pay.

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
                 feedback: Optional[str] = None):
        super().__init__(feedback)
        if isinstance(candidates, str):
            candidates = [c for c in (part.strip() for part in candidates.split(";")) if c]
        if not isinstance(candidates, (list, tuple)) or not candidates or not all(isinstance(c, str) for c in candidates):
            raise ValueError(f"candidates must be a non-empty list of method specs like 'topk:ratio=0.01', "
                             f"got {candidates!r}")
        for field, value, least in (("warmup", warmup, 0), ("trials", trials, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{field} must be an integer >= {least}, got {value!r}")
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 1 <= drop <= math.inf:
            raise ValueError(f"drop must be a number >= 1 (inf: never drop a candidate early), got {drop!r}")
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin must be a number with 0 <= margin < 1, got {margin!r}")
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
        self._built = built
        self._dense = NoCompression()

    def choices(self, tensors: dict) -> dict[str, str]:
        """Tensor name -> the candidate spec it uses, for every decided tensor of a state's ``tensors``."""
        return {key: self.candidates[int(slot["auto_choice"])] for key, slot in tensors.items() if "auto_choice" in slot}

    # -- where a tensor is in the schedule ---------------------------------------------------------------
    def _times(self, ctx: TensorContext) -> torch.Tensor:
        times = ctx.get("auto_times")  # (candidates, trials); inf: not measured (NaN breaks state equality)
        return torch.full((len(self._built), self.trials), math.inf, dtype=torch.float64) if times is None else times

    def _active(self, ctx: TensorContext) -> torch.Tensor:
        active = ctx.get("auto_active")
        return torch.ones(len(self._built), dtype=torch.bool) if active is None else active

    def _stage(self, ctx: TensorContext) -> tuple[str, Optional[int]]:
        """("warmup" | "explore" | "agree" | "chosen", candidate index or None).

        "agree": this step starts a new round, so it first agrees on the costs so far (and may decide).
        """
        chosen = ctx.get("auto_choice")
        if chosen is not None:
            return "chosen", int(chosen)
        if ctx.step < self.warmup:
            return "warmup", None
        counts = torch.isfinite(self._times(ctx)).sum(dim=1)
        active = self._active(ctx)
        this_round = int(counts[active].min())
        if "auto_active" in ctx.updates or this_round == 0 or int(counts[active].max()) > this_round:
            # Mid-round (or the round just agreed on, in this step): the next active candidate not yet run.
            index = int(torch.nonzero(active & (counts == this_round))[0])
            return "explore", index
        return "agree", None

    def compresses(self, ctx):
        stage, index = self._stage(ctx)
        if stage == "warmup":
            return False
        if stage == "chosen":
            return self._sends(index, ctx)
        return True  # exploring and agreeing need auto's own exchange

    def _sends(self, index: Optional[int], ctx) -> bool:
        """Whether candidate ``index`` compresses this tensor (``none`` and dense fall-backs do not)."""
        return index is not None and self._built[index].name != "none" and self._built[index].compresses(ctx)

    def _run(self, index: Optional[int], x, ctx):
        run = self._built[index].exchange if self._sends(index, ctx) else self._dense.exchange
        return (yield from run(x, ctx))

    # -- the exchange ---------------------------------------------------------------------------------
    def exchange(self, x, ctx):
        stage, index = self._stage(ctx)
        if stage == "agree":
            yield from self._agree(ctx)
            stage, index = self._stage(ctx)
        if stage != "explore":
            return (yield from self._run(index, x, ctx))
        start = ctx.exchange.setdefault("auto_start", time.perf_counter())  # the bucket's first tensor
        result = yield from self._run(index, x, ctx)
        # Tensors of one bucket with the same history share one record, and the last of them to finish
        # writes the bucket's whole exchange time into it: they then see the same costs and choose alike.
        times = self._times(ctx)
        slot = int(torch.isfinite(times[index]).sum())
        record = ctx.exchange.setdefault(("auto_times", tuple(times.reshape(-1).tolist())), times.clone())
        record[index, slot] = time.perf_counter() - start
        ctx.set("auto_times", record)
        return result

    def _agree(self, ctx):
        """One allreduce of the fastest times: drop slow candidates, or decide."""
        times, active = self._times(ctx), self._active(ctx)
        # Noise on a shared machine only ever adds time, so the fastest trial is the estimate (as timeit).
        fastest = times.min(dim=1).values  # inf where a candidate was never measured
        # max of -t over ranks is -(min over ranks); a candidate nobody measured stays at +inf.
        measured = -(yield AllReduce(-fastest.float(), op="max")).double()
        # A candidate that leaves this tensor dense (PowerSGD and a bias) is "none" under another name.
        eligible = torch.tensor([c.name == "none" or self._sends(i, ctx) for i, c in enumerate(self._built)])
        active = active & eligible
        cost = torch.where(active, measured, math.inf)
        best = int(torch.argmin(cost))
        active = active & (cost <= self.drop * cost[best])
        rounds_done = int(torch.isfinite(times[best]).sum())
        if int(active.sum()) > 1 and rounds_done < self.trials and math.isfinite(cost[best]):
            ctx.set("auto_active", active)
            return
        dense = next((i for i, c in enumerate(self._built) if c.name == "none"), None)
        if dense is not None:  # compared with dense's measured cost, even if it left the race
            saving = measured[dense] - cost[best]
            if not (cost[best] < (1 - self.margin) * measured[dense] and saving >= self.min_saving_ms / 1e3):
                best = dense  # not clearly faster, too little to gain (or nothing measured): stay dense
        ctx.set("auto_choice", torch.tensor(best))
        ctx.set("auto_cost", measured)
        ctx.set("auto_times", None)
        ctx.set("auto_active", None)

    def payload_bytes(self, ctx, kept=None):
        # Called after the exchange, so a decision or a new round taken in it is already staged.
        agreed = "auto_cost" in ctx.updates or "auto_active" in ctx.updates
        _, index = self._stage(ctx)
        explored = ctx.updates.get("auto_times")
        if explored is not None:  # the candidate whose count of trials went up
            committed = ctx.state.get("auto_times")
            before = 0 if committed is None else torch.isfinite(committed).sum(1)
            index = int(torch.nonzero(torch.isfinite(explored).sum(1) > before)[0])
        method = self._built[index] if self._sends(index, ctx) else self._dense
        return (len(self._built) * 4 if agreed else 0) + method.payload_bytes(ctx, kept)

    def params(self) -> dict:
        return {"candidates": self.candidates, "warmup": self.warmup, "trials": self.trials, "drop": self.drop,
                "margin": self.margin, "min_saving_ms": self.min_saving_ms, "feedback": self.feedback}

