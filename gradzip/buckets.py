"""The bucket route: :class:`GradzipState`'s exchange of a whole bucket at once, decided on the device.

For a method with :meth:`Compressor.bucket_exchange` (and error feedback ``none`` or ``residual``), one
exchange takes the bucket's flat buffer instead of its tensors one by one:

1. the bucket's layout (keys, shapes, offsets) is built once and cached;
2. error feedback keeps one flat residual per bucket, and the state's per-name entries (what
   ``state_dict`` saves) are views of it, so checkpoints keep their per-tensor format;
3. the non-finite rule is decided on the device: this rank's flag (NaN or Inf in its input) is a
   device tensor that rides the first collective; the aggregate is multiplied by 1 or NaN (so a
   skipped step is NaN on every rank) and the new residual is committed by ``torch.where`` — no host
   read, so the exchange never waits for the device;
4. the host learns whether the step was skipped at the bucket's next exchange (from pinned memory
   written when the flag was computed), and only then corrects its step counters.

The per-tensor route (:func:`gradzip.collectives.run_lockstep` over each tensor's generator) stays for
every other method and case; :func:`takes_bucket_route` says which one an exchange takes.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Optional, Sequence

import torch

from . import devices
from . import feedback as _feedback
from . import kernels
from .collectives import run_lockstep
from .compressors.base import Compressor
from .compressors.bucket import BucketContext, BucketLayout

__all__ = ["BucketRoute", "takes_bucket_route", "DeferredFlag"]


def takes_bucket_route(compressor: Compressor, grads: Sequence[torch.Tensor], world_size: int) -> bool:
    """Whether a method and these gradients can take the bucket route: a method that implements it, a
    feedback scheme it supports, one floating dtype and one device for every gradient."""
    if not compressor.bucketed or not _feedback.takes_bucket(compressor) or not grads:
        return False
    first = grads[0]
    return first.dtype.is_floating_point and all(g.dtype == first.dtype and g.device == first.device for g in grads)


class DeferredFlag:
    """A device bool that the host reads later without waiting then: on CUDA it is copied into pinned
    memory behind an event, and read at the bucket's next exchange, by which time the copy is long done
    (the event is waited for only if it is not)."""

    def __init__(self):
        self._host: Optional[torch.Tensor] = None
        self._event = None
        self.pending = False
        self._lock = threading.Lock()  # stats() and state_dict() take it from the training thread

    def set(self, flag: torch.Tensor) -> None:
        with self._lock:
            if devices.cuda(flag):
                if self._host is None:
                    self._host = torch.empty((), dtype=torch.bool, pin_memory=True)
                    self._event = torch.cuda.Event()
                self._host.copy_(flag, non_blocking=True)  # on the flag's device's current stream
                self._event.record(torch.cuda.current_stream(flag.device))  # that stream, not the thread's device's
            else:
                self._host = flag
            self.pending = True

    def take(self) -> bool:
        """The flag's value (False when none is pending); it is then no longer pending."""
        with self._lock:
            if not self.pending:
                return False
            self.pending = False
            if self._event is not None and not self._event.query():  # done long since, as a rule
                self._event.synchronize()
            # Read from host memory directly: on a CPU the flag is there, on CUDA in pinned memory.
            return bool(ctypes.c_bool.from_address(self._host.data_ptr()).value)


_FLOAT32_MAX = torch.finfo(torch.float32).max


class _Bucket:
    """What the route keeps for one bucket: its layout, where its input lies, its flat state."""

    def __init__(self, layout: BucketLayout):
        self.layout = layout
        self.flat: dict[str, torch.Tensor] = {}  # committed state, one flat tensor per name
        self.views: dict[str, list] = {}  # each key's view of it (None: no such state), as in GradzipState.tensors
        self.skipped = DeferredFlag()
        self.input_at: Optional[tuple] = None  # (its storage's address and size, each data_ptr) where the input is one run
        # NaN and 1 on the device, to poison or keep the output with: no scalar made into a tensor each step
        self.nan, self.one = torch.tensor([float("nan"), 1.0], device=layout.device).unbind()
        # the input's flag where the aggregate's check stands for the input's (read, never written)
        self.unchecked = torch.zeros((), dtype=torch.bool, device=layout.device)

    def flat_input(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """The gradients as one flat tensor: a view where they lie end to end in one buffer (DDP's
        bucket views), else a copy."""
        storage = grads[0].untyped_storage()
        at = (storage.data_ptr(), storage.nbytes(), *(g.data_ptr() for g in grads))  # any of them may move
        if at != self.input_at:
            self.input_at = at if _one_run(grads, self.layout, storage) else None
        if self.input_at is not None:
            return torch.as_strided(grads[0], (self.layout.numel,), (1,))
        return torch.cat([g.reshape(-1) for g in grads])

    def load(self, tensors: dict, shapes: dict) -> dict:
        """The committed flat state, for each name in ``shapes`` (per key: the shape of its value, None
        where the key has none), rebuilt from the per-key entries where something replaced them
        (``load_state_dict``, DDP regrouping its buckets, a test setting a residual); a key without a
        value gets zeros, which the methods read as nothing (no residual owed, no usable basis)."""
        keys = self.layout.keys
        for name in [n for n in self.flat if n not in shapes]:
            del self.flat[name], self.views[name]
        for name, wanted in shapes.items():
            views = self.views.get(name)
            current = [tensors.get(key, {}).get(name) for key in keys]
            if views is not None and all(c is v for c, v in zip(current, views)) and \
                    all(v is None if w is None else v.shape == w for v, w in zip(views, wanted)):
                continue
            if all(c is None for c, w in zip(current, wanted) if w is not None):
                self.flat.pop(name, None)
                self.views.pop(name, None)
                continue
            # a loaded value may lie elsewhere (a CPU map_location): it follows the bucket
            parts = [c.reshape(-1).to(self.layout.device, torch.float32) if c is not None and c.shape == w else
                     torch.zeros(w.numel(), dtype=torch.float32, device=self.layout.device)
                     for c, w in zip(current, wanted) if w is not None]
            self._keep(name, torch.cat(parts), wanted, tensors)
        return dict(self.flat)

    def _keep(self, name: str, flat: torch.Tensor, shapes, tensors: dict) -> None:
        self.flat[name] = flat
        present = [w for w in shapes if w is not None]
        pieces = iter(p.view(w) for p, w in zip(torch.split(flat, [w.numel() for w in present]), present))
        views = self.views[name] = [None if w is None else next(pieces) for w in shapes]
        for key, view in zip(self.layout.keys, views):
            if view is not None:
                tensors.setdefault(key, {})[name] = view

    def commit(self, updates: dict, shapes: dict, bad: torch.Tensor, tensors: dict,
               spare: Optional[torch.Tensor] = None) -> None:
        """Make the staged flat state committed where ``bad`` (a device bool) is False; keep the old
        one (none: zeros, which the methods read as nothing) where it is True.  ``spare``: the input,
        whose memory staged state may use (see :attr:`BucketContext.input_spare`), and which the
        aggregate overwrites next: state kept for the first time is copied out of it."""
        for name, new in updates.items():
            old = self.flat.get(name)
            if old is None or old.shape != new.shape:
                if spare is not None and new.untyped_storage().data_ptr() == spare.untyped_storage().data_ptr():
                    new = new.clone()
                self._keep(name, new.masked_fill_(bad, 0.0), shapes[name], tensors)
            else:
                torch.where(bad, old, new, out=old)


def _nonfinite(x: torch.Tensor) -> torch.Tensor:
    """A device bool: whether any element of ``x`` is NaN or Inf, in three operations where ``isfinite``
    would take five."""
    return _finite(x).logical_not_()


def _finite(x: torch.Tensor, limit: float = float("inf")) -> torch.Tensor:
    """A device bool: whether every element of ``x`` is finite (its largest magnitude is below ``limit``,
    infinity unless given: NaN propagates through the norm and compares False)."""
    return torch.linalg.vector_norm(x, float("inf")).lt(limit)


def _cast_limit(source: torch.dtype, target: torch.dtype) -> float:
    """The smallest magnitude of ``source`` that rounds to infinity cast to ``target`` (infinity where
    every finite value stays finite): ``target``'s largest value plus half its last step, a tie that
    rounds up, since the largest value's significand is odd (65520 for float16)."""
    if not (source.is_floating_point and target.is_floating_point) or (
            torch.finfo(target).max >= torch.finfo(source).max):
        return float("inf")
    info = torch.finfo(target)
    top_power = info.max / (2 - info.eps)  # the largest value is (2 - eps) times a power of two
    return info.max + top_power * info.eps / 2


def _one_run(grads: Sequence[torch.Tensor], layout: BucketLayout, storage) -> bool:
    """Whether the gradients lie end to end within the first one's storage (tensors allocated apart may
    also lie end to end: a GPU's caching allocator cuts them from one segment)."""
    size = grads[0].element_size()
    base = storage.data_ptr() + grads[0].storage_offset() * size  # an empty tensor's data_ptr is 0
    if base + layout.numel * size > storage.data_ptr() + storage.nbytes():
        return False
    return all(g.is_contiguous() and (g.data_ptr() == base + offset * size or not g.numel())
               for g, offset in zip(grads, layout.offsets))


class BucketRoute:
    """The bucket route of one :class:`GradzipState` (see the module's docstring)."""

    def __init__(self):
        self.buckets: dict[tuple, _Bucket] = {}
        #: Every bucket that took this route, also one DDP has since regrouped (what describe() reports).
        self.taken: set[tuple] = set()
        # stats() and state_dict() resolve skips from the training thread while gradzip's thread may be
        # exchanging (DiLoCo's overlap): a skip and the step counters it takes back change together.
        self._lock = threading.RLock()

    def bucket(self, keys: tuple, grads: Sequence[torch.Tensor], steps: dict, totals: dict) -> _Bucket:
        entry = self.buckets.get(keys)
        if entry is None or entry.layout.dtype != grads[0].dtype or entry.layout.device != grads[0].device:
            # A key belongs to one bucket: DDP regroups its buckets after the first step (with fp16 AMP
            # most often a skipped one, whose skip the bucket that goes still has to tell).
            for other in [k for k in self.buckets if set(k) & set(keys)]:
                self.resolve(steps, totals, self.buckets.pop(other))
            layout = BucketLayout(keys, [g.shape for g in grads], grads[0].dtype, grads[0].device)
            entry = self.buckets[keys] = _Bucket(layout)
            self.taken.add(keys)
        return entry

    def resolve(self, steps: dict, totals: dict, entry: Optional[_Bucket] = None) -> None:
        """Learn whether the last exchange of ``entry`` (of every bucket, by default) was skipped, and
        if so take back its step counters."""
        with self._lock:
            for bucket in [entry] if entry is not None else list(self.buckets.values()):
                if bucket.skipped.take():
                    totals["nonfinite_exchanges"] += 1
                    for key in bucket.layout.keys:
                        steps[key] = steps.get(key, 1) - 1

    @torch.no_grad()  # rather than detaching each gradient: an operation per tensor
    def exchange(self, state, named_grads, out, compressor: Compressor):
        """Run one bucket's exchange for ``state`` (a :class:`GradzipState`) with ``compressor`` (the
        state's, or the method auto chose for the bucket); returns the aggregates, written into ``out``
        when given."""
        keys = tuple(key for key, _ in named_grads)
        grads = [g for _, g in named_grads]
        with self._lock:
            entry = self.bucket(keys, grads, state.steps, state.totals)
            self.resolve(state.steps, state.totals, entry)
            step = state.steps.get(keys[0], 0)
        layout = entry.layout
        state.compressor.observe_step(keys, time.perf_counter())
        flat_g = entry.flat_input(grads)
        shapes = _state_shapes(compressor, layout, step)
        # Where the aggregate goes back into the input's own run (DDP's bucket), the input's memory is
        # the exchange's to use until then.
        in_place = out is not None and entry.input_at is not None and all(o is g for o, (_, g) in zip(out, named_grads))
        spare = in_place and layout.dtype == torch.float32  # only a float32 input's memory holds p = g + e
        b = BucketContext(layout, step=step, rank=state.rank, world_size=state.world_size, seed=state.seed,
                          state=entry.load(state.tensors, shapes), epoch=state.epoch,
                          scale=state.loss_scale(layout.device), input_spare=spare)
        if not compressor.carries_nonfinite and layout.numel:
            local = _nonfinite(flat_g)
        else:
            local = entry.unchecked
        with kernels.suspended():  # eager operations only: no compile lands in a user's first step
            (result,), report = run_lockstep([_feedback.bucket_exchange(compressor, flat_g, b)], state.transport, local)
        aggregate = result.aggregate
        bad = report.nonfinite
        # bad, or the aggregate not shown finite: for booleans "bad or not ok" is "ok <= bad", one operation
        limit = _cast_limit(aggregate.dtype, layout.dtype)  # a float32 sum written into 16-bit gradients
        if result.bound is not None and limit > _FLOAT32_MAX / 2:  # (bf16's is fp32's, near enough)
            # below half the largest value, r rounded products stay finite; NaN compares False
            bad = torch.le(result.bound < min(limit, _FLOAT32_MAX) / 2, bad)
        elif aggregate.numel():
            bad = torch.le(_finite(aggregate, limit), bad)
        report.nonfinite = bad  # a device bool: what a caller reading it (DiLoCo's outer step) must know
        entry.commit(b.updates, shapes, bad, state.tensors, spare=flat_g if in_place else None)  # before
        outputs = _write(aggregate, bad, entry, out, flat_g if in_place else None, layout)  # the input is overwritten
        with self._lock:  # the counters first: a skip taken from the other thread then takes them back
            for key in keys:
                state.steps[key] = b.step + 1
            entry.skipped.set(bad)
        _count(state.totals, report, layout, result)
        state.last_report = report
        return outputs


def _state_shapes(compressor: Compressor, layout: BucketLayout, step: int) -> dict:
    """Per state name, the shape of each key's value: residual feedback's, like the gradients; the
    method's own (:meth:`Compressor.bucket_state_shapes`)."""
    shapes = dict.fromkeys(_feedback.scheme_of(compressor).state_keys, layout.shapes)
    shapes.update(compressor.bucket_state_shapes(layout, step))
    return shapes


def _write(aggregate, bad, entry, out, flat_out, layout):
    """The aggregate, or NaN everywhere where ``bad`` (a device bool), into ``out``: in one pass into
    ``flat_out`` where given (``out`` is the input's own flat run, DDP's bucket), else piece by piece; or
    into fresh tensors shaped like the inputs."""
    if flat_out is not None:
        if aggregate.dtype == flat_out.dtype:
            torch.where(bad, entry.nan, aggregate, out=flat_out)
        else:  # where's out takes only its result's dtype: a half sum times NaN or 1 into a float32 bucket
            torch.mul(aggregate, torch.where(bad, entry.nan, entry.one), out=flat_out)  # x * 1 == x, NaN too
        return list(out)
    result = torch.where(bad, entry.nan, aggregate).to(layout.dtype)
    pieces = layout.pieces(result)
    if out is None:
        return pieces
    torch._foreach_copy_(list(out), pieces)
    return list(out)


def _count(totals: dict, report, layout: BucketLayout, result) -> None:
    totals["exchanges"] += 1
    totals["elements"] += layout.numel
    totals["elements_sent"] += layout.numel if result.sparse is None else result.sparse[0].numel()
    totals["payload_bytes"] += report.payload_bytes
    totals["wire_bytes"] += report.wire_bytes
    totals["dense_bytes"] += layout.numel * layout.dtype.itemsize
    totals["collectives"] += report.collectives
    totals["compress_s"] += report.compress_s
    totals["communicate_s"] += report.communicate_s
    totals["decompress_s"] += report.decompress_s
