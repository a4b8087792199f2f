"""Per-run compression state: residuals, momenta, PowerSGD bases and step counters, keyed by tensor name.

:class:`GradzipState` is what both integrations (the DDP hook and the optimizer wrapper) hold.  It runs one
exchange over a list of named gradients, commits the staged per-tensor state only when every rank's input
was finite, keeps byte and time counters for :meth:`stats`, and saves/restores everything in
:meth:`state_dict` so a resumed run continues bit for bit.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import hashlib
import io
import numbers
import os
import queue
import threading
import time
import weakref
from typing import Callable, Collection, Optional, Sequence

import torch
import torch.distributed as dist

from . import devices
from . import feedback as _feedback
from . import kernels
from .kernels import any_nonfinite as _any_nonfinite
from .buckets import BucketRoute, takes_bucket_route
from .collectives import ProcessGroupTransport, Transport, default_group_timeout, run_lockstep, transport_for
from .compressors import make
from .compressors.base import SPARE, Compressor, TensorContext

__all__ = ["GradzipState", "AllRanks", "reshard"]

_COUNTERS = ("exchanges", "payload_bytes", "wire_bytes", "dense_bytes", "elements", "elements_sent",
             "collectives", "compress_s", "communicate_s", "decompress_s", "nonfinite_exchanges",
             "plain_allreduces")


_FLOAT32_MAX = torch.finfo(torch.float32).max

_JOINED = "joined vectors"  # the buffer a group of vectors is joined in, when exchanged into out


def _vector_groups(named_grads: Sequence[tuple[str, torch.Tensor]], below: int) -> Optional[list]:
    """What one exchange sends: a list of ``(key, indices)``, one entry per tensor it compresses, where
    ``indices`` are the gradients it holds.  Two or more small vectors of one dtype and device become one
    tensor, keyed by their names and placed where the first of them was; None when nothing is grouped.

    Each vector would otherwise cost an exchange of its own: 25-70 small torch operations and their
    Python, 50 us to 1 ms whatever its size, which a transformer's many biases and norms pay every step.
    """
    if below <= 0:
        return None
    kinds: dict[tuple, list[int]] = {}
    for i, (_, g) in enumerate(named_grads):
        if _small(g, below):
            kinds.setdefault((g.dtype, g.device), []).append(i)
    groups = {members[0]: members for members in kinds.values() if len(members) > 1}
    if not groups:
        return None
    grouped = {i for members in groups.values() for i in members}
    plan = []
    for i, (key, _) in enumerate(named_grads):
        if i in groups:
            plan.append((_group_key(tuple(named_grads[j][0] for j in groups[i])), groups[i]))
        elif i not in grouped:
            plan.append((key, [i]))
    return plan


def _each_alone(named_grads: Sequence[tuple[str, torch.Tensor]]) -> list:
    """The plan of :func:`_vector_groups` when nothing is grouped: every tensor under its own name."""
    return [(key, [i]) for i, (key, _) in enumerate(named_grads)]


def _piece(value, start: int, size: int) -> Optional[torch.Tensor]:
    """A view of elements ``start`` to ``start + size`` of a tensor's memory (a key's own state, or one
    vector's slice of its group's); None where ``value`` is no tensor holding them in one run."""
    if isinstance(value, torch.Tensor) and value.is_contiguous() and value.numel() >= start + size:
        return value.view(-1)[start:start + size]
    return None


def _small(g: torch.Tensor, below: int) -> bool:
    return g.dim() <= 1 and g.numel() < below


def check_group_vectors_below(value) -> int:
    """``group_vectors_below`` as given, or a one-line ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"group_vectors_below must be an integer >= 0, got {value!r}")
    return value


@functools.lru_cache(maxsize=256)
def _group_key(keys: tuple[str, ...]) -> str:
    """A readable state key for a group of vectors, unique to its names and their order."""
    digest = hashlib.sha1("\0".join(keys).encode()).hexdigest()[:10]
    return f"vectors[{len(keys)}] {keys[0]} .. {keys[-1]} {digest}"


def _may_be_nonfinite(output: torch.Tensor, result) -> torch.Tensor:
    """The part of ``output`` that can hold a non-finite value: a sparsifier's aggregate is zero outside
    its ``support``, and so is the output there (a copy or cast of it), so only the support is read:
    the values the sparsifier wrote there, where the output is the aggregate or an exact copy of it
    (a cast to a narrower type can overflow, so that output is read itself).  Where the method's
    ``bound`` on |aggregate| shows it finite, only the bound is read."""
    bound = result.bound
    if (bound is not None and output.dtype == result.aggregate.dtype == torch.float32 and devices.reads_freely(output)
            and float(bound) < _FLOAT32_MAX / 2):  # half: room for the rounding of r products summed
        return bound
    if result.support is None or not output.is_contiguous():
        return output
    if result.support_values is not None and output.dtype == result.aggregate.dtype:
        return result.support_values
    return output.view(-1).index_select(0, result.support)


def _checked_as_copied(target: torch.Tensor, result) -> bool:
    """Whether the aggregate is copied into ``target`` and checked for NaN and Inf as it is copied:
    large, dense, float32 and contiguous on a CPU (a sparse aggregate's check reads its support)."""
    return (devices.reads_freely(target) and target.dtype == torch.float32 and target.is_contiguous()
            and target.numel() >= kernels.CHECK_CHUNK and result.support is None
            and result.aggregate.is_contiguous() and not _is_memory_of(result.aggregate, target))


def _copied_finite(target: torch.Tensor, source: torch.Tensor) -> bool:
    into, values = target.view(-1), source.reshape(-1)
    return kernels.written_finite(target, lambda a, b: into[a:b].copy_(values[a:b]))


def _lendable(out: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list:
    """Which of ``out`` may hold their tensor's aggregate while the exchange runs: contiguous ones that
    are their own gradient's memory (DDP's bucket views; no other gradient shares their start), or
    that share memory with no gradient at all; None for the others, which get a copy at the end."""
    starts = [g.data_ptr() for g in grads]
    sharing = collections.Counter(starts)
    storages = {_address(g) for g in grads}
    lendable = []
    for target, g, start in zip(out, grads, starts):
        own = (target.data_ptr() == start and sharing[start] == 1 and target.numel() == g.numel()
               and target.dtype == g.dtype and g.is_contiguous())
        lendable.append(target if target.is_contiguous() and (own or _address(target) not in storages) else None)
    return lendable


def _is_memory_of(aggregate: torch.Tensor, target: torch.Tensor) -> bool:
    return (aggregate.data_ptr() == target.data_ptr() and aggregate.numel() == target.numel()
            and aggregate.is_contiguous() and target.is_contiguous() and aggregate.dtype == target.dtype)


def _address(t: torch.Tensor) -> tuple:
    """Where a tensor's memory starts: equal for views of one storage."""
    return t.device, t.untyped_storage().data_ptr()


class GradzipState:
    """Compression state of one training run on one worker.

    ``group``: the process group to exchange over (None: the default group, or world size 1 when
    torch.distributed is not initialised).  ``seed``: base seed of every private RNG; it must be equal
    on all ranks.  ``feedback``: the error-feedback scheme, a name or a :class:`gradzip.feedback.Feedback`
    (e.g. ``MomentumCorrection(0.9, nesterov=True)``), overriding the compressor's; it must be one of the
    compressor's ``feedbacks``.

    ``group_vectors_below``: 1-D and 0-d gradients with fewer elements than this (biases, norms'
    weights; e.g. ``2**16``) that come in one :meth:`exchange` are compressed together as one tensor,
    with one state, which saves each its own exchange's fixed cost.  The method then selects, scales or
    quantises over the group rather than over each vector, and the groups follow the integration's
    buckets: DDP regroups after its first step, and a run resumed from a checkpoint under DDP is not
    bit for bit the uninterrupted one.  0 (the default): each tensor on its own.

    ``bucketed``: exchange each bucket (all gradients of one :meth:`exchange` call) at once, with a
    number of operations that does not grow with its tensors and no host read of the device
    (:mod:`gradzip.buckets`), for the methods that implement it; other methods, and grouped vectors,
    keep the per-tensor route.  None (the default): on CUDA gradients only, where per-tensor operations
    and host reads are what a step waits for.  Results equal the per-tensor route's up to the order of
    float sums; on this route a skipped (non-finite) step is learnt by the host at the bucket's next
    exchange, which then takes back its step counters.

    ``grad_scaler``: the ``torch.amp.GradScaler`` whose scale the gradients carry (the DDP hook and the
    optimizer wrapper see them scaled).  State in gradient units (residuals, DGC's momentum and
    velocity, Signum's momentum, SparseLoCo's accumulator) is then kept unscaled and added back at the
    current scale, so it stays right as the scaler backs off and grows; the scale is read on the
    device, never on the host.  Without it such state keeps the units of the scale it was stored under.
    """

    def __init__(self, compressor: Compressor | str, *, group: Optional[dist.ProcessGroup] = None,
                 seed: int = 0, transport: Optional[Transport] = None, feedback=None,
                 group_vectors_below: int = 0, bucketed: Optional[bool] = None, grad_scaler=None, **params):
        if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
            raise ValueError(f"grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.group_vectors_below = check_group_vectors_below(group_vectors_below)
        if bucketed not in (None, True, False):
            raise ValueError(f"bucketed must be None (on CUDA only), True or False, got {bucketed!r}")
        self.bucketed = bucketed
        self._route = BucketRoute()
        if feedback is None:
            self.compressor = make(compressor, **params)
        elif isinstance(feedback, str) and not isinstance(compressor, Compressor):
            self.compressor = make(compressor, feedback=feedback, **params)
        else:
            self.compressor = _feedback.with_feedback(make(compressor, **params), feedback)
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
            raise ValueError(f"seed must be an integer (the same on every rank), got {seed!r}")
        self.seed = int(seed)
        self.epoch: Optional[int] = None  # None until set_epoch is called
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}
        self.totals = dict.fromkeys(_COUNTERS, 0)
        self.last_report = None
        self._group = group
        self._own_group: Optional[dist.ProcessGroup] = None
        self._transport = transport
        self._worker: Optional[threading.Thread] = None
        self._jobs: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._streams: dict = {}  # the communication thread's CUDA stream per device
        self._buckets: dict[tuple, dict] = {}  # per-bucket time split (bucket_stats; not saved)
        # Memory reused across steps by exchanges that copy their results out (exchange(out=...)): per
        # tensor (TensorContext.buffer, spare) and per bucket (fused collectives).  Not saved.
        self._buffers: dict[str, dict] = {}
        self._fused: dict[tuple, dict] = {}
        self._key_of: dict[str, str] = {}  # a small vector's name -> the key it was last exchanged under
        self._buckets_lock = threading.Lock()
        #: The DDP hook's names of parameters (``register`` gives the model's; else learned on first use)
        #: and the group on which it may allreduce itself the buckets :meth:`plain_allreduce_dtype` allows
        #: (``register``: DDP's; else the default group when this state averages over it).
        self.param_names: Optional[dict] = None
        self.dense_group: Optional[dist.ProcessGroup] = None
        #: Whether CUDA exchanges are issued from the caller's thread, never from gradzip's: where the
        #: caller's own collectives during backward (SyncBatchNorm's) would otherwise be in flight beside
        #: gradzip's thread's in an order that differs between ranks (NCCL).  ``register`` sets it for
        #: SyncBatchNorm, DiLoCo for ``overlap``; set it before the first exchange (once gradzip's thread
        #: has started, CUDA exchanges stay on it: FIFO keeps the order of those already queued).
        self.issues_inline = False
        #: The DDP hook's buckets that are one plain allreduce for ever (:meth:`always_plain_dtype`), by
        #: (bucket index, buffer address, size): their keys, element count, element size and wire dtype.
        self.always_plain: dict = {}
        #: Set by ``register`` under ``find_unused_parameters=True``: what says which parameters this
        #: rank's backward reached since their bucket's last exchange, so that the hook withholds the others.
        self.local_use = None
        #: Whether :meth:`load_state_dict` ran: integrations that were asked to resume check it.
        self.loaded = False
        #: Keys of a state loaded where no group said where the gradients live: moved to them once.
        self._unplaced: set = set()
        self._loaded_here: list = []  # loaded tensors the caller's stream made, for gradzip's stream to record reading
        _LIVE.add(self)
        _install_teardown()
        if transport is None and dist.is_available() and dist.is_initialized():
            self._connect()  # now, on the caller's thread, while every rank runs the same code

    @property
    def transport(self) -> Transport:
        """Where this state's collectives go; made on first use when the state was built before
        ``torch.distributed`` was initialised (e.g. handed to Lightning's ``DDPStrategy``)."""
        if self._transport is None:
            self._connect()
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        self._transport = transport

    def _connect(self) -> None:
        group = self._group
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # A process group of gradzip's own (same ranks and backend as the default group): its
            # collectives, issued from the communication thread, never interleave with the script's.
            group = self._own_group = dist.new_group(timeout=default_group_timeout())
            if self.dense_group is None:
                # The default group is the one this state averages over, so a DDP hook handed this state
                # directly (Lightning) may run plain allreduces there; ``register`` gives DDP's own.
                self.dense_group = dist.group.WORLD
        self._transport = transport_for(group)

    @property
    def rank(self) -> int:
        return self.transport.rank

    @property
    def world_size(self) -> int:
        return self.transport.world_size

    def loss_scale(self, device: torch.device) -> Optional[torch.Tensor]:
        """``grad_scaler``'s scale, the scaler's own 0-d tensor (which it updates in place) on ``device``;
        None without a scaler, or before its first ``scale()`` (it makes its scale lazily)."""
        scale = getattr(self.grad_scaler, "_scale", None)  # get_scale() would wait for the device
        if scale is None or scale.device == device:
            return scale
        return scale.to(device, non_blocking=True)

    def set_epoch(self, epoch: int) -> None:
        """Advance epoch-driven schedules (DGC's warm-up).  Call it with the same value on every rank."""
        self.epoch = int(epoch)

    def context(self, key: str, grad: torch.Tensor, buffers: Optional[dict] = None, first_step: int = 0) -> TensorContext:
        """``first_step``: the step of a key that has none yet."""
        slot = self.tensors.get(key, {})
        if self._unplaced and key in self._unplaced and not grad.is_meta:
            # loaded where no group said where the gradients live (a CPU map_location, world size 1):
            # the state follows them, at its first exchange
            self._unplaced.discard(key)
            slot = self.tensors[key] = {n: v.to(grad.device) if isinstance(v, torch.Tensor)
                                        and not self.compressor.keeps_on_host(n) else v for n, v in slot.items()}
        return TensorContext(key=key, shape=grad.shape, dtype=grad.dtype, step=self.steps.get(key, first_step),
                             epoch=self.epoch, rank=self.rank, world_size=self.world_size, seed=self.seed,
                             state=slot, buffers=buffers)

    def exchange(self, named_grads: Sequence[tuple[str, torch.Tensor]],
                 out: Optional[Sequence[torch.Tensor]] = None, withheld: Collection[str] = ()) -> list[torch.Tensor]:
        """Compress, exchange and aggregate these gradients; returns one aggregate per input.

        Every rank must pass the same names with the same shapes in the same order.  If any rank's input
        holds NaN or Inf, or compression overflowed into one (the aggregate is not finite), every rank
        gets all-NaN aggregates for this call and no state changes, so ``torch.amp.GradScaler`` (or any
        finiteness check) skips the step identically everywhere and the previous state is kept.

        ``out``: tensors shaped like the inputs (they may be the inputs themselves, as DDP's bucket
        views are) to write the aggregates into and return.  The exchange then reuses its buffers
        from one step to the next instead of allocating (:meth:`TensorContext.buffer`, ``spare``);
        where they are the inputs, the exchange may use their memory before writing the aggregates
        (the bucket route keeps error feedback's g + e there), so after an error they hold neither.

        Small vectors (``group_vectors_below``) are joined into one tensor, compressed as one and split
        again; their state is kept under the group's key (:meth:`exchanged_keys`).

        ``withheld``: names of gradients whose owed state (error feedback's residual, DGC's momentum and
        velocity, a method's ``owed_state``) sits this exchange out: each is compressed as if it were owed nothing, and its state
        is left as it was.  DDP's hook withholds the parameters this rank did not use in the step
        (``find_unused_parameters=True``), whose results DDP drops where no rank used them.
        """
        if out is not None and len(out) != len(named_grads):
            raise ValueError(f"exchange: out has {len(out)} tensors for {len(named_grads)} gradients")
        if not withheld:
            return self._exchange_all(named_grads, out)
        held = self._hold_back(named_grads, withheld)
        try:
            return self._exchange_all(named_grads, out)
        finally:
            self._give_back(held)

    def _hold_back(self, named_grads: Sequence[tuple[str, torch.Tensor]], withheld: Collection[str]) -> list:
        """Zero the feedback state of the ``withheld`` gradients (their slice of a group's), in place;
        returns what :meth:`_give_back` restores: (key, state name, offset, the saved values, the whole
        value's shape, dtype and device)."""
        withheld = set(withheld)
        fields = _feedback.STATE_KEYS + self.compressor.owed_state
        held = []
        for key, members in self.exchanged_keys(named_grads):
            slot = self.tensors.get(key, {})
            start = 0
            for i in members:
                name, g = named_grads[i]
                if name in withheld:
                    for field in fields:
                        value = slot.get(field)
                        piece = _piece(value, start, g.numel())
                        if piece is not None:
                            held.append((key, field, start, piece.clone(), value.shape, value.dtype, value.device))
                            piece.zero_()
                start += g.numel()
        return held

    def _give_back(self, held: list) -> None:
        """Put back the state :meth:`_hold_back` saved, into whatever holds the key's state now (the
        exchange may have committed new tensors), committed or not, failed or not; where the exchange
        dropped the state (sent densely: nothing owed), into zeros for the rest of the key's."""
        for key, field, start, saved, shape, dtype, device in held:
            slot = self.tensors.setdefault(key, {})
            piece = _piece(slot.get(field), start, saved.numel())
            if piece is None:
                slot[field] = torch.zeros(shape, dtype=dtype, device=device)
                piece = _piece(slot[field], start, saved.numel())
            piece.copy_(saved)

    def _exchange_all(self, named_grads: Sequence[tuple[str, torch.Tensor]],
                      out: Optional[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        if self._loaded_here:  # read on this stream, then let go by either route: not reused before
            devices.read_here(self._loaded_here)
            self._loaded_here = []
        method = self._bucket_method(named_grads)
        if method is not None:
            return self._route.exchange(self, named_grads, out, method)
        plan = _vector_groups(named_grads, self.group_vectors_below)
        moves = self._moves(named_grads, plan)
        if plan is None:
            aggregates = self._exchange(named_grads, out, self._first_steps(moves, named_grads))
            if moves and not self.last_report.nonfinite:
                self._settle(moves)
            return aggregates
        joined, targets = [], []
        for key, members in plan:
            if len(members) == 1:
                joined.append(named_grads[members[0]])
                targets.append(None if out is None else out[members[0]])
                continue
            pieces = [named_grads[i][1].reshape(-1) for i in members]
            if out is None:
                together = torch.cat(pieces)
            else:  # reused from step to step, and the exchange's output as well as its input
                buffers = self._buffers.setdefault(key, {})
                together = buffers.get(_JOINED)
                numel = sum(p.numel() for p in pieces)
                if (together is None or together.numel() != numel or together.dtype != pieces[0].dtype
                        or together.device != pieces[0].device):
                    together = buffers[_JOINED] = pieces[0].new_empty(numel)
                torch.cat(pieces, out=together)
            joined.append((key, together))
            targets.append(together)
        aggregates = self._exchange(joined, None if out is None else targets, self._first_steps(moves, joined))
        if not self.last_report.nonfinite:
            self._settle(moves)
        results = [None] * len(named_grads)
        for (key, members), aggregate in zip(plan, aggregates):
            if len(members) == 1:
                results[members[0]] = aggregate
                continue
            start = 0
            for i in members:
                shape = named_grads[i][1].shape
                piece = aggregate[start:start + shape.numel()].view(shape)
                start += shape.numel()
                results[i] = piece if out is None else out[i].copy_(piece)
        return results

    def _takes_bucket_route(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> bool:
        return self._bucket_method(named_grads) is not None

    def _bucket_method(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> Optional[Compressor]:
        """The method that exchanges this bucket whole (the state's own, or auto's choice), or None: the
        per-tensor route."""
        if self.bucketed is False or self.group_vectors_below > 0 or not named_grads:
            return None
        if self.bucketed is None and not devices.cuda(named_grads[0][1]):
            return None
        method = self.compressor.bucket_method([key for key, _ in named_grads], self.tensors)
        if method is None or not takes_bucket_route(method, [g for _, g in named_grads], self.world_size):
            return None
        return method if method.takes_bucket(self.world_size) else None

    def _moves(self, named_grads: Sequence[tuple[str, torch.Tensor]], plan: Optional[list]) -> dict:
        """``{name: (key, key before)}`` for each small vector that :meth:`exchange` now sends under
        another key than last time: into a group, out of one into its own name, or into another group
        (DDP rebuilds its buckets after the first step).  Nothing when grouping is off."""
        if self.group_vectors_below <= 0:
            return {}
        moves = {}
        for key, members in plan or _each_alone(named_grads):
            for i in members:
                name, g = named_grads[i]
                if len(members) == 1 and not _small(g, self.group_vectors_below):
                    continue
                before = self._key_of.get(name)
                if before != key:
                    moves[name] = (key, before)
        return moves

    def _first_steps(self, moves: dict, exchanged: Sequence[tuple[str, torch.Tensor]]) -> dict:
        """The step a key new to this state starts at: that of the bucket's other tensors, or of the keys
        its vectors came from, so that a bucket stays on one step count (``auto`` schedules its trials
        by step, bucket by bucket)."""
        new = {key for key, _ in moves.values() if key not in self.steps}
        if not new:
            return {}
        start = max([self.steps[k] for k, _ in exchanged if k in self.steps]
                    + [self.steps.get(before, 0) for key, before in moves.values() if key in new and before], default=0)
        return dict.fromkeys(new, start)

    def _settle(self, moves: dict) -> None:
        """After an exchange that committed: drop the state of the keys the moved vectors left (a
        group's residual held their past compression error, which no other key can take over; a
        vector's own, stale once it is grouped)."""
        for name, (key, before) in moves.items():
            if before is not None:
                self.tensors.pop(before, None)
                self.steps.pop(before, None)
                self._buffers.pop(before, None)
            self._key_of[name] = key

    def exchanged_keys(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int]]]:
        """The state keys :meth:`exchange` uses for these gradients: ``(key, indices)`` per tensor it
        compresses, ``indices`` being the gradients that tensor holds, in order (several for a group of
        small vectors)."""
        return _vector_groups(named_grads, self.group_vectors_below) or _each_alone(named_grads)

    def _as_exchanged(self, named_grads: Sequence[tuple[str, torch.Tensor]], plan: Optional[list]) -> list[tuple[str, torch.Tensor]]:
        """The tensors :meth:`exchange` would compress under ``plan`` (:func:`_vector_groups`), a group of
        vectors as a meta tensor of its size: enough for what depends on keys, shapes and dtypes only."""
        if plan is None:
            return list(named_grads)
        return [(key, named_grads[m[0]][1] if len(m) == 1 else
                 torch.empty(sum(named_grads[i][1].numel() for i in m), dtype=named_grads[m[0]][1].dtype, device="meta"))
                for key, m in plan]

    def _exchange(self, named_grads: Sequence[tuple[str, torch.Tensor]],
                  out: Optional[Sequence[torch.Tensor]] = None, first_steps: Optional[dict] = None) -> list[torch.Tensor]:
        keys = [key for key, _ in named_grads]
        self.compressor.observe_step(keys, time.perf_counter())
        reuse = out is not None
        first_steps = first_steps or {}
        contexts = [self.context(key, g, self._buffers.setdefault(key, {}) if reuse else None, first_steps.get(key, 0))
                    for key, g in named_grads]
        grads = [g for _, g in named_grads]
        if reuse:
            for ctx, target in zip(contexts, _lendable(out, grads)):
                ctx.out = target
        for g, ctx in zip(grads, contexts):  # feedback checks g + e as it computes it, where it can
            ctx.check_input = _feedback.checks_input(self.compressor, g, ctx)
            ctx.scale = self.loss_scale(g.device)
        # A dense method carries any NaN or Inf into the aggregate, which is checked below anyway.
        carried = self.compressor.carries_nonfinite
        nonfinite = not carried and _any_nonfinite([g for g, ctx in zip(grads, contexts) if not ctx.check_input])
        if nonfinite:
            # Keep the protocol identical on every rank: compress zeros, discard the result below.
            grads = [torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0) for g in grads]
        gens = [_feedback.exchange(self.compressor, g, ctx) for g, ctx in zip(grads, contexts)]
        fused = self._fused.setdefault(tuple(keys), {}) if reuse else None
        results, report = run_lockstep(gens, self.transport,
                                       lambda: nonfinite or any(ctx.input_nonfinite for ctx in contexts), buffers=fused)
        outputs = out
        if not report.nonfinite:
            # Compression can overflow where the input did not (a value above 65504 sent as fp16, a sum
            # in a 16-bit type).  Aggregates are bit-identical on every rank, so this check agrees
            # everywhere without a collective; the step is then handled as a non-finite input.
            if out is None:
                outputs = [r.aggregate.reshape(g.shape).to(g.dtype) for r, g in zip(results, grads)]
                unchecked = list(zip(outputs, results))
            else:
                unchecked = []
                for target, r in zip(out, results):
                    source = r.aggregate.reshape(target.shape)
                    if _checked_as_copied(target, r):  # large and dense: read as it is copied
                        report.nonfinite |= not _copied_finite(target, source)
                        continue
                    if not _is_memory_of(r.aggregate, target):  # not built in it already
                        target.copy_(source)
                    unchecked.append((target, r))
            report.nonfinite = report.nonfinite or _any_nonfinite([_may_be_nonfinite(o, r) for o, r in unchecked])
        if report.nonfinite:
            if out is None:
                outputs = [torch.full_like(g, float("nan")) for g in grads]
            else:
                for target in out:
                    target.fill_(float("nan"))
        else:
            lent = {_address(t) for pool in (fused or {}, *(c.buffers or {} for c in contexts)) for t in pool.values()}
            lent.update(_address(t) for t in out or ())  # the caller's memory: never to be kept as state
            for ctx in contexts:
                self._commit(ctx, lent)
        self._count(report, grads, results)
        return list(outputs)

    def plain_allreduce_dtype(self, named_grads: Sequence[tuple[str, torch.Tensor]]) -> Optional[torch.dtype]:
        """The dtype in which one plain allreduce of every gradient / N gives exactly this exchange's
        averages while changing no state but the step counters; None when there is none.

        That holds for dense steps (warm-up, tensors the method leaves alone, ``auto`` having chosen
        dense: the gradients' own dtype) and for fp16 and bf16 without error feedback (the half dtype).
        An integration may then run that allreduce on its framework's C++ path, without gradzip's
        thread and fusion copies, and call :meth:`record_dense`.  The one difference: a non-finite input
        stays non-finite where it was instead of making the whole aggregate NaN (still the same on every
        rank, so ``GradScaler`` skips the step everywhere), and it is not counted in ``stats()``.
        """
        scheme = _feedback.scheme_of(self.compressor)
        if isinstance(scheme, _feedback.MomentumCorrection):  # momentum accumulates even where nothing is compressed
            return None
        wire = set()
        for key, g in self._as_exchanged(named_grads, _vector_groups(named_grads, self.group_vectors_below)):
            ctx = self.context(key, g)
            if any(k in ctx.state for k in scheme.state_keys):
                return None  # a residual left from earlier steps must be sent
            wire.add(self.compressor.allreduce_dtype(ctx))
        return wire.pop() if len(wire) == 1 and None not in wire else None

    def always_plain_dtype(self, dtype: torch.dtype) -> Optional[torch.dtype]:
        """:meth:`plain_allreduce_dtype` of every exchange of gradients of ``dtype``, for ever (none, and
        fp16 and bf16 without feedback, ungrouped); None where it may change with the step or state."""
        if self.group_vectors_below or not isinstance(_feedback.scheme_of(self.compressor), _feedback.NoFeedback):
            return None
        return self.compressor.always_plain(dtype, self.world_size)

    def record_plain(self, keys: tuple, elements: int, element_bytes: int, wire: torch.dtype) -> None:
        """:meth:`record_dense` for a bucket of ``keys`` that :meth:`always_plain_dtype` allowed, from its
        element count and its gradients' element size: no pass over its tensors."""
        self._count_plain(keys, elements, elements * wire.itemsize, elements * element_bytes)

    def record_dense(self, named_grads: Sequence[tuple[str, torch.Tensor]], dtype: Optional[torch.dtype] = None) -> None:
        """Count an exchange that :meth:`plain_allreduce_dtype` allowed and the integration did itself,
        in ``dtype`` (default: the gradients' own).  The compressor still observes the step: auto clocks
        whole steps, dense ones included."""
        plan = _vector_groups(named_grads, self.group_vectors_below)
        exchanged = self._as_exchanged(named_grads, plan)
        moves = self._moves(named_grads, plan)
        first_steps = self._first_steps(moves, exchanged)
        self._settle(moves)
        elements = sum(g.numel() for _, g in named_grads)
        dense = sum(g.numel() * g.element_size() for _, g in named_grads)
        self._count_plain([key for key, _ in exchanged], elements, elements * dtype.itemsize if dtype is not None else dense,
                          dense, first_steps)

    def _count_plain(self, keys: Sequence[str], elements: int, sent: int, dense: int, first_steps: Optional[dict] = None) -> None:
        """One plain allreduce of ``sent`` bytes for ``dense`` bytes of gradients: counters, steps, and
        the compressor's clock of whole steps."""
        self.compressor.observe_step(keys, time.perf_counter())
        t = self.totals
        t["exchanges"] += 1
        t["collectives"] += 1
        t["plain_allreduces"] += 1
        t["payload_bytes"] += sent
        t["wire_bytes"] += sent
        t["dense_bytes"] += dense
        t["elements"] += elements
        t["elements_sent"] += elements
        first_steps = first_steps or {}
        for key in keys:
            self.steps[key] = self.steps.get(key, first_steps.get(key, 0)) + 1

    def _commit(self, ctx: TensorContext, lent: frozenset | set = frozenset()) -> None:
        """Make ``ctx``'s staged state the committed one.  A value built in a spare
        (:meth:`TensorContext.spare`) swaps places with the value it replaces, which becomes the next
        step's spare; a value in memory lent for this exchange only (a buffer, a fused collective's
        result) is copied, as that memory is written again next step."""
        slot = self.tensors.setdefault(ctx.key, {})
        for name, value in ctx.updates.items():
            old = slot.get(name)
            if value is None:
                slot.pop(name, None)
            else:
                if isinstance(value, torch.Tensor) and _address(value) in lent:
                    spare = SPARE + name
                    if spare in ctx.buffers and _address(value) == _address(ctx.buffers[spare]):
                        if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype:
                            ctx.buffers[spare] = old  # double buffering: the retired value is next step's spare
                        else:
                            del ctx.buffers[spare]
                    else:
                        value = value.clone()
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
               done: Callable[[list[torch.Tensor]], object],
               out: Optional[Sequence[torch.Tensor]] = None, compiles: bool = True,
               withheld: Collection[str] = ()) -> torch.futures.Future:
        """Run :meth:`exchange` (into ``out``, if given) on this state's single communication thread;
        FIFO keeps the order of collectives identical on every rank.  The future gets
        ``done(aggregates)``'s value.  ``compiles=False``: the exchange takes its reference paths where
        a fused kernel would first have to be compiled in this process (for those seconds
        ``torch.compiler.is_compiling()`` is true for the whole process, and the caller's code running
        meanwhile, e.g. an optimizer's step, would take its compiled-code branches).  ``withheld``: as
        in :meth:`exchange`."""
        self.transport  # connect on the caller's thread, never on the communication thread
        device = next((g.device for _, g in named_grads if devices.cuda(g)), None)
        ready = None
        if device is not None:
            # The thread works on a stream of its own: it waits for what the caller's stream (backward)
            # has queued so far, and the future, being CUDA-aware, makes whoever waits on it wait for
            # the thread's stream in turn.  No host synchronisation is needed for the ordering.
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        fut: torch.futures.Future = torch.futures.Future(devices=[device] if device is not None else None)
        with self._lock:
            if self._closed:
                raise RuntimeError("this GradzipState is closed (state.close(), the end of its `with` block, "
                                   "or destroy_process_group()); make a new one to go on training")
            inline = device is not None and self._worker is None and self._issues_inline(named_grads)
            if not inline:
                if self._worker is None:
                    self._worker = threading.Thread(target=self._serve, args=(torch.get_num_threads(),),
                                                    name="gradzip-comm", daemon=True)
                    self._worker.start()
                self._jobs.put((list(named_grads), out, done, fut, device, ready, time.perf_counter(), compiles, withheld))
        if inline:
            self._run_job(list(named_grads), out, done, fut, device, ready, time.perf_counter(), compiles, withheld)
        return fut

    def _serve(self, num_threads: int) -> None:
        # OpenMP's thread count is per thread: without this a new thread uses every core and its
        # spinning workers fight the training processes for CPUs.
        torch.set_num_threads(num_threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if len(job) == 2:  # a call queued by _on_thread
                fn, fut = job
                try:
                    fut.set_result(fn())
                except BaseException as exc:
                    fut.set_exception(exc)
                continue
            self._run_job(*job)
            del job  # hold no tensor while waiting for the next job

    def _run_job(self, named, out, done, fut, device, ready, submitted, compiles, withheld=()) -> None:
        try:
            with self._stream_for(device, ready), contextlib.nullcontext() if compiles else kernels.compiled_only():
                started = time.perf_counter()
                aggregates = self.exchange(named, out, withheld) if withheld else self.exchange(named, out)
                report = self.last_report
                self.record_bucket(named, exchanges=1, queued_s=started - submitted, compress_s=report.compress_s,
                                   communicate_s=report.communicate_s, decompress_s=report.decompress_s)
                fut.set_result(done(aggregates))
        except BaseException as exc:  # handed to the waiting training loop
            fut.set_exception(exc)

    def _issues_inline(self, named_grads) -> bool:
        """Whether a CUDA bucket's exchange is issued from the caller's thread (DDP's hook) on the
        state's side stream instead of the communication thread: always where :attr:`issues_inline`
        says so; else where the bucket route applies, since it never waits for the device, and
        GRADZIP_ISSUE=inline (thread by default)."""
        if self.issues_inline:
            return True
        return os.environ.get("GRADZIP_ISSUE", "thread") == "inline" and self._takes_bucket_route(named_grads)

    def _stream_for(self, device, ready):
        """The communication thread's own CUDA stream for ``device``, after ``ready`` (CPU: nothing)."""
        if device is None:
            return contextlib.nullcontext()
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        stream.wait_event(ready)
        return torch.cuda.stream(stream)

    def close(self, timeout: Optional[float] = 60.0) -> None:
        """Finish the exchanges already submitted, stop the communication thread, and destroy the
        process group this state made for itself.  Idempotent.

        It runs by itself when ``torch.distributed.destroy_process_group()`` destroys this state's group
        (or the default one) and before the interpreter exits; with ``with`` it runs at the block's end.
        Counters, :meth:`stats` and :meth:`state_dict` stay readable; :meth:`submit` then raises.
        A thread that has not finished after ``timeout`` seconds (a collective waiting for a dead peer)
        raises ``TimeoutError`` instead of hanging the job.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.local_use is not None:
                self.local_use.remove()
            worker, self._worker = self._worker, None
            if worker is not None:
                self._jobs.put(None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
            if worker.is_alive():
                raise TimeoutError(f"gradzip's communication thread did not finish within {timeout} s "
                                   "(a collective is waiting for a peer that has stopped)")
        self._release_group()

    def adopt_group(self, group: Optional[dist.ProcessGroup]) -> None:
        """Destroy ``group``, made for this state by an integration (None: nothing), at :meth:`close`."""
        if group is not None:
            self._own_group = group

    def _release_group(self) -> None:
        group, self._own_group = self._own_group, None
        if group is not None and _registered(group):
            dist.destroy_process_group(group)

    def uses_group(self, group: Optional[dist.ProcessGroup]) -> bool:
        """Whether destroying ``group`` (None: the default group, which takes every group with it)
        takes away this state's collectives."""
        if group is None or group is dist.GroupMember.WORLD:
            return True
        return getattr(self._transport, "group", None) is group  # gradzip's own group is its transport's

    def __enter__(self) -> "GradzipState":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- reporting and checkpoints -------------------------------------------------------------------
    def record_bucket(self, named_grads: Sequence[tuple[str, torch.Tensor]], **counts: float) -> None:
        """Add counts (``exchanges``, ``plain``, ``hook_s``, ``queued_s``, ``compress_s``, ...) to this
        bucket's line of :meth:`bucket_stats`."""
        keys = tuple(key for key, _ in named_grads)
        self.record_bucket_of(keys, sum(g.numel() for _, g in named_grads), **counts)

    def record_bucket_of(self, keys: tuple, elements: int, **counts: float) -> None:
        """:meth:`record_bucket` for the bucket of ``keys`` holding ``elements`` elements."""
        with self._buckets_lock:  # the hook (backward's thread) and gradzip's thread both write here
            record = self._buckets.get(keys)
            if record is None:
                record = self._buckets[keys] = {
                    "bucket": f"{keys[0]} .. {keys[-1]}" if len(keys) > 1 else keys[0], "tensors": len(keys),
                    "elements": elements, "exchanges": 0, "plain": 0,
                    **dict.fromkeys(("hook_s", "queued_s", "compress_s", "communicate_s", "decompress_s"), 0.0)}
            for name, value in counts.items():
                record[name] += value

    def bucket_stats(self) -> list[dict]:
        """Where each bucket's exchanges spent their time on this rank, in the order buckets first came:
        ``hook_s`` (the integration's hook, on backward's own thread: what backward waited for),
        ``queued_s`` (from submission until gradzip's thread started it: buckets ahead of it),
        ``compress_s``, ``communicate_s``, ``decompress_s`` (ExchangeReport's split on the thread),
        each summed over ``exchanges``; ``plain``: how many took the plain allreduce (its collective
        then runs in the framework, untimed).  Not saved in :meth:`state_dict`."""
        with self._buckets_lock:
            return [dict(r) for r in self._buckets.values()]

    def stats(self) -> dict:
        """Cumulative counters of this worker, over every exchange so far (NaN before the first):

        - ``bytes_sent`` (= ``wire_bytes``): every byte this worker handed to collectives (payloads, size
          headers, padding, the non-finite flag); ``payload_bytes``: the compressed payloads alone;
          ``dense_bytes``: what sending the gradients in their own dtype would take.
        - ``ratio``: ``dense_bytes / bytes_sent``.
        - ``bits_per_element``: ``8 * bytes_sent / elements``, wire bits per gradient element (32 for
          dense fp32, 16 for fp16, about 0.64 for Top-k 1% with fp32 values and int32 indices).
        - ``density``: ``elements_sent / elements``, the fraction of gradient elements whose values a
          sparsifier sent (Top-k 1%: 0.01).  Every method that does not select elements counts each
          element as sent, in whatever form it codes it: 1.0 for quantisers, sign methods, PowerSGD's
          low-rank factors and dense steps alike.  For the cost on the wire read ``bits_per_element``.
        - ``exchanges``, ``collectives``, ``plain_allreduces`` (exchanges the integration did as one
          plain allreduce), ``nonfinite_exchanges``; ``compress_s``, ``communicate_s``,
          ``decompress_s`` (the split on gradzip's thread); ``compressor``, ``world_size``.
        """
        self._route.resolve(self.steps, self.totals)
        t = dict(self.totals)
        t["bytes_sent"] = t["wire_bytes"]
        t["ratio"] = t["dense_bytes"] / t["wire_bytes"] if t["wire_bytes"] else float("nan")
        t["density"] = t["elements_sent"] / t["elements"] if t["elements"] else float("nan")
        t["bits_per_element"] = 8 * t["wire_bytes"] / t["elements"] if t["elements"] else float("nan")
        t["compressor"] = self.compressor.name
        t["world_size"] = self.world_size
        return t

    def describe(self, as_text: bool = False):
        """What this state runs and, so far, what it did: a dict, or (``as_text=True``) the same as lines
        to read, the first a one-line summary (what the integrations log at construction).

        ``method``, ``params`` (the method's constructor parameters), ``feedback`` (the error-feedback
        scheme), ``world_size`` (None until the state has connected), ``group_vectors_below``, ``route``
        (``per-tensor``, ``bucket``, or with the default ``bucketed=None`` and a method that has a bucket
        route ``bucket on CUDA, per-tensor on CPU``), and ``buckets``: each
        bucket this rank has exchanged, as in :meth:`bucket_stats`, with the ``route`` it took
        (``plain allreduce``, ``bucket``, ``per-tensor``).  With ``auto`` each bucket also has its
        tensors' ``choices``, and ``auto`` maps each tensor to
        :meth:`gradzip.compressors.auto.Auto.decision`: its choice (or its stage until then), why, and
        the times auto measured.  Reads only what is recorded: no collective, so any rank may call it,
        between steps (gradzip's thread writes what it reads while a step's exchanges run).
        """
        from .compressors.auto import Auto

        c = self.compressor
        auto = c if isinstance(c, Auto) else None
        decided = {}
        if auto is not None:
            keys = list(self.steps) + [k for k in self.tensors if k not in self.steps]
            decided = {k: auto.decision(self.tensors.get(k, {}), self.steps.get(k, 0)) for k in keys}
        buckets = []
        for keys, record in self._bucket_records():
            entry = dict(record, route=self._route_of(keys, record))
            if auto is not None:
                entry["choices"] = {k: decided[k]["choice"] for k in dict.fromkeys(self._key_of.get(n, n) for n in keys)
                                    if k in decided}
            buckets.append(entry)
        params = {k: v for k, v in c.params().items() if k != "feedback"}
        info = {"method": c.name, "params": params, "feedback": _feedback.scheme_of(c).name,
                "world_size": None if self._transport is None else self._transport.world_size,
                "group_vectors_below": self.group_vectors_below, "route": self._planned_route(), "buckets": buckets}
        if auto is not None:
            info["auto"] = decided
        return _described(info) if as_text else info

    def _bucket_records(self) -> list:
        with self._buckets_lock:
            return [(keys, dict(record)) for keys, record in self._buckets.items()]

    def _planned_route(self) -> str:
        """The route this state's exchanges take (:meth:`_takes_bucket_route`), before seeing gradients."""
        world = 1 if self._transport is None else self._transport.world_size
        if self.bucketed is False or self.group_vectors_below > 0:
            return "per-tensor"
        if self.compressor.delegates_buckets:
            return ("per-tensor until it decides, then its choice's route" + ("" if self.bucketed else " on CUDA"))
        if (not self.compressor.bucketed or not _feedback.takes_bucket(self.compressor)
                or not self.compressor.takes_bucket(world)):
            return "per-tensor"
        return "bucket" if self.bucketed else "bucket on CUDA, per-tensor on CPU"

    def _route_of(self, keys: tuple, record: dict) -> str:
        if record["exchanges"] and record["plain"] == record["exchanges"]:
            return "plain allreduce"
        return "bucket" if keys in self._route.taken else "per-tensor"

    def state_dict(self, *, all_ranks: bool = False) -> dict:
        """Everything needed to continue bit for bit: per-tensor state, step counters, epoch, counters.

        Residuals and momenta are each rank's own.  By default this rank's alone (it records its rank):
        save one per rank.  ``all_ranks=True`` gathers every rank's into one dict, on every rank, so a
        file written by rank 0 alone carries all of them: a collective, so call it on every rank at the
        same point (e.g. at every evaluation, also where only rank 0 then decides to save).  It holds
        world size times one rank's state, in CPU memory.  :meth:`load_state_dict` takes either form;
        the gathered one also resumes on another number of ranks.
        """
        own = self._own_state_dict()
        if not all_ranks:
            return own
        buffer = io.BytesIO()
        torch.save({**own, "tensors": {k: {n: v.cpu() for n, v in slot.items()} for k, slot in own["tensors"].items()}},
                   buffer)
        parts = self._on_thread(lambda: self.transport.allgather_bytes(buffer.getvalue()))
        return {"all_ranks": [torch.load(io.BytesIO(part), weights_only=True) for part in parts],
                "compressor": own["compressor"]}

    def _own_state_dict(self) -> dict:
        self._route.resolve(self.steps, self.totals)
        return {
            "rank": self.rank,
            "compressor": self.compressor.name,
            "params": self.compressor.params(),
            "seed": self.seed,
            "epoch": self.epoch,
            "steps": dict(self.steps),
            "tensors": {k: {n: v.clone() for n, v in slot.items()} for k, slot in self.tensors.items()},
            "totals": dict(self.totals),
        }

    def stateful(self) -> "AllRanks":
        """This state as a ``torch.distributed.checkpoint`` ``Stateful`` holding every rank's part:
        ``dcp.save({"model": ..., "gradzip": state.stateful()}, checkpoint_id=...)`` and the same
        ``dcp.load``, on every rank.  (The state itself would be saved as one rank's tensors: DCP keeps
        one copy of a plain tensor that every rank holds under the same name.)"""
        return AllRanks(self)

    def load_state_dict(self, state: dict, *, any_rank: bool = False) -> None:
        """Load a :meth:`state_dict`.

        A gathered one (``all_ranks=True``) gives each rank its own part; saved on another number of
        ranks, each rank gets what error feedback still owes, the mean over the saved ranks of each
        residual, velocity and momentum (:func:`reshard`).  A single rank's is refused on another rank
        when it holds per-tensor state (that rank's residuals and momenta), unless ``any_rank=True``:
        loading one rank's state everywhere would duplicate its error feedback and lose the others'."""
        if state.get("compressor") != self.compressor.name:
            raise ValueError(f"state_dict is for compressor {state.get('compressor')!r}, "
                             f"this state uses {self.compressor.name!r}")
        if "all_ranks" in state:
            state = reshard(state["all_ranks"], self.rank, self.world_size)
        state = _keyed_as_named(state, self.param_names)
        saved_by = state.get("rank")
        if not any_rank and saved_by is not None and saved_by != self.rank and any(state["tensors"].values()):
            raise ValueError(f"this gradzip state_dict was saved by rank {saved_by} and holds that rank's own "
                             f"residuals and momenta; load each rank's own (save one file per rank, e.g. "
                             f"gradzip_rank{{rank}}.pt, or one for all with state_dict(all_ranks=True)), "
                             f"or pass any_rank=True to take rank {saved_by}'s anyway")
        device = self._device_of_state()
        self.seed = int(state["seed"])
        self.epoch = None if state["epoch"] is None else int(state["epoch"])
        self.steps = dict(state["steps"])
        host = self.compressor.keeps_on_host
        self.tensors = {k: {n: v.to(device) if device is not None and not host(n) else v.clone()
                            for n, v in slot.items()} for k, slot in state["tensors"].items()}
        self._unplaced = set(self.tensors) if device is None else set()
        self._loaded_here = [v for slot in self.tensors.values() for v in slot.values()
                             if isinstance(v, torch.Tensor) and devices.cuda(v)]
        self.totals.update(state.get("totals", {}))
        taken, self._route = self._route.taken, BucketRoute()  # its flat state is rebuilt from the loaded tensors
        self._route.taken = taken  # describe()'s record of the route each bucket took, kept as the records are
        self.loaded = True

    def _device_of_state(self) -> Optional[torch.device]:
        """Where this rank's state lives (its CUDA device under NCCL), for tensors gathered on CPUs; None
        where no exchange nor the group has said: not the current GPU, GPU 0 of every rank that did not
        set one (its gradients' device places the state at its first exchange)."""
        if isinstance(self._transport, ProcessGroupTransport):
            known = self._transport.known_device
            if known is not None and not devices.host_memory(known):
                return known
        return None

    def _on_thread(self, fn: Callable):
        """``fn()`` after every exchange already submitted, on the communication thread where it runs
        (so its collectives queue behind theirs on gradzip's group), else here."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            queued = self._worker is not None and not self._closed
            if queued:
                self._jobs.put((fn, fut))
        return fut.wait() if queued else fn()


class AllRanks:
    """A ``torch.distributed.checkpoint`` ``Stateful`` holding every rank's part of a
    :class:`GradzipState` (:meth:`GradzipState.stateful`).  It is saved as one object, the same on every
    rank, which DCP writes once and hands to every rank at load, whatever the number of ranks then."""

    def __init__(self, state: GradzipState):
        self.state = state

    def state_dict(self) -> dict:
        buffer = io.BytesIO()
        torch.save(self.state.state_dict(all_ranks=True), buffer)
        return {"all_ranks": buffer.getvalue()}

    def load_state_dict(self, saved: dict) -> None:
        self.state.load_state_dict(torch.load(io.BytesIO(saved["all_ranks"]), weights_only=True))


def _keyed_as_named(state: dict, param_names: Optional[dict]) -> dict:
    """``state`` with the keys ``_orig_mod.<name>`` of a parameter now named ``<name>`` renamed: gradzip
    once named ``DDP(torch.compile(model))``'s parameters so; ``register`` now names them as the model does."""
    names = set(param_names.values()) if param_names else set()
    prefix = "_orig_mod."
    old = [k for k in state["tensors"] if k.startswith(prefix) and k[len(prefix):] in names]
    if not old:
        return state
    rename = {k: k[len(prefix):] for k in old}
    return {**state, "tensors": {rename.get(k, k): v for k, v in state["tensors"].items()},
            "steps": {rename.get(k, k): v for k, v in state["steps"].items()}}


def reshard(parts: Sequence[dict], rank: int, world_size: int) -> dict:
    """Rank ``rank``'s state (of ``world_size``) from the states ``parts`` of every saved rank.

    On the same number of ranks, each rank's own.  On another, what error feedback owes is conserved:
    with N saved ranks holding residuals e_1..e_N, the next exchange adds their mean (1/N) sum e_i to
    the update, so each of the N' new ranks takes that mean, and the mean over the new ranks is again
    (1/N) sum e_i.  Velocities and momenta likewise.  State equal on every saved rank (PowerSGD's
    shared basis Q, ``auto``'s decisions) is kept as it is; per-rank random streams are re-derived
    from the seed and the new ranks.  Counters of ranks that did not exist start at zero.
    """
    if len(parts) == world_size:
        return parts[rank]
    first = parts[0]
    tensors = {}
    for key, slot in first["tensors"].items():
        tensors[key] = {}
        for name, value in slot.items():
            values = [part["tensors"][key][name] for part in parts]
            if all(torch.equal(v, value) for v in values[1:]):
                tensors[key][name] = value
            elif value.is_floating_point():
                tensors[key][name] = torch.stack([v.double() for v in values]).mean(0).to(value.dtype)
            else:
                raise ValueError(f"cannot resume on {world_size} ranks from {len(parts)}: state {name!r} of "
                                 f"{key!r} differs between ranks and is not a float tensor to average")
    totals = parts[rank]["totals"] if rank < len(parts) else dict.fromkeys(first["totals"], 0)
    return {**first, "rank": rank, "tensors": tensors, "totals": dict(totals)}


def _described(info: dict) -> str:
    """:meth:`GradzipState.describe`'s dict as lines: a summary, then one line per bucket."""
    params = ", ".join(f"{k}={v!r}" for k, v in info["params"].items())
    world = "world size not known yet" if info["world_size"] is None else f"world size {info['world_size']}"
    grouped = f"; vectors under {info['group_vectors_below']} elements grouped" if info["group_vectors_below"] else ""
    lines = [f"{info['method']}({params}); feedback {info['feedback']}; {world}; route: {info['route']}{grouped}"]
    decided = info.get("auto", {})
    for b in info["buckets"]:
        line = (f"  bucket {b['bucket']}: {b['tensors']} tensors, {b['elements']} elements, {b['exchanges']} "
                f"exchanges, {b['route']}")
        if "choices" in b:
            specs = sorted({spec or "undecided" for spec in b["choices"].values()}) or ["undecided"]
            key = next(iter(b["choices"]), None)
            why = decided[key]["reason"] if key is not None else "not exchanged by auto yet"
            line += f"; auto: {' / '.join(specs)} ({why})"
        lines.append(line)
    if decided and not info["buckets"]:
        lines += [f"  {key}: {d['choice'] or 'undecided'} ({d['reason']})" for key, d in decided.items()]
    return "\n".join(lines)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` is still a live process group (destroying it twice is an error)."""
    return dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


# -- teardown ------------------------------------------------------------------------------------------
# Every live state, so that they can be closed before their process group or the interpreter goes away.
_LIVE: "weakref.WeakSet[GradzipState]" = weakref.WeakSet()
_TEARDOWN_INSTALLED = False


def _install_teardown() -> None:
    """Close live states when ``destroy_process_group`` takes their group and before interpreter exit."""
    global _TEARDOWN_INSTALLED
    if _TEARDOWN_INSTALLED:
        return
    _TEARDOWN_INSTALLED = True
    atexit.register(_at_exit)
    destroy = dist.destroy_process_group
    if getattr(destroy, "_gradzip_wrapped", None) is None and dist.is_available():
        @functools.wraps(destroy)
        def destroy_process_group(group=None):
            for state in list(_LIVE):
                if state.uses_group(group):
                    state.close()  # destroys the group it made for itself
            if group is not None and not _registered(group):
                return None  # that was such a group
            return destroy(group)

        destroy_process_group._gradzip_wrapped = destroy
        dist.destroy_process_group = destroy_process_group
        dist.distributed_c10d.destroy_process_group = destroy_process_group


def _at_exit() -> None:
    for state in list(_LIVE):
        try:
            state.close(timeout=5.0)
        except Exception:  # the interpreter is exiting: a stuck peer must not keep it alive
            pass
    _let_gloo_threads_finish()


def _let_gloo_threads_finish(limit_s: float = 1.0) -> None:
    """Wait (GIL released) until gloo's worker threads are idle, for at most ``limit_s``.

    A gloo worker thread destroys each finished collective right after completing its future, and that
    may drop a Python reference, which needs the GIL.  If the interpreter is already finalising then,
    the thread is stopped inside a C++ destructor and the process aborts with "terminate called without
    an active exception" (SIGABRT), whatever the collective was: plain DDP without gradzip shows it too.
    Sleeping here lets such a thread finish first.
    """
    deadline = time.monotonic() + limit_s
    time.sleep(0.01)
    while time.monotonic() < deadline and _gloo_threads_busy():
        time.sleep(0.01)


def _gloo_threads_busy() -> bool:
    """Whether a gloo worker thread of this process is running (Linux; elsewhere False).  A thread
    waiting for the GIL shows as sleeping, but it gets the GIL while the caller sleeps."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        if name.startswith("pt_gloo") and state == "R":
            return True
    return False
