"""Fused kernels: a compressor's per-element work compiled into one or two loops by ``torch.compile``.

The compressors' reference paths chain tensor operations, each a pass over memory; Inductor fuses a
whole chain into one vectorised C++/OpenMP loop on CPUs (Triton on GPUs).  A compressor writes the chain
once as a plain function of tensors, wraps it with :func:`fused`, and calls it only where
:func:`enabled` says so; the reference path stays the definition, and the fused one is tested against it
bit for bit (random draws come in as tensors, from the same private generators).

- Compiling costs seconds, once per kernel and process (about 5 s for the first kernel of a process on
  a 2-core CPU, Inductor's disk cache warm; every tensor dimension is compiled symbolic, so one compile
  serves every size).  So a kernel runs only on tensors large enough that its saving repays that within
  a few hundred steps: ``min_numel`` elements (:data:`MIN_NUMEL`, or :data:`LARGE_NUMEL` for kernels
  that save little per element, such as sign packing); smaller tensors keep the reference path.
- The bucket route cannot wait seconds in a user's step, so it takes its kernels compiled ahead
  (:meth:`Kernel.ahead`, :mod:`gradzip.ahead`): once per machine, in a process of their own, loaded
  when ready; until then the reference path runs.  Those run on buckets of every size (``ahead_numel``).  They are compiled with eager numerics, so a kernel
  and its reference path agree bit for bit and it does not matter at which step each rank switches.
- ``GRADZIP_FUSED=0`` in the environment forces the reference path.
- If compiling or running a kernel fails (no C++ compiler, an Inductor error), gradzip warns once with
  the cause and uses the reference path for the rest of the process.

This module sits beside :mod:`gradzip.bits`: it imports only torch, :mod:`gradzip.ahead` and
:mod:`gradzip.devices`.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import types
import warnings
from typing import Callable, Optional

import torch
from torch.utils import _python_dispatch

from . import ahead, devices

__all__ = ["MIN_NUMEL", "LARGE_NUMEL", "UNROLL_RANKS", "KERNELS", "Kernel", "fused", "enabled", "enabled_over_ranks",
           "settle",
           "pack_codes", "unpack_codes", "pack_bytes",
           "repeat_each", "counter_uniforms", "counter_hashes", "lowbias32_", "uniforms_from"]

#: The smallest tensor (elements) that takes a fused path: QSGD saves about 35 passes over 2^20
#: elements, some 15 ms a step here, which repays a 5 s compile in a few hundred steps.
MIN_NUMEL = 1 << 20
#: The same for kernels that save about one pass (sign packing, Signum's momentum).
LARGE_NUMEL = 1 << 24
#: Kernels that sum over ranks unroll the sum (a compile per world size) up to this many ranks; more
#: ranks keep the reference path.
UNROLL_RANKS = 16
#: Every kernel made by :func:`fused` (tests lower their thresholds to run them on small tensors).
KERNELS: list = []

_failure: Optional[str] = None  # why fused kernels are off for this process, once they failed


def any_nonfinite(tensors) -> bool:
    """Whether any element is NaN or Inf, in one read of each tensor and one host sync for all of them.

    min and max propagate NaN, and an Inf is the min or the max, so both ends are finite exactly when
    every element is (``isfinite(g).all()`` writes a mask of n bytes and reads it again).
    """
    ends = [end.float() for t in tensors if t.numel() for end in torch.aminmax(t.detach())]
    return bool(ends) and not bool(torch.isfinite(torch.stack(ends)).all())


#: Chunk of :func:`written_finite`: read back while it is still in the cache.
CHECK_CHUNK = 1 << 18


def written_finite(out: torch.Tensor, write: Callable[[int, int], object]) -> bool:
    """Run ``write(start, stop)``, which writes ``out``'s flat elements [start, stop), chunk by chunk,
    and say whether every element of the contiguous float32 ``out`` is finite, without a second pass
    over memory: each chunk's sum is taken while the chunk is in the cache.  A float sum is finite
    only if every addend is (NaN and Inf propagate), so only a sum that overflowed has its chunk's
    elements checked one by one.  25M elements: the write and the check take about 0.3 pass more than
    the write alone, against 0.8 for a separate ``aminmax``."""
    flat = out.view(-1)
    starts = range(0, flat.numel(), CHECK_CHUNK)
    sums = torch.empty(len(starts), dtype=torch.float32)
    for i, start in enumerate(starts):
        stop = min(start + CHECK_CHUNK, flat.numel())
        write(start, stop)
        torch.sum(flat[start:stop], 0, out=sums[i])
    if bool(torch.isfinite(sums.sum())):
        return True
    return not any_nonfinite([flat[start:start + CHECK_CHUNK] for start, total in zip(starts, sums)
                              if not torch.isfinite(total)])


def enabled(numel: int) -> bool:
    """Whether a tensor of ``numel`` elements should take the fused path."""
    return (numel >= MIN_NUMEL and _failure is None and os.environ.get("GRADZIP_FUSED", "1") != "0"
            and not getattr(_THREAD, "suspended", False))


_THREAD = threading.local()


def suspended():
    """No fused kernel runs on this thread within the block: the reference paths do the work.  The
    bucket route takes them, since a kernel's first compile (seconds) would land in a user's first
    step on every new bucket size."""
    return _flagged("suspended")


def compiled_only():
    """Within the block, on this thread, a fused kernel runs only where this process has compiled it
    already for its constants: none is compiled for the first time (the reference paths do the work).
    (One compiled already may still recompile, for another dtype: its sizes are symbolic.)"""
    return _flagged("compiled_only")


@contextlib.contextmanager
def _flagged(name: str):
    """The thread-local flag ``name`` set within the block (and as it was after it)."""
    before = getattr(_THREAD, name, False)
    setattr(_THREAD, name, True)
    try:
        yield
    finally:
        setattr(_THREAD, name, before)


def enabled_over_ranks(numel: int, world: int) -> bool:
    """Whether a kernel summing ``world`` ranks' payloads of ``numel`` elements should run (its sum is
    unrolled, so only up to :data:`UNROLL_RANKS` ranks)."""
    return world <= UNROLL_RANKS and enabled(numel)


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def _disable(exc: BaseException) -> None:
    global _failure
    _failure = _reason(exc)[:200]
    warnings.warn(f"gradzip: fused kernels are off for this process, using the reference path ({_failure})",
                  RuntimeWarning, stacklevel=3)


class Kernel:
    """A per-element function, compiled (``torch.compile(fullgraph=True)``) on first call.

    ``kernel(*args, **static)``: every dimension of the tensors in ``args`` is marked dynamic, so one
    compile serves every tensor size (integers in ``args`` turn symbolic the first time they change:
    one recompile).  Keyword arguments are compiled in as constants (one compile per value), which keeps
    index arithmetic such as ``i // bucket_size`` and bit shifts vectorisable; ``dynamic=True`` would
    make them symbolic too, and the loops scalar.  Returns the result, or None for tensors under
    ``min_numel`` or once fused kernels have failed in this process: the caller then takes its
    reference path.  ``ordered``: its results are its eager code's bit for bit; a kernel that sums into
    shared slots (a scatter: atomic adds, in no fixed order) is not, and its compiled package is checked
    against the eager code at float tolerance instead.  ``nonnegative``: the names of float arguments
    never negative (draws in [0, 1), sizes), which the kernel may make indices of: its package's checks
    draw them so, as they keep integer arguments 0 (kept as their positions, as the checks take the
    arguments).
    """

    def __init__(self, fn: Callable, min_numel: int = MIN_NUMEL, ordered: bool = True, nonnegative: tuple = ()):
        self.fn = fn
        self.min_numel = min_numel
        self.ordered = ordered
        self.__name__ = getattr(fn, "__name__", "kernel")
        positional = [name for name, p in inspect.signature(fn).parameters.items()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not set(nonnegative) <= set(positional):
            raise ValueError(f"{self.__name__}: nonnegative names {sorted(set(nonnegative) - set(positional))}, "
                             f"not among its tensor arguments before any *args {positional}")
        self.nonnegative = tuple(i for i, name in enumerate(positional) if name in nonnegative)
        self._compiled: dict = {}
        self._ahead: dict = {}  # (constants, form) -> its ahead.Package, or _PENDING while queued
        self.failed_ahead: Optional[str] = None  # why this kernel's compile ahead failed
        #: The least elements (of its largest argument) on which :meth:`ahead` runs the kernel: one
        #: package serves every size and its compile is paid once per machine, not in a step, so no
        #: bucket is too small for it (a launch or two where the reference path takes dozens).
        self.ahead_numel = 1
        KERNELS.append(self)

    def __call__(self, *args, **static):
        if max(a.numel() for a in args if isinstance(a, torch.Tensor)) < self.min_numel:
            return None
        return self.run(*args, **static)

    def run(self, *args, **static):
        """The kernel without the size check, for a caller that applies it piecewise to one tensor and
        checked that tensor's size against ``min_numel`` itself; None once fused kernels have failed."""
        if _failure is not None or getattr(_THREAD, "suspended", False):
            return None
        key = tuple(sorted(static.items()))
        if key not in self._compiled and getattr(_THREAD, "compiled_only", False):
            return None
        try:
            if key not in self._compiled:
                self._compiled[key] = torch.compile(_specialise(self.fn, static), fullgraph=True)
            for arg in args:  # every size symbolic from the first compile
                if isinstance(arg, torch.Tensor):
                    for dim in range(arg.dim()):
                        torch._dynamo.maybe_mark_dynamic(arg, dim)
            return self._compiled[key](*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure means: use the reference path
            _disable(exc)
            return None

    def wanted(self, numel: int, where) -> bool:
        """Whether :meth:`ahead` would take (or queue) the kernel for a largest argument of ``numel``
        elements on ``where`` (a tensor or device): its device runs kernels compiled ahead
        (:func:`gradzip.devices.runs_kernels_ahead`), at least ``ahead_numel`` elements (one: every
        bucket that is not empty), neither kernels nor this kernel's compile ahead failed, and kernels
        not switched off.  A caller asks before making what only the kernel would take (a seed)."""
        return (numel >= self.ahead_numel and devices.runs_kernels_ahead(where) and _failure is None
                and self.failed_ahead is None and os.environ.get("GRADZIP_FUSED", "1") != "0")

    def ahead(self, *args, **static):
        """The kernel's result where it has been compiled ahead (:mod:`gradzip.ahead`) for the form of
        ``args`` (contiguous tensors: their dtypes, kind of device and which dimensions are 0, 1 or
        equal); else None, the caller taking its reference path, and the first such call queues the
        package's loading (or compiling, in a child process) on a background thread.  No compile lands
        in the caller's step or process.  None too under ``ahead_numel``, where the device's form says
        kernels compiled ahead do not pay (:func:`gradzip.devices.runs_kernels_ahead`), and once this
        kernel's compile failed."""
        if not self.wanted(max(a.numel() for a in args if isinstance(a, torch.Tensor)), args[0]):
            return None
        modes = _python_dispatch._get_current_dispatch_mode_stack()
        if not all(getattr(mode, "sees_fused_kernels", False) for mode in modes):
            return None  # a dispatch mode of the caller's would see none of the kernel's work: its reference path
        shapes = ahead.form(args)
        if shapes is None:
            return None
        key = (tuple(sorted(static.items())), shapes, args[0].device)  # a package is loaded for one device
        with _AHEAD_LOCK:
            package = self._ahead.get(key)
            if package is None:
                self._ahead[key] = _PENDING
                ahead.submit(functools.partial(self._load_ahead, key, static, shapes, args[0].device,
                                               [tuple(a.shape) for a in args]))
        if package is None or package is _PENDING or not package.fits(args):
            return None
        try:
            if not modes:
                return package(*args)
            with _python_dispatch._disable_current_modes():  # a compiled kernel shows a mode no operation
                result = package(*args)
        except Exception as exc:  # noqa: BLE001 - as in run: the reference path from now on
            self._ahead_failed(exc)
            return None
        if result is None:  # unloaded as the process exits
            return None
        for mode in modes:  # a counter that knows kernels (gradzip.testing's) is told of this one
            mode.saw_fused_kernel(self.__name__, result)
        return result

    def _load_ahead(self, key, static, shapes, device, sizes) -> None:
        """A background thread's job: load (or compile, then load) the package for ``key``."""
        try:
            package = ahead.load(self.fn, static, shapes, _ahead_options(device), device, sizes)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: this kernel's reference path for good
            if not ahead.exiting():
                self._ahead_failed(exc)
            return
        with _AHEAD_LOCK:
            self._ahead[key] = package

    def _ahead_failed(self, exc: BaseException) -> None:
        """This kernel takes its reference path from now on; the first such failure in the process warns."""
        global _AHEAD_WARNED
        self.failed_ahead = _reason(exc)
        if not _AHEAD_WARNED:
            _AHEAD_WARNED = True
            warnings.warn(f"gradzip: a fused kernel compiled ahead is off for this process, using its reference "
                          f"path ({self.__name__}: {self.failed_ahead})", RuntimeWarning, stacklevel=2)


_PENDING = object()
_AHEAD_LOCK = threading.Lock()
_AHEAD_WARNED = False


def _forked() -> None:
    """In a forked copy: a fresh lock (the parent's may have been held), and no kernel waiting for a job
    that only the parent's threads would have run."""
    global _AHEAD_LOCK
    _AHEAD_LOCK = threading.Lock()
    for kernel in KERNELS:
        kernel._ahead = {key: package for key, package in kernel._ahead.items() if package is not _PENDING}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def settle(timeout: Optional[float] = None) -> bool:
    """Wait until every kernel queued by :meth:`Kernel.ahead` is loaded (or compiled, or failed), at most
    ``timeout`` seconds; whether they are: tests; benchmarks, before their timed steps."""
    return ahead.settle(timeout)


def _eager_numerics() -> dict:
    """Inductor options under which a kernel rounds as eager PyTorch does: multiply-adds not contracted,
    division correctly rounded, denormals kept, PyTorch's libdevice; those this torch knows."""
    from torch._inductor import config
    wanted = {"emulate_precision_casts": True, "eager_numerics.division_rounding": True,
              "eager_numerics.disable_ftz": True, "eager_numerics.use_pytorch_libdevice": True,
              # a C++ compiler's defaults, pinned against the environment variables that change them
              "cpp.enable_floating_point_contract_flag": "off", "cpp.enable_unsafe_math_opt_flag": False}
    known = {}
    for name, value in wanted.items():
        owner, *rest = name.split(".")
        if hasattr(config, owner) and (not rest or hasattr(getattr(config, owner), rest[0])):
            known[name] = value
    return known


def _ahead_options(device) -> dict:
    """A package's options: eager rounding, and its wrapper and loops less optimised where nothing times
    them (:func:`gradzip.devices.optimises_ahead`; the loops' level is gradzip's own option)."""
    from torch._inductor import config
    options = _eager_numerics()
    if not devices.optimises_ahead(device):
        if hasattr(config.aot_inductor, "compile_wrapper_opt_level"):
            options["aot_inductor.compile_wrapper_opt_level"] = "O0"
        options[ahead.LOOPS_LEVEL] = "O1"
    return options


def _specialise(fn: Callable, static: dict) -> Callable:
    """``fn`` with ``static`` bound (read from a closure, so compiled in as constants), under a code
    object of its own: torch.compile keeps its caches and recompile limit per code object."""
    def specialised(*args):
        return fn(*args, **static)

    suffix = "_".join(f"{k}{v}" for k, v in sorted(static.items()))
    code = specialised.__code__.replace(co_name=f"{getattr(fn, '__name__', 'kernel')}_{suffix}")
    return types.FunctionType(code, specialised.__globals__, code.co_name, None, specialised.__closure__)


def fused(fn: Optional[Callable] = None, *, min_numel: int = MIN_NUMEL, ordered: bool = True,
          nonnegative: tuple = ()):
    """Decorator, bare or with keywords: ``fn``'s tensor operations become one compiled kernel (see
    :class:`Kernel`), run on tensors of at least ``min_numel`` elements."""
    if fn is None:
        return lambda f: Kernel(f, min_numel, ordered, nonnegative)
    return Kernel(fn, min_numel, ordered, nonnegative)


# -- bit packing inside a kernel: the layout of gradzip.bits.pack_bits, for 8 % bits == 0 ---------------


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (1-D, each < 2**bits, ``8 % bits == 0``) packed little-endian into uint8, as ``pack_bits``.

    The whole bytes and the zero-padded last byte are packed apart: padding the whole input would put a
    bounds check on every load, which Inductor does not vectorise.
    """
    per_byte = 8 // bits
    n = codes.shape[0]
    whole = n // per_byte * per_byte
    codes = codes.to(torch.int32)  # 8-bit lanes vectorise poorly: uint8 only for the result
    tail = torch.nn.functional.pad(codes[whole:], (0, (per_byte - n % per_byte) % per_byte))
    packed = torch.cat([_or_codes(codes[:whole].view(-1, per_byte), bits), _or_codes(tail.view(-1, per_byte), bits)])
    return packed.to(torch.uint8)


def _or_codes(grouped: torch.Tensor, bits: int) -> torch.Tensor:
    packed = grouped[:, 0]
    for j in range(1, grouped.shape[1]):
        packed = packed | (grouped[:, j] << (j * bits))
    return packed


def _words_packed(words: torch.Tensor, bits: int) -> torch.Tensor:
    # Codes stored one per byte, read 8 // bits at a time as one little-endian integer: code j sits at
    # bit 8 j and moves to bit j * bits.  Codes are below 2**bits, so no word is negative.
    per_byte = 8 // bits
    w = words.to(torch.int64 if per_byte == 8 else torch.int32)
    mask = (1 << bits) - 1
    packed = w & mask
    for j in range(1, per_byte):
        packed = packed | ((w >> (j * (8 - bits))) & (mask << (j * bits)))
    return packed.to(torch.uint8)


_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@fused(min_numel=LARGE_NUMEL)
def _pack_words(words, out, bits: int):
    return out.copy_(_words_packed(words, bits))


def pack_bytes(codes: torch.Tensor, bits: int) -> Optional[torch.Tensor]:
    """:func:`pack_codes` of the contiguous uint8 ``codes`` (one code per byte, ``8 % bits == 0``): the
    whole bytes by a kernel whose every operation is on whole words, the last, partly filled byte by
    :func:`pack_codes` itself.  None once fused kernels have failed.  ``codes`` must start at a
    multiple of 8 bytes in its storage (a fresh or :func:`workspace`-like buffer)."""
    per_byte = 8 // bits
    n = codes.numel()
    whole = n // per_byte
    out = torch.empty(-(-n // per_byte), dtype=torch.uint8, device=codes.device)
    if whole and _pack_words.run(codes[: whole * per_byte].view(_WORDS[per_byte]), out[:whole], bits=bits) is None:
        return None
    if n > whole * per_byte:
        out[whole:] = pack_codes(codes[whole * per_byte:].to(torch.int32), bits)
    return out


def repeat_each(values: torch.Tensor, times: int, n: int) -> torch.Tensor:
    """``values.repeat_interleave(times)[:n]`` as a broadcast view (no copy, no bounds checks)."""
    return values.unsqueeze(1).expand(-1, times).reshape(-1)[:n]


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: the first ``n`` codes of each row of ``packed``, int32.

    A broadcast shift rather than a stack of planes, so that the codes are never materialised.
    """
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n]


# -- random draws inside a kernel -------------------------------------------------------------------------


def counter_uniforms(like: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
    """``like.shape[0]`` uniform draws in [0, 1) on the 2^-24 grid: u_i = the top 24 bits of
    lowbias32(i xor seed) (C. Wellons' "hash prospector" integer hash), for a 0-d int32 ``seed``.

    A counter-based generator: each draw is a function of its index and the seed alone, so a fused
    kernel makes its draws in registers instead of reading a buffer that ``torch.rand`` wrote (some
    eight passes over memory for 25M fp32 draws on a CPU).  The same code runs eagerly, slowly, to test
    kernels against their reference paths.
    """
    x = counter_hashes(like, seed)
    x.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF)
    if torch.compiler.is_compiling():  # a fused kernel keeps x in registers: nothing to save
        return x.to(torch.float32).mul_(2.0**-24)
    # Eagerly, converted into x's own memory (each element read and written at its own address, 4 bytes
    # either way), so that drawing for a whole bucket peaks at two int32 copies, not three.
    return x.view(torch.float32).copy_(x).mul_(2.0**-24)


def counter_hashes(like: torch.Tensor, seed) -> torch.Tensor:
    """lowbias32(i xor seed) for i < ``like.shape[0]``, int32: distinct for distinct i (both steps are
    bijections of 32-bit words), so as keys to rank they never tie."""
    # In place where it can be: eagerly, one int32 buffer and one temporary instead of a new one per step.
    return lowbias32_(torch.arange(like.shape[0], dtype=torch.int32, device=like.device).bitwise_xor_(seed))


def lowbias32_(x: torch.Tensor, scratch: torch.Tensor = None) -> torch.Tensor:
    """C. Wellons' lowbias32 integer hash of the int32 ``x``, in place (returns ``x``); ``scratch``, an
    int32 tensor of x's shape, takes the shifted copies (default: one temporary).  int32 products wrap
    modulo 2^32 (two's complement) and the right shifts are masked, so this is the unsigned hash."""
    halves = _halves(x)
    scratch = torch.empty_like(x) if scratch is None else scratch
    for shift, mask, factor in ((16, 0xFFFF, 0x7FEB352D), (15, 0x1FFFF, -0x7B935975), (16, 0xFFFF, None)):
        if shift == 16 and halves is not None:
            # x ^= x >>> 16 changes only the low half of each word: its low int16 xor its high one, one
            # in-place operation where the shift, mask and xor take three (and a scratch)
            halves[0].bitwise_xor_(halves[1])
        else:
            x.bitwise_xor_(torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_(mask))
        if factor is not None:
            x.mul_(factor)  # -0x7B935975 is 0x846CA68B as a signed 32-bit integer: the same product mod 2^32
    return x


def _halves(x: torch.Tensor):
    """(low, high) int16 halves of each int32 word of ``x`` as views, where memory order allows
    (contiguous words, a little-endian machine, an eager run): else None."""
    if sys.byteorder != "little" or not x.is_contiguous() or torch.compiler.is_compiling():
        return None
    words = x.view(-1).view(torch.int16)
    return words[0::2], words[1::2]


@fused(min_numel=1)
def _counter_uniforms(like, seed):
    """:func:`counter_uniforms` in one kernel (``like``: any int32 tensor of the draws' length, unread),
    where eagerly it launches a dozen, each a pass over the draws."""
    return counter_uniforms(like, seed)


@fused(min_numel=1)
def _counter_hashes(like, seed):
    """:func:`counter_hashes` in one kernel, as :func:`_counter_uniforms`."""
    return counter_hashes(like, seed)


def uniforms_from(like: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """A kernel's uniforms: :func:`counter_uniforms` of ``draws`` when it is a 0-d seed, else ``draws``
    itself (uniforms already drawn, one per element; torch.compile specialises on which)."""
    return counter_uniforms(like, draws) if draws.dim() == 0 else draws
