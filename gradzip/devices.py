"""The one seam between the CPU and the GPU paths.

Every method runs the same tensor code on every device.  Where a CPU has a faster form of an operation
(measured there: the numbers are in each predicate's docstring), or a GPU needs what a CPU does not
(streams, events, pinned memory), the code asks one of these predicates, each named for its reason,
instead of testing ``device.type`` itself; ``tests/test_devices.py`` keeps such tests out of the rest of
the library.  A test flips a predicate (monkeypatch) to run a GPU path on a CPU.

Each takes a tensor or a device.  This module sits beside :mod:`gradzip.bits`: it imports only torch.
"""
from __future__ import annotations

import contextlib
import platform
from typing import Sequence, Union

import torch

__all__ = ["cuda", "runs_kernels_ahead", "optimises_ahead", "host_memory", "reuses_buffers", "prefilters_selection", "draws_in_kernel", "decodes_by_table",
           "packs_from_bytes", "sorts_subset_draws", "looks_up_rows_at_once", "selects_by_bits", "reads_freely", "outer_by_products", "fuses_momentum"]

Where = Union[torch.Tensor, torch.device, str]


def _device(where: Where) -> torch.device:
    return where.device if isinstance(where, torch.Tensor) else torch.device(where)


def _type(where: Where) -> str:
    return _device(where).type


def cuda(where: Where) -> bool:
    """On a CUDA device: exchanges there run on a side stream ordered by events, a flag the host reads
    later goes through pinned memory, the bucket route is the default, and NCCL's device is the state's."""
    return _type(where) == "cuda"


def current_for(where: Where):
    """A context in which ``where``'s GPU is the current one (elsewhere: nothing).  AOTInductor's runner
    launches on the current stream of the current GPU, whatever its tensors' device: a thread whose
    current GPU is another (gradzip's own starts on GPU 0) would launch there."""
    return torch.cuda.device(_device(where)) if cuda(where) else contextlib.nullcontext()


def read_here(tensors: Sequence[torch.Tensor]) -> None:
    """Tell the caching allocator that the current stream reads these GPU tensors, which another stream
    made: freed, their memory then waits for this stream's work queued so far instead of going back to
    the other stream at once, where it could be written before this one has read it (CPU: nothing)."""
    for t in tensors:
        if cuda(t):
            t.record_stream(torch.cuda.current_stream(t.device))


def compile_target(where: Where) -> str:
    """What a kernel compiled ahead is compiled for (part of its cached file's name): the CPU's
    architecture and vector instruction set, or the GPU's compute capability and CUDA version."""
    if _type(where) == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(where))
        return f"cuda-sm{major}{minor}-{torch.version.cuda}"
    from torch._inductor import cpu_vec_isa  # the vector instructions its loops use: another CPU may lack them
    return f"{_type(where)}-{platform.machine()}-{cpu_vec_isa.pick_vec_isa()}"


def runs_kernels_ahead(where: Where) -> bool:
    """Whether the bucket route runs kernels compiled ahead (:mod:`gradzip.ahead`): on a GPU a package's
    runner only launches its kernels; on a CPU it runs their loops holding Python's lock (98 ms for 2^25
    elements), which would stall the training thread's Python while gradzip's thread exchanges, where
    eager operations release it (the CPU default is the per-tensor route, with kernels of its own)."""
    return _type(where) == "cuda"


def optimises_ahead(where: Where) -> bool:
    """Whether a package compiled ahead is optimised for speed (its wrapper, the host code that allocates
    and launches, and its loops at Inductor's -O3): on a GPU, whose steps the host's cost bounds, yes; on a
    CPU, whose exchanges never take these packages (only tests and checks build them), no: its wrapper
    compiles at -O0 and its loops at -O1, which g++ compiles in a fifth of -O3's time (2.4 s against 11.3 s
    for QSGD's encoding here; the wrapper's 8 s is the floor)."""
    return _type(where) == "cuda"


def host_memory(where: Where) -> bool:
    """In host memory, where numpy and ctypes address a plain tensor's data directly: bits packed by
    numpy's ``packbits`` (tens of times faster than shifting and summing bytes with tensor operations),
    positions by ``flatnonzero`` (four to six times ``nonzero``'s speed), counts by ``count_nonzero``,
    zeros by ``memset``, comparisons by numpy's loops."""
    return _type(where) == "cpu"


def reuses_buffers(where: Where) -> bool:
    """Whether large temporaries reuse buffers kept from step to step: on a CPU every fresh tensor of
    tens of megabytes is page-faulted in on first touch, which can cost several times the arithmetic
    done on it; a GPU's caching allocator already reuses memory."""
    return _type(where) == "cpu"


def prefilters_selection(where: Where) -> bool:
    """Whether top-k and threshold selections first narrow the candidates by a strided sample: on a CPU
    a comparison and a ``nonzero`` over all n elements write a byte each and are slow; on a GPU one pass
    is cheap, and the prefilter's reads of counts would wait for the device."""
    return _type(where) == "cpu"


def draws_in_kernel(where: Where) -> bool:
    """Whether a fused kernel makes its uniforms itself, from a seed (a counter-based hash in its loop):
    on a CPU writing them with ``torch.rand`` first costs some eight passes over memory; on a GPU
    ``torch.rand`` is cheap and the kernels take its draws, as the reference paths do."""
    return _type(where) == "cpu"


def decodes_by_table(where: Where) -> bool:
    """Whether packed codes of 1, 2, 4 or 8 bits are decoded by a table lookup per byte, eagerly: on a
    CPU Inductor's loop that unpacks codes stays scalar and took three times as long (113 ms for QSGD's
    25M codes against 42), so a decoding kernel pays only on the largest tensors; on a GPU the fused
    kernels decode."""
    return _type(where) == "cpu"


def packs_from_bytes(where: Where) -> bool:
    """Whether encoders write their codes a byte each and pack them afterwards (CPUs), rather than pack
    them in the loop that computes them (GPUs): a packing loop reads each output byte's codes at a
    stride, which a CPU's vector loop does with scalar loads (25M 2-bit QSGD codes: 34 ms packed in
    their loop, against 9 written as bytes plus 1 to pack those)."""
    return _type(where) == "cpu"


def sorts_subset_draws(where: Where) -> bool:
    """Whether a large, sparse random subset of positions is drawn as a few more than k sorted draws
    rather than ``randperm(n)[:k]``, which costs O(n) on a CPU (over a second for 25M elements to keep
    1%); a GPU's ``randperm`` is fast."""
    return _type(where) == "cpu"


def looks_up_rows_at_once(where: Where) -> bool:
    """Whether a lookup of several table rows for the same indices (the five base-3 digits of each
    packed byte) is one ``index_select`` along the table's columns (a GPU: one launch) rather than one
    per row: on a CPU the former ran about four times slower (1M trits decoded in 2.5 ms against 0.6)."""
    return _type(where) != "cpu"


def selects_by_bits(where: Where) -> bool:
    """Whether an elementwise choice between two float32 tensors is made with integer masks instead of
    ``torch.where``, which on a CPU runs a scalar loop about ten times slower than a pass over memory."""
    return _type(where) == "cpu"


def reads_freely(where: Where) -> bool:
    """Whether reading a value on the host costs no wait for a device: a CPU's exchange may check an
    output as it copies it, or read a method's bound on the aggregate; on a GPU such a read would stall
    the host until the device caught up, so the check stays on the device."""
    return _type(where) == "cpu"


def outer_by_products(where: Where) -> bool:
    """Whether a rank-r outer product P Rt is written as r broadcast products (or a fused pass): on a
    CPU a BLAS product of inner dimension 2 writes its n x m result about 2x slower; a GPU's matmul is
    the fast path."""
    return _type(where) == "cpu"


def fuses_momentum(where: Where) -> bool:
    """Whether momentum correction's two updates run as one fused kernel: on a CPU its loop rounds each
    operation as the reference path does; GPU compilers contract a multiply and an add into one
    rounding, which would change the bits."""
    return _type(where) == "cpu"
