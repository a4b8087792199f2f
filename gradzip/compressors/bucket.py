"""The bucket: many tensors' gradients in one flat buffer, and its layout — the unit a method computes on.

A method that implements :meth:`Compressor.bucket_exchange` computes on the whole flat buffer with a
number of tensor operations that does not grow with the number of tensors in it: elementwise work runs
on the flat buffer, per-tensor quantities (a scale, a norm, k) come from segmented reductions
(:meth:`BucketLayout.segment_sum`) and go back to the elements by one gather (``per_element``), and
per-tensor selections run once per *size class* (all tensors of one size stacked as rows).  Its result
for a bucket equals its per-tensor exchange applied to each tensor, up to the order of float sums.

A GPU pays 5-7 us of host time per launched kernel and a full wait for every host read; a DDP bucket
of a transformer holds dozens of tensors, so per-tensor Python is what made a step host-bound.
"""
from __future__ import annotations

import functools
import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from .. import devices, kernels
from .base import StagedContext, _stable_hash

__all__ = ["BucketLayout", "BucketContext", "SizeClass", "ClassTopK", "strided_at", "segment_of", "pack_signs", "unpack_signs", "signed_", "bits_of",
           "plus_minus_one"]

#: Most elements one block of :meth:`BucketLayout.reduce`'s first level reduces: 64 KiB of float32, so a
#: 25M-element tensor is about 1,500 blocks.
PIECE = 1 << 14


@dataclass(frozen=True)
class SizeClass:
    """The tensors of a bucket that have ``numel`` elements each: their positions in the bucket's list
    (``members``) and where each starts in the flat buffer (``starts``, on the bucket's device)."""

    numel: int
    members: tuple
    starts: torch.Tensor


class ClassTopK:
    """Where in a bucket each tensor's k largest values lie, k fixed per size class: one ``topk`` per
    class, each written where its (members, k) block lies in one buffer for all classes, then every
    tensor's start added at once (not an add per class and a join of them).

    ``classes``: (SizeClass, k) pairs, in the order the positions come out (a class with k = 0 selects
    nothing); built once per layout by its owner."""

    def __init__(self, classes: Iterable[tuple], device: torch.device):
        self.classes = tuple((size, k) for size, k in classes if k)
        self.ends = list(itertools.accumulate((len(size.members) * k for size, k in self.classes), initial=0))
        self.starts = (torch.cat([size.starts.view(-1, 1).expand(-1, k).reshape(-1) for size, k in self.classes])
                       if self.classes else torch.empty(0, dtype=torch.int64, device=device))

    def __call__(self, rows: Callable[[SizeClass], torch.Tensor]) -> torch.Tensor:
        """The int64 positions in the bucket of the k largest of each class's ``rows(size)`` (members x
        numel), class by class, each tensor's k after the one before."""
        at = torch.empty(self.ends[-1], dtype=torch.int64, device=self.starts.device)
        values = None  # topk's values, unread: one buffer of the rows' dtype for every class
        for (size, k), lo, hi in zip(self.classes, self.ends, self.ends[1:]):
            r = rows(size)
            if values is None:
                values = torch.empty(at.numel(), dtype=r.dtype, device=r.device)
            torch.topk(r, k, dim=1, sorted=False, out=(values[lo:hi].view(-1, k), at[lo:hi].view(-1, k)))
        return at.add_(self.starts)


class BucketLayout:
    """Keys, shapes and offsets of the tensors laid end to end in a flat buffer (DDP's bucket order).

    Built once per bucket and cached by the owner; its device tensors (``lengths``, each size class's
    ``starts``) are made here, so an exchange never copies host data to the device.
    """

    def __init__(self, keys: Sequence[str], shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device):
        self.keys = tuple(keys)
        self.shapes = tuple(torch.Size(s) for s in shapes)
        self.numels = tuple(s.numel() for s in self.shapes)
        offsets, total = [], 0
        for n in self.numels:
            offsets.append(total)
            total += n
        self.offsets = tuple(offsets)
        self.numel = total
        self.dtype = dtype
        self.device = torch.device(device)
        self.lengths = torch.tensor(self.numels, dtype=torch.int64, device=self.device)

    def __len__(self) -> int:
        return len(self.keys)

    @functools.cached_property
    def classes(self) -> tuple:
        """The non-empty tensors grouped by size, in order of first appearance."""
        members: dict[int, list[int]] = {}
        for i, n in enumerate(self.numels):
            if n:
                members.setdefault(n, []).append(i)
        return tuple(SizeClass(n, tuple(m), torch.tensor([self.offsets[i] for i in m], dtype=torch.int64,
                                                          device=self.device)) for n, m in members.items())

    def pieces(self, flat: torch.Tensor) -> list:
        """Each tensor's view of ``flat`` (one ``split`` plus a ``view`` per tensor: for building state
        views once, not for an exchange's hot path)."""
        return [piece.view(shape) for piece, shape in zip(torch.split(flat, self.numels), self.shapes)]

    def rows(self, flat: torch.Tensor, size: SizeClass) -> torch.Tensor:
        """The tensors of one size class as the rows of a (members, numel) tensor (see :meth:`stacked`)."""
        return self.stacked(flat, size.members)

    def stacked(self, flat: torch.Tensor, members: Sequence[int]) -> torch.Tensor:
        """The tensors ``members`` (of one size) as the rows of a (members, numel) tensor: a strided view of
        the contiguous ``flat`` where they start at equal distances (one tensor; the same layer's tensor
        in each block of a transformer), else stacked into a new one.  Read it, do not write it."""
        view = strided_at(flat, [self.offsets[i] for i in members], (self.numels[members[0]],))
        if view is not None:
            return view
        parts = torch.split(flat, self.numels)  # one operation, where a slice per tensor would grow with them
        return torch.stack([parts[i] for i in members])

    def segment_mean(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the float32 mean of its elements of the flat ``values`` (0 for an empty tensor)."""
        return self.segment_sum(values).div_(self._counts)

    @functools.cached_property
    def _counts(self) -> torch.Tensor:
        """Each tensor's element count, at least 1 (an empty tensor's sum, 0, divided by it stays 0)."""
        return self.lengths.clamp(min=1)

    def segment_sum(self, values: torch.Tensor) -> torch.Tensor:
        """Per tensor, the float32 sum of its elements of the flat ``values`` (0 for an empty tensor)."""
        return self.reduce(values.float() if values.dtype != torch.float32 else values, "sum")

    def reduce(self, values: torch.Tensor, how: str = "sum", total: torch.dtype = None) -> torch.Tensor:
        """Per tensor, the ``how`` ("sum" or "max", at least 0) of its elements of the flat ``values``, in
        their dtype or ``total`` (0 for an empty tensor): over pieces of at most :data:`PIECE` elements
        (exact counts in float32), then over each tensor's pieces.  CUB's segmented reduction
        (``segment_reduce`` on CUDA) gives each segment one thread block, so a tensor of millions of
        elements reduced whole would occupy one of the GPU's hundred-odd multiprocessors for
        milliseconds; cut into pieces, all of them take part."""
        first = self.chunk_reduce(values, how, PIECE)
        if total is not None:
            first = first.to(total)
        return _segment_reduce(first, how, self._piece_offsets)

    def reduce_each(self, values: Iterable, how: str = "sum", total: torch.dtype = None) -> torch.Tensor:
        """:meth:`reduce` of each flat tensor the iterable ``values`` yields, as rows (one per tensor
        yielded, a column per tensor of the bucket): each one's pieces reduced as it comes (one
        bucket-sized value alive at a time), every one's second level at once."""
        firsts = []
        for v in values:
            firsts.append(self.chunk_reduce(v, how, PIECE))
            del v  # before the next one is made: a comprehension would hold two at once
        return self.reduce_pieces(torch.stack(firsts, dim=1), how, total).T

    def reduce_pieces(self, first: torch.Tensor, how: str = "sum", total: torch.dtype = None) -> torch.Tensor:
        """:meth:`reduce`'s second level: per tensor, the ``how`` of its pieces' rows of ``first`` (a row
        per piece, :attr:`piece_table`'s order), in ``total`` where given."""
        return _segment_reduce(first if total is None else first.to(total), how, self._piece_offsets)

    @functools.cached_property
    def piece_table(self) -> tuple:
        """The pieces of :meth:`reduce` for a kernel: each one's start, length and tensor (int32, on the
        device), each tensor cut from its start into pieces of :data:`PIECE` elements, its last shorter."""
        return int32_columns([(start, min(PIECE, offset + n - start), i)
                              for i, (offset, n) in enumerate(zip(self.offsets, self.numels))
                              for start in range(offset, offset + n, PIECE)], 3, self.device)

    def chunk_reduce(self, values: torch.Tensor, how: str, size: int) -> torch.Tensor:
        """Per chunk (:meth:`chunk_lengths`), the ``how`` ("sum" or "max", at least 0) of the flat
        ``values``' elements there."""
        return _segment_reduce(values, how, self.chunk_offsets(size))

    @functools.cached_property
    def _piece_offsets(self) -> torch.Tensor:
        """Where each tensor's pieces (:meth:`reduce`) start among all pieces, and their end."""
        counts = [-(-n // PIECE) for n in self.numels]
        return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64, device=self.device)

    def per_element(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """A per-tensor quantity repeated over each tensor's elements: a flat tensor of ``numel``.

        Gathered by each element's tensor index, an int32 cumulative sum of the tensors' starts:
        ``repeat_interleave`` would build an int64 index (two copies of a float32 bucket) for it."""
        return per_tensor.index_select(0, self.segment_index())

    def segment_index(self) -> torch.Tensor:
        """Each element's tensor (int32, over the bucket), for spreading several per-tensor quantities
        with one index (``values.index_select(0, index)``, as :meth:`per_element`)."""
        return self._index(*self._later_starts)

    @functools.cached_property
    def tensor_starts(self) -> torch.Tensor:
        """Where every tensor after the first starts (int32, on the device; an empty one where the next
        starts): an element's tensor is how many of these are at most its position, which a kernel finds
        by ``segment_of`` instead of reading a bucket-sized index."""
        return torch.tensor(self.offsets[1:], dtype=torch.int32, device=self.device)

    def chunk_starts(self, size: int) -> torch.Tensor:
        """Where every chunk of ``size`` (:meth:`chunk_offsets`) after the first starts (int32), for
        ``segment_of``: made once per size."""
        cached = self.__dict__.setdefault("_chunk_starts", {})
        if size not in cached:
            cached[size] = self.chunk_offsets(size)[1:-1].to(torch.int32)
        return cached[size]

    def per_chunk(self, per_chunk: torch.Tensor, size: int, index: torch.Tensor = None) -> torch.Tensor:
        """A per-chunk quantity (chunks as :meth:`chunk_lengths`) repeated over each chunk's elements, as
        :meth:`per_element`: ``per_chunk.repeat_interleave(chunk_lengths(size))`` by an int32 index
        (``index``: :meth:`chunk_index`'s, to spread several quantities with one)."""
        return per_chunk.index_select(0, self.chunk_index(size) if index is None else index)

    def chunk_index(self, size: int) -> torch.Tensor:
        """Each element's chunk of ``size`` (int32, over the bucket; made at each call, not kept)."""
        later = self.__dict__.setdefault("_later_chunk_starts", {})
        if size not in later:  # a view of the offsets, made once; chunks never start together
            later[size] = self.chunk_offsets(size)[1:-1]
        return self._index(later[size])

    def _index(self, later_starts: torch.Tensor, counts: torch.Tensor = None) -> torch.Tensor:
        """Each element's segment, int32: the segments after the first start at ``later_starts``,
        ``counts`` of them there (empty ones start where the next does; None: one each), so an
        element's segment is the cumulative sum of the counts up to it."""
        index = torch.zeros(self.numel, dtype=torch.int32, device=self.device)
        counted = index.index_fill_(0, later_starts, 1) if counts is None else index.index_add_(0, later_starts, counts)
        return counted.cumsum_(0)

    @functools.cached_property
    def _later_starts(self) -> tuple:
        """Where the tensors after the first start (those that start at the same element, empty ones,
        counted together; none at the end), and how many start there."""
        starts: dict[int, int] = {}
        for offset in self.offsets[1:]:
            if offset < self.numel:
                starts[offset] = starts.get(offset, 0) + 1
        return (torch.tensor(list(starts), dtype=torch.int64, device=self.device),
                torch.tensor(list(starts.values()), dtype=torch.int32, device=self.device))

    def chunk_lengths(self, size: int) -> torch.Tensor:
        """The lengths of the chunks of ``size`` elements each tensor is cut into (its last one shorter,
        none for an empty tensor), in bucket order, on the bucket's device."""
        return self.chunk_offsets(size).diff()

    def chunk_offsets(self, size: int) -> torch.Tensor:
        """Where each chunk of ``size`` elements starts in the bucket (each tensor cut from its start, its
        last chunk shorter, none for an empty tensor), and the end, on the bucket's device: built once
        per size.  Offsets spare a segmented reduction the cumulative sum of lengths it would launch."""
        cached = self.__dict__.setdefault("_chunk_offsets", {})
        if size not in cached:
            starts = [start for offset, n in zip(self.offsets, self.numels)
                      for start in range(offset, offset + n, size)]
            cached[size] = torch.tensor([*starts, self.numel], dtype=torch.int64, device=self.device)
        return cached[size]

    def __repr__(self) -> str:
        return f"BucketLayout({len(self)} tensors, {self.numel} elements, {self.dtype}, {self.device})"


@dataclass
class BucketContext(StagedContext):
    """What a method may know about the bucket it exchanges; state is staged as in :class:`StagedContext`
    (flat tensors over the whole bucket), and committed by the owner with a device-side select."""

    layout: BucketLayout
    #: Whether the input's own memory may take error feedback's p = g + e (float32 input that the owner
    #: overwrites with the aggregate anyway: DDP's bucket): the bucket's largest temporary, saved.
    input_spare: bool = False

    def draw_seed(self, *, shared: bool = True, salt: str = "", per_step: bool = True) -> int:
        """A 31-bit seed for :func:`kernels.counter_uniforms` from (seed, first key, step[, rank]):
        counter-based draws need no generator object per tensor and step, and a Python number reaches
        the device as a kernel argument, not as a copy.  ``per_step=False``: the same seed at every
        step (draws a method may keep)."""
        parts = (self.seed, _stable_hash(self.layout.keys[0] + "/" + salt if self.layout.keys else salt),
                 self.step if per_step else -1, 0 if shared else self.rank + 1)
        value = 0
        for part in parts:
            value = (value * 1_000_003 + part) % (2**31 - 1)
        return value

    def uniforms(self, n: int, *, shared: bool = True, salt: str = "", per_step: bool = True) -> torch.Tensor:
        """n float32 draws in [0, 1) on the bucket's device (see :meth:`draw_seed`)."""
        drawn = self._drawn(kernels._counter_uniforms, n, shared, salt, per_step)
        if drawn is not None:
            return drawn
        like = torch.empty((), device=self.layout.device).expand(n)  # only its length is read: no n-element buffer
        return kernels.counter_uniforms(like, self.draw_seed(shared=shared, salt=salt, per_step=per_step))

    def kernel_seed(self, *, shared: bool = True, salt: str = "", per_step: bool = True) -> torch.Tensor:
        """:meth:`draw_seed` as a 0-d int32 tensor on the bucket's device, for a kernel's draws (a fill,
        not a copy from the host; a number would be compiled into the kernel)."""
        return torch.full((), self.draw_seed(shared=shared, salt=salt, per_step=per_step), dtype=torch.int32,
                          device=self.layout.device)

    def hashes(self, n: int, *, shared: bool = True, salt: str = "") -> torch.Tensor:
        """n distinct int32 keys, uniformly ordered, on the bucket's device: :meth:`uniforms` before its
        conversion to floats (four operations less, and no ties)."""
        drawn = self._drawn(kernels._counter_hashes, n, shared, salt)
        if drawn is not None:
            return drawn
        like = torch.empty((), device=self.layout.device).expand(n)
        return kernels.counter_hashes(like, self.draw_seed(shared=shared, salt=salt))

    def _drawn(self, kernel, n: int, shared: bool, salt: str, per_step: bool = True) -> Optional[torch.Tensor]:
        """``kernel``'s n draws where it runs compiled ahead (the same bits as its eager code, in one
        launch instead of a dozen); None where it does not (yet)."""
        if not kernel.wanted(n, self.layout.device):
            return None  # no seed tensor made for nothing
        like = torch.empty(n, dtype=torch.int32, device=self.layout.device)  # unread: a bare allocation
        return kernel.ahead(like, self.kernel_seed(shared=shared, salt=salt, per_step=per_step))


def int32_columns(rows: Sequence[tuple], width: int, device: torch.device) -> tuple:
    """The columns of ``rows`` (each ``width`` integers) as int32 tensors on ``device``, each one of its
    own: a kernel compiled ahead for a GPU copies, at every call, an argument viewed at an unaligned
    start, as a row of one (columns, rows) tensor would be."""
    table = torch.tensor(rows, dtype=torch.int32).reshape(-1, width)
    return tuple(column.contiguous().to(device) for column in table.T)


def summed_in_rank_order(gathered: Sequence, n: int, device: torch.device, fused: Optional[Callable],
                         decoded: Callable) -> torch.Tensor:
    """The ranks' payloads (``gathered``, in rank order) decoded and summed in that order: n float32.
    ``fused(out, fields, add)``, a kernel compiled ahead, writes a rank's values into ``out`` (``add``:
    adds them) and gives None where it is not ready; from the first rank it declines on (or with no
    ``fused``), ``decoded(fields)``'s eager values are added instead: the same bits either way."""
    total = None
    for fields in gathered:
        if fused is not None:
            out = torch.empty(n, device=device) if total is None else total
            if fused(out, fields, total is not None) is not None:
                total = out
                continue
            fused = None  # not ready for this form: the ranks after it eagerly
        value = decoded(fields)
        total = value if total is None else total.add_(value)
    return total


def segment_of(n: int, starts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """For a kernel: each of n elements' segment (int32), the number of ``starts`` (sorted) at most its
    position: a binary search per element, in registers on a GPU."""
    return torch.bucketize(torch.arange(n, dtype=torch.int32, device=device), starts, out_int32=True, right=True)


def strided_at(flat: torch.Tensor, starts: Sequence[int], shape: tuple) -> Optional[torch.Tensor]:
    """The tensors of ``shape`` lying at ``starts`` in the 1-D ``flat``, as one (len(starts), *shape)
    strided view where they start at equal distances (no copy; read it, do not write it); None where
    they do not."""
    size = math.prod(shape)
    step = starts[1] - starts[0] if len(starts) > 1 else size
    if flat.stride(0) == 1 and step >= size and all(b - a == step for a, b in zip(starts, starts[1:])):
        strides = tuple(itertools.accumulate(reversed(shape[1:]), operator.mul, initial=1))[::-1]
        return flat.as_strided((len(starts), *shape), (step, *strides), flat.storage_offset() + starts[0])
    return None


def _segment_reduce(values: torch.Tensor, how: str, offsets: torch.Tensor) -> torch.Tensor:
    """``how`` over each segment [offsets[i], offsets[i + 1]) of ``values`` (0 for an empty one)."""
    if offsets.numel() < 2:  # no segment: segment_reduce takes none
        return values.new_zeros(0)
    # unsafe: the offsets are a layout's own, so their checks, which read them back from the device (a
    # host sync on CUDA), are skipped
    return torch.segment_reduce(values, how, offsets=offsets, unsafe=True, initial=0.0)


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """Sign bits of the flat ``x`` (bit 1 for x >= 0, little-endian within each byte), ceil(n / 8)
    bytes, by tensor operations alone (the same bits as :func:`gradzip.bits.pack_bits`)."""
    n = x.numel()
    bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=x.device)
    torch.ge(x, 0, out=bits[:n].view(torch.bool))
    return (bits.view(-1, 8) << _shifts(x.device)).sum(dim=1, dtype=torch.uint8)


def signed_(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``x * unpack_signs(packed, x.numel())`` into the flat float ``x`` (returned), the +-1 as int8:
    a quarter of a float32 temporary.  Exact, -0.0 included, as the product with float +-1."""
    return x.mul_(plus_minus_one(bits_of(packed, x.numel()).view(torch.int8)))


def unpack_signs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: n float32 values +1.0 (bit 1) or -1.0 (bit 0)."""
    return plus_minus_one(bits_of(packed, n), torch.float32)


def plus_minus_one(bits: torch.Tensor, dtype: torch.dtype = None) -> torch.Tensor:
    """2 b - 1 for bits b in {0, 1}, exact, in ``dtype`` (default: the bits'), one operation: -1 + 2 b."""
    return torch.add(_minus_one(bits.device, dtype or bits.dtype), bits, alpha=2)


@functools.lru_cache(maxsize=16)
def _minus_one(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(-1, dtype=dtype, device=device)


def bits_of(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first n bits of ``packed`` (little-endian within each byte), one uint8 0 or 1 each."""
    return ((packed.unsqueeze(1) >> _shifts(packed.device)) & 1).view(-1)[:n]


@functools.lru_cache(maxsize=8)
def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(8, dtype=torch.uint8, device=device)
