"""Per-run compression state: residuals, momenta, PowerSGD bases and step counters, keyed by tensor name.

:class:`GradzipState` is what both integrations (the DDP hook and the optimizer wrapper) hold.  It runs one
exchange over a list of named gradients, commits the staged per-tensor state only when every rank's input
was finite, keeps byte and time counters for :meth:`stats`, and saves/restores everything in
:meth:`state_dict` so a resumed run continues bit for bit.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from . import feedback
from .collectives import Transport, run_lockstep, transport_for
from .compressors import make
from .compressors.base import Compressor, TensorContext

__all__ = ["GradzipState"]

_COUNTERS = ("exchanges", "payload_bytes", "wire_bytes", "dense_bytes", "elements", "elements_sent",
             "collectives", "compress_s", "communicate_s", "decompress_s", "nonfinite_exchanges",
             "plain_allreduces")


def _any_nonfinite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether any element is NaN or Inf, in one read of each tensor and one host sync for all of them.

    min and max propagate NaN, and an Inf is the min or the max, so both ends are finite exactly when
    every element is (``isfinite(g).all()`` writes a mask of n bytes and reads it again).
    """
    ends = [end.float() for g in grads if g.numel() for end in torch.aminmax(g.detach())]
    return bool(ends) and not bool(torch.isfinite(torch.stack(ends)).all())


class GradzipState:
    """Compression state of one training run on one worker.

    ``group``: the process group to exchange over (None: the default group, or world size 1 when
    torch.distributed is not initialised).  ``seed``: base seed of every private RNG; it must be equal
    on all ranks.
    """

    def __init__(self, compressor: Compressor | str, *, group: Optional[dist.ProcessGroup] = None,
                 seed: int = 0, transport: Optional[Transport] = None, **params):
        self.compressor = make(compressor, **params)
        self.transport = transport if transport is not None else transport_for(group)
        self.seed = int(seed)
        self.epoch: Optional[int] = None  # None until set_epoch is called
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        self.totals = dict.fromkeys(_COUNTERS, 0)
        self.last_report = None
        self._worker: Optional[threading.Thread] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._starts: dict[str, float] = {}  # clock of each tensor's latest exchange start (not saved)
        self._periods: dict[str, tuple] = {}

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    def set_epoch(self, epoch: int) -> None:
        """Advance epoch-driven schedules (DGC's warm-up).  Call it with the same value on every rank."""
        self.epoch = int(epoch)

    def context(self, key: str, grad: torch.Tensor, exchange: Optional[dict] = None) -> TensorContext:
        return TensorContext(key=key, shape=grad.shape, dtype=grad.dtype, step=self.steps.get(key, 0),
                             epoch=self.epoch, rank=self.rank, world_size=self.world_size, seed=self.seed,
                             state=self.tensors.get(key, {}), exchange={} if exchange is None else exchange,
                             periods=self._periods.get(key, ()))

    def _clock(self, keys) -> None:
        """Note that these tensors' exchange starts now: the time since the last start is a step's."""
        now = time.perf_counter()
        for key in keys:
            last = self._starts.get(key)
            if last is not None:
                self._periods[key] = (self._periods.get(key, ()) + (now - last,))[-4:]
            self._starts[key] = now

    def exchange(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Compress, exchange and aggregate these gradients; returns one aggregate per input.

        Every rank must pass the same names with the same shapes in the same order.  If any rank's input
        holds NaN or Inf, every rank gets all-NaN aggregates for this call and no state changes, so
        ``torch.amp.GradScaler`` (or any finiteness check) skips the step identically everywhere.
        """
        self._clock(key for key, _ in named_grads)
        shared: dict = {}
        contexts = [self.context(key, g, shared) for key, g in named_grads]
        grads = [g for _, g in named_grads]
        nonfinite = _any_nonfinite(grads)
        if nonfinite:
            # Keep the protocol identical on every rank: compress zeros, discard the result below.
            grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
        gens = [feedback.exchange(self.compressor, g, ctx) for g, ctx in zip(grads, contexts)]
        results, report = run_lockstep(gens, self.transport, nonfinite)
        if report.nonfinite:
            outputs = [torch.full_like(g, float("nan")) for g in grads]
        else:
            outputs = [r.aggregate.reshape(g.shape).to(g.dtype) for r, g in zip(results, grads)]
            for ctx in contexts:
                self._commit(ctx)
        self._count(report, grads, results)
        return outputs

    def sends_dense(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether this exchange would average every tensor densely in its own dtype and change no
        state but the step counters (warm-up steps, tensors the method leaves alone, ``auto`` having
        chosen dense).  An integration may then use a plain allreduce, which skips the fusion copies,
        and call :meth:`record_dense`; the result is the same average."""
        if self.compressor.feedback == "momentum":  # momentum accumulates even where nothing is compressed
            return False
        return all(not self.compressor.compresses(self.context(key, g)) and "residual" not in self.tensors.get(key, {})
                   for key, g in named_grads)

    def record_dense(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Count an exchange that :meth:`sends_dense` allowed and the integration did itself."""
        self._clock(key for key, _ in named_grads)
        nbytes = sum(g.numel() * g.element_size() for _, g in named_grads)
        elements = sum(g.numel() for _, g in named_grads)
        t = self.totals
        t["exchanges"] += 1
        t["collectives"] += 1
        t["plain_allreduces"] += 1
        for counter in ("payload_bytes", "wire_bytes", "dense_bytes"):
            t[counter] += nbytes
        t["elements"] += elements
        t["elements_sent"] += elements
        for key, _ in named_grads:
            self.steps[key] = self.steps.get(key, 0) + 1

    def _commit(self, ctx: TensorContext) -> None:
        slot = self.tensors.setdefault(ctx.key, {})
        for name, value in ctx.updates.items():
            if value is None:
                slot.pop(name, None)
            else:
                slot[name] = value
        self.steps[ctx.key] = ctx.step + 1

    def _count(self, report, grads, results) -> None:
        t = self.totals
        t["exchanges"] += 1
        # Density: elements a sparsifier sent; every other method sends (a coded form of) each element.
        t["elements"] += sum(g.numel() for g in grads)
        kept = [r.kept() for r in results]
        t["elements_sent"] += sum(g.numel() if k is None else k for k, g in zip(kept, grads))
        t["payload_bytes"] += report.payload_bytes
        t["wire_bytes"] += report.wire_bytes
        t["dense_bytes"] += sum(g.numel() * g.element_size() for g in grads)
        t["collectives"] += report.collectives
        t["compress_s"] += report.compress_s
        t["communicate_s"] += report.communicate_s
        t["decompress_s"] += report.decompress_s
        t["nonfinite_exchanges"] += int(report.nonfinite)
        self.last_report = report

    # -- asynchronous use by the integrations -------------------------------------------------------
    def submit(self, named_grads: Sequence[tuple[str, torch.Tensor]],
               done: Callable[[list[torch.Tensor]], object]) -> torch.futures.Future:
        """Run :meth:`exchange` on this state's single communication thread; FIFO keeps the order of
        collectives identical on every rank.  The future gets ``done(aggregates)``'s value."""
        fut: torch.futures.Future = torch.futures.Future()
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, args=(torch.get_num_threads(),),
                                            name="gradzip-comm", daemon=True)
            self._worker.start()
        self._jobs.put((list(named_grads), done, fut))
        return fut

    def _serve(self, num_threads: int) -> None:
        # OpenMP's thread count is per thread: without this a new thread uses every core and its
        # spinning workers fight the training processes for CPUs.
        torch.set_num_threads(num_threads)
        while True:
            named, done, fut = self._jobs.get()
            try:
                fut.set_result(done(self.exchange(named)))
            except BaseException as exc:  # handed to the waiting training loop
                fut.set_exception(exc)

    # -- reporting and checkpoints -------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative counters of this worker: bytes it handed to collectives (``bytes_sent``), the dense
        fp32/fp16 equivalent, the achieved ratio, collectives issued and the time split."""
        t = dict(self.totals)
        t["bytes_sent"] = t["wire_bytes"]
        t["ratio"] = t["dense_bytes"] / t["wire_bytes"] if t["wire_bytes"] else float("nan")
        t["density"] = t["elements_sent"] / t["elements"] if t["elements"] else float("nan")
        t["compressor"] = self.compressor.name
        t["world_size"] = self.world_size
        return t

    def state_dict(self) -> dict:
        return {
            "compressor": self.compressor.name,
            "params": self.compressor.params(),
            "seed": self.seed,
            "epoch": self.epoch,
            "steps": dict(self.steps),
            "tensors": {k: {n: v.clone() for n, v in slot.items()} for k, slot in self.tensors.items()},
            "totals": dict(self.totals),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("compressor") != self.compressor.name:
            raise ValueError(f"state_dict is for compressor {state.get('compressor')!r}, "
                             f"this state uses {self.compressor.name!r}")
        self.seed = int(state["seed"])
        self.epoch = None if state["epoch"] is None else int(state["epoch"])
        self.steps = dict(state["steps"])
        self.tensors = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state["tensors"].items()}
        self.totals.update(state.get("totals", {}))
