"""The compressor interface.

A compressor turns one worker's (error-compensated) gradient ``x`` into an aggregate shared by every
worker.  Its :meth:`Compressor.exchange` is a generator that *yields* collective requests
(:class:`AllReduce`, :class:`AllGather`) and receives their results; it never touches
``torch.distributed`` itself.  The collectives layer drives the generators of many tensors in lockstep,
fuses their requests into a few large collectives, and issues them in one fixed order on every rank.
That keeps each compressor a few lines of the paper's equations, and makes multi-phase protocols
(PowerSGD's two allreduces, CSC's norm vote, TernGrad's scale sharing) safe by construction.
"""
from __future__ import annotations

import ctypes
import functools
import math
import threading
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generator, Optional, Sequence

import numpy as np
import torch

from .. import devices, kernels

__all__ = [
    "AllReduce",
    "AllGather",
    "Exchanged",
    "StagedContext",
    "TensorContext",
    "Compressor",
    "SummableCompressor",
    "GatheredCompressor",
    "Exchange",
    "check_ratio",
    "value_dtype",
    "saturation_limit",
    "wire_cast",
    "add_scaled",
    "times_scale",
    "unscale_",
    "workspace",
    "zeroed",
]


@dataclass
class AllReduce:
    """Request: reduce ``tensor`` over all ranks (``op`` is ``"sum"`` or ``"max"``); result is the reduced tensor."""

    tensor: torch.Tensor
    op: str = "sum"


@dataclass
class AllGather:
    """Request: gather a tuple of 1-D tensors (the payload's fields) from every rank.

    The result is a list over ranks of tuples of 1-D tensors with the sender's dtypes.  ``same_size``
    promises that every rank sends fields of identical sizes (the size then depends only on the tensor's
    shape); otherwise the sizes are exchanged first, which costs one small extra collective.
    """

    fields: tuple
    same_size: bool = True


class Exchanged:
    """The outcome of one tensor's exchange.

    ``aggregate`` is what the optimizer receives (normally the mean over workers of what they sent), in
    float32 or in a narrower float type that float32 holds exactly (fp16's sum), cast by the owner.
    ``sent`` is this worker's own contribution as the receivers decode it, D(C(x)); error feedback
    keeps ``x - sent``.  ``mask`` marks the positions a sparsifier sent (for DGC's momentum masking).

    ``sent`` and ``mask`` may be given as zero-argument callables, built on first access: feedback
    "none" never reads ``sent``, so it does not pay for decoding it.  ``sparse=(idx, values)`` says that
    ``sent`` is zero except at the unique int64 positions ``idx`` of the flattened tensor, where it holds
    the float32 ``values``; error feedback then updates only those positions, and the dense ``sent`` and
    ``mask`` are built from it only if someone asks.

    ``settled_dense`` is set by a method that decided within this exchange to send the tensor densely
    from now on (auto): error feedback then keeps no residual, as for a tensor sent densely, so that
    the next step can take the integration's plain dense path at once.
    """

    __slots__ = ("aggregate", "_sent", "_mask", "sparse", "sent_exactly", "sent_into", "subtract_sent", "support",
                 "support_values", "bound", "settled_dense")

    def __init__(self, aggregate: torch.Tensor, sent=None, mask=None, *, sparse: Optional[tuple] = None,
                 sent_into: Optional[Callable] = None, subtract_sent: Optional[Callable] = None,
                 support: Optional[torch.Tensor] = None, support_values: Optional[torch.Tensor] = None,
                 sent_exactly: bool = False, bound: Optional[torch.Tensor] = None):
        if sent is None and sparse is None:
            raise ValueError("Exchanged needs sent or sparse")
        self.aggregate = aggregate
        self._sent = sent
        self._mask = mask
        self.sparse = sparse
        #: True when ``sparse``'s values are the compressor's input at ``idx``, bit for bit (sent
        #: uncoded): error feedback then zeroes those positions (x - x is +0 for every finite x; a
        #: non-finite one makes the step non-finite, and nothing is kept) instead of subtracting.
        self.sent_exactly = sent_exactly
        #: Optional ``sent_into(out)``: writes ``sent`` into the float32 tensor ``out`` (of the aggregate's
        #: shape), so that error feedback can subtract it without a new full-size tensor.
        self.sent_into = sent_into
        #: Optional ``subtract_sent(p)``: writes ``p - sent`` into ``p``, the very tensor the method
        #: compressed (error feedback's own copy), and returns it; or returns None, leaving p as it was,
        #: where it cannot (feedback then subtracts ``sent``).
        self.subtract_sent = subtract_sent
        #: Optional int64 positions of the flattened aggregate (repeats allowed) outside which it is
        #: exactly zero, as a sparsifier's scatter leaves it: the finiteness check reads only those.
        self.support = support
        #: Optional float32 values the aggregate holds at ``support``, the very ones written there: the
        #: check reads these instead of gathering them again from scattered positions.
        self.support_values = support_values
        #: Optional 0-d tensor: a bound on every |aggregate| element in exact arithmetic, computed from the
        #: few numbers the aggregate is built from (PowerSGD's factors).  Where it is finite and below half
        #: the largest float32, the aggregate is finite, and the check reads the bound instead of it.
        self.bound = bound
        self.settled_dense = False

    @property
    def sent(self) -> torch.Tensor:
        if self._sent is None:
            idx, values = self.sparse
            flat = torch.zeros(self.aggregate.numel(), dtype=torch.float32, device=values.device)
            self._sent = flat.index_put_((idx,), values).view(self.aggregate.shape)
        elif callable(self._sent):
            self._sent = self._sent()
        return self._sent

    @property
    def mask(self) -> Optional[torch.Tensor]:
        if self._mask is None and self.sparse is not None:
            idx = self.sparse[0]
            flat = torch.zeros(self.aggregate.numel(), dtype=torch.bool, device=idx.device)
            self._mask = flat.index_fill_(0, idx, True).view(self.aggregate.shape)
        elif callable(self._mask):
            self._mask = self._mask()
        return self._mask

    @property
    def sent_pending(self) -> bool:
        """True while ``sent`` was given lazily and nobody has asked for it yet."""
        return callable(self._sent)

    def kept(self) -> Optional[int]:
        """Elements sent (sparsifiers), or None when every element is sent in some coded form."""
        if self.sparse is not None:
            return self.sparse[0].numel()
        mask = self.mask
        return None if mask is None else count_true(mask)

    def __repr__(self) -> str:
        return f"Exchanged(aggregate={self.aggregate!r}, sent={self.sent!r}, mask={self.mask!r})"


Exchange = Generator[Any, Any, Exchanged]


_WORKSPACE = threading.local()
#: Below this many elements the allocator's own reuse is as good as a workspace.
_WORKSPACE_MIN = 1 << 16
#: Prefix of the buffer names that :meth:`TensorContext.spare` lends for state values.
SPARE = "spare:"


def _stable_hash(text: str) -> int:
    return zlib.crc32(text.encode("utf-8"))


@dataclass(kw_only=True)
class StagedContext:
    """Where an exchange runs (step, epoch, rank, world size, seed) and its *staged* state: :meth:`get`
    reads the committed value unless this step already :meth:`set` one, and the owner commits
    ``updates`` only after the whole exchange succeeded on every rank."""

    step: int = 0
    #: The epoch given to ``GradzipState.set_epoch``, or None when the script never calls it (epoch-driven
    #: schedules then follow ``step``).
    epoch: Optional[int] = None
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    state: dict = field(default_factory=dict)
    updates: dict = field(default_factory=dict)
    #: The loss scale the gradients carry (``torch.amp.GradScaler``'s, a 0-d float32 tensor on their
    #: device, never read on the host), or None.  State in gradient units (error feedback's, a method's
    #: momentum or accumulator) is kept divided by it, so that it follows the scale as the scaler backs
    #: off and grows: read back with :func:`add_scaled` or :func:`times_scale`, staged after
    #: :func:`unscale_`.  State in other units (PowerSGD's basis, auto's choices) is not touched.
    scale: Optional[torch.Tensor] = None

    def get(self, name: str, default: Any = None) -> Any:
        return self.updates.get(name, self.state.get(name, default))

    def set(self, name: str, value: Any) -> None:
        self.updates[name] = value


@dataclass
class TensorContext(StagedContext):
    """Everything a compressor may know about the tensor it is compressing (state staged as in
    :class:`StagedContext`)."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    #: This tensor's buffers kept across steps by the owner (see :meth:`buffer`); None: no reuse.
    buffers: Optional[dict] = None
    #: The caller's output tensor, lent as the "aggregate" buffer (which then needs no copy out), or
    #: None.  The owner lends only memory that no other input of the exchange uses, and the feedback
    #: withdraws it when it overlaps the compressor's input.
    out: Optional[torch.Tensor] = None
    #: Set by the owner where error feedback checks its compensated input for NaN and Inf while
    #: computing it (:func:`gradzip.feedback.checks_input`) instead of the owner reading the gradient
    #: once more; feedback then sets ``input_nonfinite`` before the first collective.
    check_input: bool = False
    input_nonfinite: bool = False
    #: What :meth:`Compressor.read_while_written` computed as the input was written, or None.
    precomputed: Any = None

    def buffer(self, name: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised tensor for this exchange's own use (the aggregate, a decoded payload), the
        same memory every step: it may be returned in :class:`Exchanged` but never stored in the
        state, and it is written again at this tensor's next exchange.

        A fresh 5 MB CPU tensor is page-faulted in on first touch, which costs several times the
        arithmetic done on it, and a freed one often goes back to the OS; reusing memory avoids both.
        The owner keeps buffers only where it copies the results out before the next exchange (the
        integrations do); otherwise, and for small tensors and GPUs (whose caching allocator already
        reuses memory), this is ``torch.empty``.
        """
        shape = torch.Size(shape)
        out = self.out
        if name == "aggregate" and out is not None and out.numel() == shape.numel() and out.dtype == dtype \
                and out.device == torch.device(device):
            return out.view(shape)
        if self.buffers is None or not devices.reuses_buffers(device) or shape.numel() < _WORKSPACE_MIN:
            return torch.empty(shape, dtype=dtype, device=device)
        buf = self.buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.buffers[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def spare(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """Memory, shaped like ``like``, in which to build this step's new value of state ``name``
        (double buffering): the owner hands back the value that the commit retired, never the
        committed one, so the committed state stays intact until the exchange succeeded everywhere."""
        return self.buffer(SPARE + name, like.shape, like.dtype, like.device)

    def generator(self, device: torch.device, *, shared: bool = True, salt: str = "") -> torch.Generator:
        """A private RNG seeded from (seed, tensor key, step[, rank]); the global RNG is never touched.

        ``shared=True`` gives every rank the same stream (Random-k must pick the same positions
        everywhere).  ``shared=False`` mixes in the rank, so stochastic rounding noise is independent
        across workers and averages out instead of adding up.
        """
        parts = (self.seed, _stable_hash(self.key + "/" + salt), self.step, 0 if shared else self.rank + 1)
        seed = 0
        for part in parts:
            seed = (seed * 1_000_003 + part) % (2**63 - 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen


def add_scaled(x: torch.Tensor, state: torch.Tensor, scale: Optional[torch.Tensor],
               out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x + state * scale (``state`` kept unscaled, see :attr:`StagedContext.scale`), or x + state without
    a scale: one pass either way.  A power-of-two scale (GradScaler's) multiplies exactly."""
    return torch.add(x, state, out=out) if scale is None else torch.addcmul(x, state, scale, out=out)


def times_scale(factor: float, scale: Optional[torch.Tensor]):
    """The factor by which to multiply a state kept unscaled to use it as ``factor`` times it in the
    gradients' units: ``factor * scale`` (a 0-d tensor), or ``factor`` itself without a scale."""
    return factor if scale is None else scale * factor


def unscale_(state: Optional[torch.Tensor], scale: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``state`` (this exchange's own memory) divided in place by ``scale``, back to unscaled units to be
    staged; as it is without a scale (or a state)."""
    return state if scale is None or state is None else state.div_(scale)


def check_ratio(name: str, value: float, *, allow_zero: bool = True) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or not ((value >= 0 if allow_zero else value > 0) and value <= 1):
        allowed = "0 <= ratio <= 1" if allow_zero else "0 < ratio <= 1"
        raise ValueError(f"{name} must be a number with {allowed}, got {value!r}")
    return float(value)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def value_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """Parse a ``value_dtype=`` parameter (``None`` keeps the gradient's own dtype)."""
    if name is None:
        return None
    if isinstance(name, torch.dtype) and name in _DTYPES.values():
        return name
    if name not in _DTYPES:
        raise ValueError(f"value_dtype must be one of {sorted(_DTYPES)} or None, got {name!r}")
    return _DTYPES[name]


@functools.lru_cache(maxsize=None)
def saturation_limit(dtype: torch.dtype, summed: int = 1) -> Optional[float]:
    """The largest value of ``dtype`` of which ``summed`` add up in ``dtype``, in any order, without
    overflowing; None where ``dtype`` has float32's exponent range (float32 itself, bfloat16: only
    values in float32's last binade would round to Inf, where float32 sums overflow anyway).

    Each of the summed - 1 additions rounds by at most half an ulp of dtype's largest value, so
    values up to (largest - (summed - 1) * ulp / 2) / summed, rounded down to dtype, keep every partial
    sum finite (fp16: 65504 for one rank, 32736 for two)."""
    info = torch.finfo(dtype)
    if math.frexp(info.max)[1] >= math.frexp(torch.finfo(torch.float32).max)[1]:
        return None
    half_ulp = 2.0 ** (math.frexp(info.max)[1] - 2) * info.eps
    bound = (info.max - (summed - 1) * half_ulp) / summed
    ulp = 2.0 ** (math.frexp(bound)[1] - 1) * info.eps  # of dtype's values in bound's binade
    return math.floor(bound / ulp) * ulp


def wire_cast(x: torch.Tensor, dtype: torch.dtype, saturate: bool, summed: int = 1,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` (float32) rounded to the wire dtype ``dtype`` (into ``out``, when given).

    ``saturate`` (:attr:`Compressor.saturates`: a method with error feedback): a value beyond what
    ``dtype`` carries is sent as the largest one of its sign, :func:`saturation_limit` (fp16: 65504;
    ``summed``: how many ranks' values an allreduce adds in ``dtype``), and ``sent`` says so, so that
    error feedback keeps the excess and sends it later.  Otherwise it overflows to Inf, and the owner
    skips the step as non-finite (``GradScaler``'s contract).  Saturation turns Inf into a finite
    value: the owner must check such a method's input (``carries_nonfinite`` False).  One clamp."""
    limit = saturation_limit(dtype, summed) if saturate else None
    if limit is not None:
        x = torch.clamp(x, -limit, limit)
    return x.to(dtype) if out is None else out.copy_(x)


class Compressor:
    """Base class.  Subclasses set ``name`` and implement :meth:`exchange` (or use a helper base).

    ``default_feedback`` is the error-feedback scheme used when the caller passes ``feedback=None``.
    """

    name: ClassVar[str] = ""
    default_feedback: ClassVar[str] = "none"
    #: True when the exchange is deterministic (no random choice): used by tests and by resume checks.
    deterministic: ClassVar[bool] = True
    #: True when the method decides from wall-clock measurements (auto): two runs of the same inputs may
    #: then differ, so checks that compare two runs compare only what does not depend on the clock.
    measures_time: ClassVar[bool] = False
    #: True when every NaN and Inf of the input reaches the aggregate (dense casts and sums, or a scale
    #: computed from the whole input): the owner's check of the aggregate then finds it, and the owner
    #: skips its read of the input.
    carries_nonfinite: ClassVar[bool] = False
    #: True when :meth:`exchange` reads its input only before it takes its aggregate buffer
    #: (``ctx.buffer("aggregate", ...)``) and no payload field shares the input's memory.  Without error
    #: feedback, which would read the input after the exchange, the owner may then lend the input's own
    #: memory (DDP's bucket) as the aggregate buffer: the aggregate is built where it is wanted instead
    #: of being copied there.  False (the default) never lends it.
    done_with_input_early: ClassVar[bool] = False

    #: The error-feedback schemes this method accepts (``momentum`` needs momentum parameters).
    feedbacks: ClassVar[tuple] = ("none", "residual")
    #: Names of the method's own per-tensor state that holds gradient it owes (sends later), as error
    #: feedback's does: a withheld gradient keeps it (``GradzipState.exchange(withheld=...)``).
    owed_state: ClassVar[tuple] = ()

    def __init__(self, feedback: Optional[str] = None):
        feedback = feedback if feedback is not None else self.default_feedback
        if feedback not in self.feedbacks:
            raise ValueError(f"{self.name}: feedback must be one of {list(self.feedbacks)}, got {feedback!r}")
        self.feedback = feedback

    @property
    def saturates(self) -> bool:
        """Whether wire values beyond their dtype's range are sent saturated (:func:`wire_cast`): with
        error feedback, which keeps the excess; without, they overflow and the step is skipped."""
        return self.feedback != "none"

    @property
    def applies_momentum(self) -> bool:
        """Whether this method applies momentum itself (DGC's momentum correction, Signum): the
        optimizer must then add none of its own, and the integrations make that a checked error."""
        return self.feedback == "momentum"

    def feedback_params(self) -> dict:
        """Parameters of this method's error-feedback scheme (feedback.py builds the scheme object from
        ``feedback`` and these; DGC and CSC give their momentum correction's)."""
        return {}

    def compresses(self, ctx: TensorContext) -> bool:
        """Whether this tensor is compressed at all; if not it is averaged densely in fp32."""
        return True

    def read_while_written(self, ctx: TensorContext) -> Optional[Callable[[torch.Tensor, int, int], None]]:
        """Optional: where error feedback writes the compensated input a cached chunk at a time (large
        CPU tensors), a function it calls with (the flat input, start, stop) after writing each chunk
        [start, stop), for per-element work that would otherwise cost a pass over memory of its own
        (CSC's chunk norms).  It leaves its results in ``ctx.precomputed``, which the exchange then
        reads; None (the default), and on a non-finite input, leave ``ctx.precomputed`` None."""
        return None

    def allreduce_dtype(self, ctx: TensorContext) -> Optional[torch.dtype]:
        """The dtype in which one plain allreduce of x / N gives exactly what this method's exchange,
        error feedback included, gives for this tensor, leaving no feedback state behind (None: only
        :meth:`exchange` does).  Integrations may then use their framework's own C++ collective instead
        of gradzip's thread.  Not compressing is such a case: error feedback keeps nothing then."""
        return None if self.compresses(ctx) else ctx.dtype

    def exchange(self, x: torch.Tensor, ctx: TensorContext) -> Exchange:
        raise NotImplementedError

    def always_plain(self, dtype: torch.dtype, world_size: int) -> Optional[torch.dtype]:
        """The dtype of the one plain allreduce that every exchange of gradients of ``dtype`` is, whatever
        the step and the state (:meth:`allreduce_dtype` of every tensor, for ever); None (the default):
        it may depend on them.  An integration may then decide once per bucket."""
        return None

    #: True when the method implements :meth:`bucket_exchange`.
    bucketed: ClassVar[bool] = False
    #: The method's own state on the bucket route: names of float32 values with one element per
    #: gradient element (Signum's momentum), read with ``b.get(name)`` as one flat tensor (None before
    #: the first commit) and staged with ``b.set(name, flat)``; saved per tensor like any state.
    bucket_state: ClassVar[tuple] = ()

    def bucket_state_shapes(self, layout, step: int) -> dict:
        """The method's own state on the bucket route: per name, the shape of each tensor's value (None
        where it keeps none); ``b.get(name)`` is then the values of the tensors that have one, flat and
        end to end.  By default :attr:`bucket_state`, one value like each gradient."""
        return dict.fromkeys(self.bucket_state, layout.shapes)

    def takes_bucket(self, world_size: int) -> bool:
        """Whether :meth:`bucket_exchange` serves buckets exchanged among ``world_size`` ranks."""
        return self.bucketed

    #: True when :meth:`bucket_method` may name another method (auto, once it has chosen one).
    delegates_buckets: ClassVar[bool] = False

    def keeps_on_host(self, name: str) -> bool:
        """Whether per-tensor state ``name`` lives in host memory whatever the gradients' device (auto's
        measurements and schedule): a loaded state leaves it there, and moves the rest to the GPU."""
        return False

    def bucket_method(self, keys: Sequence[str], tensors: dict) -> Optional["Compressor"]:
        """The method whose :meth:`bucket_exchange` exchanges the bucket of these tensors (``tensors``: the
        state's per-tensor state by name), or None for the per-tensor route: the method itself where it
        implements one.  It must not read the device: it runs on every exchange."""
        return self if self.bucketed else None

    def bucket_exchange(self, p: torch.Tensor, b) -> Exchange:
        """The exchange of a whole bucket at once: ``p`` is the flat (error-compensated) input, ``b`` a
        :class:`~.bucket.BucketContext`.  Yields requests as :meth:`exchange` does and returns an
        :class:`Exchanged` whose ``aggregate`` and ``sent`` are flat; per-tensor semantics stay those of
        :meth:`exchange` applied to each tensor, up to the order of float sums.  Its number of tensor
        operations must not grow with the number of tensors, and it must not read the device from the
        host (no ``item``, ``nonzero``, ``tolist``): the bucket route runs without host syncs."""
        raise NotImplementedError

    def bucket_sent_whole(self, layout) -> Optional[torch.Tensor]:
        """On the bucket route, the positions (int64) of the elements of the tensors this method sends
        whole (uncompressed: DGC's vectors and small tensors), which error feedback keeps no state for;
        None (the default): every tensor is compressed."""
        return None

    def bucket_payload_bytes(self, layout) -> int:
        """The wire formula of :meth:`bucket_exchange`: bytes this worker hands to collectives."""
        raise NotImplementedError

    def observe_step(self, keys: Sequence[str], now: float) -> None:
        """Called by ``GradzipState`` when these tensors' exchange starts (``now``: ``time.perf_counter()``),
        whether the exchange runs through :meth:`exchange` or the integration sends them densely itself
        (then on the DDP hook's thread, while other tensors' exchanges may run on the communication
        thread).  A method that measures whole training steps (auto) clocks them here; the others ignore it."""

    def describe(self, tensors: dict) -> dict:
        """What the method decided during a run, for the run's summary (``tensors``: a state's per-tensor
        state by tensor name); nothing by default (auto reports its ``choices``)."""
        return {}

    def payload_bytes(self, ctx: TensorContext, kept: Optional[int] = None) -> int:
        """The method's wire formula: bytes this worker hands to collectives for one tensor.

        ``kept`` is the number of elements sent, for methods whose payload size depends on the data.
        """
        raise NotImplementedError

    def params(self) -> dict:
        """The constructor parameters, for logs and ``repr``."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"


class SummableCompressor(Compressor):
    """A method whose payloads can simply be added: one allreduce, then decode the sum.

    Subclasses implement ``compress(x, ctx) -> Tensor`` and ``decompress(payload, ctx) -> Tensor`` with
    ``decompress`` linear, so ``decompress(sum of payloads) / N`` is the mean of what workers sent.
    """

    def compress(self, x: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        raise NotImplementedError

    def decompress(self, payload: torch.Tensor, ctx: TensorContext) -> torch.Tensor:
        raise NotImplementedError

    def exchange(self, x, ctx):
        payload = self.compress(x, ctx)
        total = yield AllReduce(payload)
        # decompress returns a new tensor or a view of ``total``, which belongs to this exchange.
        aggregate = self.decompress(total, ctx).div_(ctx.world_size)
        return Exchanged(aggregate, lambda: self.decompress(payload, ctx))


class GatheredCompressor(Compressor):
    """A method whose payloads cannot be added: allgather every worker's fields, decode each, combine.

    Subclasses implement ``compress(x, ctx) -> tuple of 1-D tensors`` and
    ``decompress(fields, ctx) -> Tensor``; ``combine`` defaults to the mean.  Set ``same_size = False``
    when the payload size depends on the data (threshold methods).
    """

    same_size: ClassVar[bool] = True
    #: True when ``decompress(fields, ctx, out)`` can decode into a given float32 tensor (error
    #: feedback then subtracts this rank's decoded payload without a new full-size tensor).
    decodes_into: ClassVar[bool] = False

    def compress(self, x: torch.Tensor, ctx: TensorContext) -> tuple:
        raise NotImplementedError

    def decompress(self, fields: tuple, ctx: TensorContext) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, decoded: list, ctx: TensorContext) -> torch.Tensor:
        total = ctx.buffer("aggregate", decoded[0].shape, decoded[0].dtype, decoded[0].device).copy_(decoded[0])
        for part in decoded[1:]:
            total += part
        return total.div_(len(decoded))

    def mean_decoded_into(self, gathered: list, ctx: TensorContext, decode_into: Callable) -> torch.Tensor:
        """:meth:`combine`'s mean, each payload decoded in place by ``decode_into(fields, out)`` (``out``:
        n float32 elements, returned): the first into the aggregate, the others into one scratch buffer
        added in rank order, without a full-size tensor per rank."""
        n, device = ctx.shape.numel(), gathered[0][0].device
        total = decode_into(gathered[0], ctx.buffer("aggregate", (n,), torch.float32, device))
        for fields in gathered[1:]:
            total += decode_into(fields, workspace("decoded", n, torch.float32, device))
        return total.div_(len(gathered)).view(ctx.shape)

    def decoded_mean(self, gathered: list, ctx: TensorContext) -> Optional[torch.Tensor]:
        """Optional fast path: ``combine`` of the decoded payloads in one step, with the same result; None
        (the default) decodes each payload and combines them."""
        return None

    def aggregate_bound(self, gathered: list, ctx: TensorContext) -> Optional[torch.Tensor]:
        """Optional: :attr:`Exchanged.bound` from the gathered payloads (their scales); None (the default)."""
        return None

    def subtract_sent(self, fields: tuple, ctx: TensorContext) -> Optional[Callable]:
        """Optional fast path: :attr:`Exchanged.subtract_sent` for the input that ``fields`` encode, which
        computes p - D(fields) from p itself; None (the default): feedback decodes and subtracts."""
        return None

    def exchange(self, x, ctx):
        fields = self.compress(x, ctx)
        gathered = yield AllGather(tuple(fields), same_size=self.same_size)
        aggregate = self.decoded_mean(gathered, ctx)
        if aggregate is not None:  # this rank's own payload is decoded only if feedback asks for it
            into = (lambda out: self.decompress(fields, ctx, out)) if self.decodes_into else None
            return Exchanged(aggregate, lambda: self.decompress(fields, ctx), sent_into=into,
                             subtract_sent=self.subtract_sent(fields, ctx), bound=self.aggregate_bound(gathered, ctx))
        decoded = [self.decompress(f, ctx) for f in gathered]
        return Exchanged(self.combine(decoded, ctx), decoded[ctx.rank], bound=self.aggregate_bound(gathered, ctx))




def workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable 1-D scratch tensor (uninitialised) for a temporary that dies before the next ``yield``.

    On the CPU every fresh tensor of tens of megabytes is page-faulted in on first touch, which can cost
    several times the arithmetic done on it; so large temporaries reuse one buffer per thread, ``name``
    and dtype (grown as needed, kept for the life of the thread).  The result must never be returned,
    stored, or used after a ``yield``: generators of other tensors run there and reuse the buffer.
    GPUs get a plain ``torch.empty``: the caching allocator already reuses memory.
    """
    if not devices.reuses_buffers(device) or numel < _WORKSPACE_MIN:
        return torch.empty(numel, dtype=dtype, device=device)
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    buf = buffers.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def packed_codes(n: int, bits: int, device: torch.device, in_loop: Callable[[], Optional[torch.Tensor]],
                 as_bytes: Callable[[torch.Tensor], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """n codes packed ``bits`` each by an encoding kernel: ``in_loop()`` packs them in the loop that
    computes them (GPUs); on CPUs ``as_bytes(out)`` writes them a byte each into ``out`` and
    :func:`kernels.pack_bytes` packs those (see :func:`gradzip.devices.packs_from_bytes`).  None where the
    kernel did not run: the caller takes its reference path."""
    if not devices.packs_from_bytes(device):
        return in_loop()
    codes = workspace("code bytes", n, torch.uint8, device)
    return None if as_bytes(codes) is None else kernels.pack_bytes(codes, bits)


def chunked_sum(flat: torch.Tensor, fn: Callable, name: str) -> torch.Tensor:
    """The float32 sum of ``fn(chunk, out=...)`` (an elementwise op: ``torch.abs``, ``torch.square``)
    over the contiguous 1-D ``flat``, written a cached chunk at a time into a reused buffer and summed
    there, then the chunk sums added: 25M elements in 1.5 passes over memory, against 2 for the whole
    temporary written, then summed.  The chunks are those in which residual feedback writes and checks
    g + e (``kernels.CHECK_CHUNK``), so that a method may take the same sums from them as they are
    written (:meth:`Compressor.read_while_written`).  0-d for an empty ``flat``: 0."""
    n, size = flat.numel(), kernels.CHECK_CHUNK
    scratch = workspace(name, min(n, size), flat.dtype, flat.device)
    starts = range(0, n, size)
    sums = torch.empty(len(starts), dtype=torch.float32, device=flat.device)
    for i, start in enumerate(starts):
        chunk = fn(flat[start:start + size], out=scratch[:min(size, n - start)])
        torch.sum(chunk, 0, dtype=torch.float32, out=sums[i])
    return sums.sum()


_COMPARISONS = {"lt": (torch.lt, np.less), "le": (torch.le, np.less_equal), "gt": (torch.gt, np.greater),
                "ge": (torch.ge, np.greater_equal), "eq": (torch.eq, np.equal)}
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}


def compare(op: str, a: torch.Tensor, b, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``torch.<op>(a, b, out=out)`` into the bool tensor ``out``, for ``op`` in lt, le, gt, ge, eq
    (without ``out``, torch's own comparison into a new tensor).

    On CPUs numpy's comparison loops take a third to a half of the time of torch's, which write bools
    slowly (25M fp32 against a number: 6-7 ms against 16-18).  numpy does it where it gives torch's
    result exactly: contiguous CPU tensors of one of its dtypes, ``b`` a tensor of a's shape and dtype,
    or a number or 0-d tensor that torch would compare in a's dtype (so it is rounded to it first, as
    torch does), of at least 2^16 elements.  A comparison is exact and NaN compares false in both;
    elsewhere torch does it.
    """
    torch_op, numpy_op = _COMPARISONS[op]
    # Small tensors stay with torch: numpy's call costs more than it saves below some 30K elements.
    other = _numpy_operand(a, b) if out is not None and a.numel() >= _WORKSPACE_MIN and _numpy_able(a) \
        and _numpy_able(out) and out.dtype == torch.bool and out.shape == a.shape else None
    if other is None:
        return torch_op(a, b, out=out)
    numpy_op(a.detach().numpy(), other, out=out.detach().numpy())
    return out


def _numpy_able(t: torch.Tensor) -> bool:
    return type(t) is torch.Tensor and devices.host_memory(t) and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _numpy_operand(a: torch.Tensor, b):
    """b as numpy compares it with a, in a's dtype; None where that is not torch's comparison."""
    kind = _NUMPY_DTYPES.get(a.dtype)
    if kind is None:
        return None
    floating = a.dtype.is_floating_point
    if isinstance(b, torch.Tensor):
        if b.dim() == 0 and (b.dtype == a.dtype or (floating and b.dtype.is_floating_point)) and devices.host_memory(b):
            b = b.item()  # a 0-d tensor of a's kind is compared in a's dtype: as the number it holds
        elif b.shape == a.shape and b.dtype == a.dtype and _numpy_able(b):
            return b.detach().numpy()
        else:
            return None
    if isinstance(b, float):  # rounded to a's dtype, as torch does; NaN, or beyond its range: torch's path
        return kind(b) if floating and abs(b) <= float(np.finfo(kind).max) else None
    if isinstance(b, int) and not isinstance(b, bool):  # only where a's dtype holds it exactly
        return kind(b) if abs(b) <= (2**24 if floating else np.iinfo(kind).max) else None
    return None


def column_counts(mask: torch.Tensor) -> torch.Tensor:
    """``mask.sum(dim=0, dtype=torch.int32)`` for a 2-D bool tensor: numpy adds the rows as bytes into
    int32 counts, which torch does some fifteen times slower (5000 x 5000: 5 ms against 80)."""
    if mask.numel() >= _WORKSPACE_MIN and _numpy_able(mask):
        return torch.from_numpy(mask.detach().numpy().view(np.uint8).sum(axis=0, dtype=np.int32))
    return mask.sum(dim=0, dtype=torch.int32)


def count_true(mask: torch.Tensor) -> int:
    """``int(mask.sum())`` for a bool tensor, without widening every element to int64 first (25M on
    a CPU: 160 ms summed, 2.6 counted by numpy)."""
    if devices.host_memory(mask) and type(mask) is torch.Tensor:
        return int(np.count_nonzero(mask.detach().numpy()))
    return int(torch.count_nonzero(mask))


def zeroed(t: torch.Tensor) -> torch.Tensor:
    """``t.zero_()``, by ``memset`` for large contiguous CPU tensors: glibc streams a buffer larger than
    the cache past it, which takes a third to a half of the time of torch's fill loop (25M fp32: 2.6 to
    3.7 ms against 7.7), and sets the same all-zero bits."""
    if devices.host_memory(t) and t.numel() >= _WORKSPACE_MIN and t.is_contiguous() and type(t) is torch.Tensor:
        ctypes.memset(t.data_ptr(), 0, t.numel() * t.element_size())
        return t
    return t.zero_()
