"""Collectives: drive many tensors' exchange generators in lockstep over torch.distributed.

Each phase, every pending generator yields one request.  Requests of a phase are fused: all allreduces
of one (dtype, op) become one allreduce, all allgathers one allgather of a byte buffer (preceded by one
small allgather of the field sizes when a payload's size depends on the data).  Phases run one after the
other and requests keep the order of the tensors, so every rank issues the same collectives in the same
order, however the network delays them.

Safety rules this layer guarantees:
- empty payloads are never handed to a collective, and uneven allgather sizes are padded to the largest;
- a non-finite gradient on *any* rank is detected with one flag that rides along the first collective,
  so every rank reacts identically (see :class:`ExchangeReport`).
"""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass, field
from typing import Generator, Optional, Sequence

import torch
import torch.distributed as dist

from . import devices
from .compressors.base import AllGather, AllReduce

__all__ = ["Transport", "ProcessGroupTransport", "LocalTransport", "ThreadGroup", "ExchangeReport", "run_lockstep", "simulate"]


class Transport:
    """Executes already fused collectives for one rank."""

    rank: int = 0
    world_size: int = 1

    def allreduce(self, flat: torch.Tensor, op: str) -> torch.Tensor:
        raise NotImplementedError

    def allgather(self, flat: torch.Tensor) -> Sequence[torch.Tensor]:
        """Every rank's ``flat``, in rank order: a list, or one tensor whose rows are the ranks'."""
        raise NotImplementedError

    def allgather_into(self, flat: torch.Tensor, out: torch.Tensor) -> Sequence[torch.Tensor]:
        """:meth:`allgather` into ``out`` (world size rows like ``flat``, one tensor) where the transport
        can receive into given memory; by default the same as :meth:`allgather`."""
        return self.allgather(flat)

    def allgather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (of any length), in rank order: two gathers, the lengths then the bytes
        padded to the longest.  For checkpoints, not for steps."""
        device = self.device
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [int(n) for n in torch.cat(list(self.allgather(length))).tolist()]
        padded = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        return [bytes(t[:n].cpu().numpy()) for t, n in zip(self.allgather(padded), lengths)]

    @property
    def device(self) -> torch.device:
        """Where this transport's collectives take their tensors."""
        return torch.device("cpu")

    def issues_beside_other_groups(self, device: torch.device) -> bool:
        """:func:`issues_beside_other_groups` of this transport's group (one process: nothing to mismatch)."""
        return True


class LocalTransport(Transport):
    """World size 1: compression and feedback still apply, nothing is exchanged."""

    def allreduce(self, flat, op):
        return flat

    def allgather(self, flat):
        return flat.view(1, *flat.shape)  # one rank: its own flat, as the one row of a gathered tensor


class ProcessGroupTransport(Transport):
    """A real ``torch.distributed`` process group (gloo on CPU, NCCL on GPU)."""

    _OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def __init__(self, group: Optional[dist.ProcessGroup] = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backends = backends_of(group)
        #: The device of the last tensors exchanged: this rank's gradients' (see :attr:`device`).
        self.exchanged_on: Optional[torch.device] = None

    def allreduce(self, flat, op):
        self.exchanged_on = flat.device
        dist.all_reduce(flat, op=self._OPS[op], group=self.group)
        return flat

    def allgather(self, flat):
        return self.allgather_into(flat, flat.new_empty((self.world_size, *flat.shape)))

    def allgather_into(self, flat, out):
        self.exchanged_on = flat.device
        if self.backends.get(flat.device.type) == "gloo":  # gloo copies each rank's part either way, and takes
            dist.all_gather(list(out.unbind(0)), flat, group=self.group)  # one tensor only in newer torch
        else:  # into a list, NCCL gathers into a flat buffer of its own and copies each rank's part out:
            _all_gather_single(out.view(-1), flat.reshape(-1), group=self.group)  # a kernel per rank
        return out

    def issues_beside_other_groups(self, device):
        return issues_beside_other_groups(self.group, device)

    @property
    def known_device(self) -> Optional[torch.device]:
        """Where this rank's exchanges went (the last one's device), else the group's own GPU
        (``init_process_group(device_id=...)``); None where neither says."""
        if self.exchanged_on is not None:
            return self.exchanged_on
        bound = getattr(self.group or dist.group.WORLD, "bound_device_id", None)
        return bound if bound is not None and self.backends.get(bound.type, "gloo") != "gloo" else None

    @property
    def device(self):
        """Where this rank's collectives outside a step (checkpoints) take their tensors: where its
        exchanges' went, once there was one; before, the group's own device (``init_process_group(
        device_id=...)``), else the current CUDA device where the group sends CUDA tensors by a GPU
        backend (NCCL, alone or beside gloo), else the CPU.  Not the current device first: a rank that
        put its model on its GPU without ``torch.cuda.set_device``, or gradzip's own thread, has GPU 0
        current, and NCCL refuses two ranks of a machine on one GPU."""
        known = self.known_device
        if known is not None:
            return known
        if self.backends.get("cuda", "gloo") != "gloo" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def backends_of(group: Optional[dist.ProcessGroup] = None) -> dict:
    """The backend that takes each device type's tensors in ``group``, e.g. {"cuda": "nccl"}, {"cpu": "gloo",
    "cuda": "gloo"}: for a group made with no backend named, ``get_backend`` says "undefined" and the
    backends depend on torch's version and the machine (torch 2.13: NCCL alone where there is a GPU,
    gloo on a CPU; older ones gloo for CPU tensors and NCCL for CUDA ones)."""
    try:
        config = str(dist.get_backend_config(group))
    except AttributeError:  # a torch without backend configs: one backend for the group
        config = str(dist.get_backend(group))
    if ":" not in config:  # one name: NCCL takes CUDA tensors only, gloo both
        return {"cuda": config} if config == "nccl" else {"cpu": config, "cuda": config}
    return dict(item.split(":", 1) for item in config.split(","))


def default_group_timeout():
    """The timeout given to ``init_process_group``: ``new_group()`` without one takes the backend's
    default (30 minutes for gloo), so a dead peer would hang gradzip's collectives that long."""
    world = dist.group.WORLD
    for device_type in getattr(world, "_device_types", ()) or (torch.device("cpu"),):
        try:
            return world._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):  # a backend without options
            continue
    return None


def group_of_ranks(group: dist.ProcessGroup) -> tuple[dist.ProcessGroup, bool]:
    """A new process group of ``group``'s ranks (its backends, the default group's timeout), and
    whether it may be destroyed before the job ends.  A group of every rank is made by every rank, and
    may.  A subgroup's (DDP over one of several data-parallel groups) is made by its ranks alone, and
    may not: torch names such a group from its ranks, so one made again after it was destroyed would
    meet the first one's rendezvous keys in the store."""
    config = str(dist.get_backend_config(group))
    backend = None if "undefined" in config else config
    if dist.get_world_size(group) == dist.get_world_size():
        return dist.new_group(timeout=default_group_timeout(), backend=backend), True
    return dist.new_group(dist.get_process_group_ranks(group), timeout=default_group_timeout(), backend=backend,
                          use_local_synchronization=True), False


def issues_beside_other_groups(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether ``device``'s collectives on ``group`` may be issued from one thread while another
    thread issues collectives on another group, in an order that may differ between ranks.  gloo:
    yes, each group's collectives run on threads of their own and wait only for their own peers.
    NCCL (and any other backend): no; PyTorch documents concurrent NCCL groups as unsafe, since a
    kernel of one communicator can occupy the GPU while its peers' waits behind one of the other's."""
    return backends_of(group).get(device.type) == "gloo"


class ThreadGroup:
    """N workers as N threads of one process, with exact collectives (sums in rank order).

    Lets tests and the cost model run the real integration code for N simulated workers.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.barrier = threading.Barrier(world_size)
        self.slots: list = [None] * world_size

    def transport(self, rank: int) -> "Transport":
        return _ThreadTransport(self, rank)


class _ThreadTransport(Transport):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, flat):
        g = self.group
        g.slots[self.rank] = flat.clone()
        g.barrier.wait()
        everyone = [s.clone() for s in g.slots]
        g.barrier.wait()  # nobody overwrites a slot before all have read it
        return everyone

    def allreduce(self, flat, op):
        everyone = self._exchange(flat)
        total = everyone[0]
        for part in everyone[1:]:
            total = total + part if op == "sum" else torch.maximum(total, part)
        return total

    def allgather(self, flat):
        return self._exchange(flat)


#: One collective into one tensor (torch 2.13 names it ``all_gather_single``; before, ``all_gather_into_tensor``).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def transport_for(group: Optional[dist.ProcessGroup] = None) -> Transport:
    """A process-group transport when torch.distributed is initialised with several ranks, else local."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        return ProcessGroupTransport(group)
    return LocalTransport()


@dataclass
class ExchangeReport:
    """What one lockstep exchange cost.  Byte counts are per worker.

    ``payload_bytes``: the compressed payloads; ``wire_bytes``: every byte handed to a collective
    (payloads + size headers + padding + the one-element health flag); ``nonfinite``: some rank's input
    held NaN or Inf.  Times: ``compress_s`` is compressor code up to each request (all phases),
    ``decompress_s`` the code after the last one (decode, combine, error feedback update).
    """

    payload_bytes: int = 0
    wire_bytes: int = 0
    collectives: int = 0
    compress_s: float = 0.0
    communicate_s: float = 0.0
    decompress_s: float = 0.0
    nonfinite: bool = False
    per_tensor_payload: list = field(default_factory=list)


#: Fused buffers smaller than this are allocated afresh: the allocator reuses small blocks by itself.
_KEEP_MIN = 1 << 18


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _from_bytes(chunk: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Another rank's field of ``like``'s dtype from its bytes in the gathered buffer: a view where they
    start at a 16-byte boundary (every rank's first field), else a copy.  A wider dtype cannot be viewed
    at an offset that is not a multiple of its size, and a kernel compiled ahead for the GPU copies an
    argument that starts between 16-byte boundaries at every call (AOTInductor's alignment check)."""
    if chunk.storage_offset() % _ALIGNED == 0 and chunk.data_ptr() % _ALIGNED == 0:
        return chunk.view(like.dtype)
    return chunk.clone().view(like.dtype)


#: Bytes at whose multiples a field of a gathered buffer is viewed rather than copied (see _from_bytes).
_ALIGNED = 16

@functools.lru_cache(maxsize=8)
def _alignment_zeros(device: torch.device) -> torch.Tensor:
    """:data:`_ALIGNED` zero bytes on ``device``, made once (read only): what pads a gathered row to a
    16-byte boundary without an operation of its own (padding is never read, so no stream need wait
    for it)."""
    return torch.zeros(_ALIGNED, dtype=torch.uint8, device=device)


class _Phase:
    """Fuses one phase's requests, runs the collectives, hands each generator its result.

    ``buffers``: where the fused buffers of this bucket's exchange are kept from one step to the next
    (None: fresh ones); the results handed to the generators are views of them.
    """

    def __init__(self, transport: Transport, report: ExchangeReport, buffers: Optional[dict] = None):
        self.t = transport
        self.report = report
        self.buffers = buffers
        self.index = 0  # which phase of the exchange: each keeps buffers of its own
        self.device_flag = False  # the flag stays a tensor, never read on the host (run_lockstep)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Optional[torch.Tensor]:
        """This phase's kept buffer ``name``, or None (no reuse, small, or not on the CPU)."""
        if self.buffers is None or not devices.reuses_buffers(device) or numel < _KEEP_MIN:
            return None
        key = (self.index, name, dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]

    def _timed(self, fn, *args):
        start = time.perf_counter()
        out = fn(*args)
        self.report.communicate_s += time.perf_counter() - start
        self.report.collectives += 1
        return out

    def run(self, requests: dict[int, object], flag: Optional[torch.Tensor]) -> tuple[dict, Optional[bool]]:
        reduces: dict[tuple, list[int]] = {}
        gathers: list[int] = []
        for i, req in requests.items():
            if isinstance(req, AllReduce):
                if req.op not in ("sum", "max"):
                    raise ValueError(f"allreduce op must be 'sum' or 'max', got {req.op!r}")
                reduces.setdefault((req.tensor.dtype, req.op), []).append(i)
            elif isinstance(req, AllGather):
                gathers.append(i)
            else:
                raise TypeError(f"a compressor yielded {type(req).__name__}; expected AllReduce or AllGather")
        results: dict[int, object] = {}
        flag_out = None
        if gathers:
            flag_out = self._allgather(requests, gathers, results, flag)
            flag = None
        for (dtype, op), members in reduces.items():
            got = self._allreduce(requests, members, op, dtype, results, flag)
            if flag is not None:
                flag_out, flag = got, None
        return results, flag_out

    def _allreduce(self, requests, members, op, dtype, results, flag):
        tensors = [requests[i].tensor for i in members]
        for i, t in zip(members, tensors):
            self.report.per_tensor_payload[i] += _nbytes(t)
            self.report.payload_bytes += _nbytes(t)
        parts = [t.reshape(-1) for t in tensors]
        if flag is not None:
            parts.append(flag.to(dtype=dtype, device=tensors[0].device).reshape(1))
        numel = sum(p.numel() for p in parts)
        flat = torch.cat(parts, out=self._buffer(f"allreduce-{op}", numel, dtype, parts[0].device)) if parts else torch.empty(0)
        flag_out = None
        if flat.numel() > 0:
            self.report.wire_bytes += _nbytes(flat)
            flat = self._timed(self.t.allreduce, flat, op)
        if flag is not None:
            flag_out = flat[-1] > 0 if self.device_flag else bool(flat[-1] > 0)
        # Each result is a view into the fused buffer: it belongs to this exchange alone (never to the
        # request's payload), and the views do not overlap, so no copy is needed.
        offset = 0
        for i, t in zip(members, tensors):
            results[i] = flat[offset : offset + t.numel()].view(t.shape)
            offset += t.numel()
        return flag_out

    def _allgather(self, requests, members, results, flag):
        fields = [f for i in members for f in requests[i].fields]
        sizes = [_nbytes(f) for f in fields]
        for i in members:
            n = sum(_nbytes(f) for f in requests[i].fields)
            self.report.per_tensor_payload[i] += n
            self.report.payload_bytes += n
        device = fields[0].device if fields else torch.device("cpu")
        world = self.t.world_size
        if all(requests[i].same_size for i in members):
            size_rows = [sizes] * world
        else:
            header = torch.tensor(sizes, dtype=torch.int64, device=device)
            self.report.wire_bytes += _nbytes(header)
            size_rows = [row.tolist() for row in self._timed(self.t.allgather, header)]
        extra = 1 if flag is not None else 0
        longest = max(sum(row) for row in size_rows) + extra
        if world > 1:  # every rank's row, and so its first field, starts on a 16-byte boundary: a view
            longest = -(-longest // _ALIGNED) * _ALIGNED
        mine = [_as_bytes(f) for f in fields]
        if flag is not None:
            # a device bool is its own byte (0 or 1): viewed, not converted
            mine.append((flag.view(torch.uint8) if flag.dtype == torch.bool and flag.device == device
                         else flag.to(dtype=torch.uint8, device=device)).reshape(1))
        pad = longest - sum(sizes) - extra
        if pad:
            mine.append(_alignment_zeros(device)[:pad] if pad < _ALIGNED else
                        torch.zeros(pad, dtype=torch.uint8, device=device))  # uneven payloads' padding
        flag_out = None
        if longest > 0:
            buf = torch.cat(mine, out=self._buffer("allgather", longest, torch.uint8, device)) if mine \
                else torch.empty(0, dtype=torch.uint8, device=device)
            self.report.wire_bytes += _nbytes(buf)
            out = self._buffer("allgathered", world * longest, torch.uint8, device)
            gathered = (self._timed(self.t.allgather, buf) if out is None else
                        self._timed(self.t.allgather_into, buf, out.view(world, longest)))
            if flag is not None and self.device_flag:
                at = {sum(row) for row in size_rows}
                if isinstance(gathered, torch.Tensor) and len(at) == 1:  # every rank's flag in one column
                    flags = gathered[:, at.pop()]
                else:
                    flags = torch.stack([g[sum(row)] for g, row in zip(gathered, size_rows)])
                flag_out = flags.amax().view(torch.bool)
            elif flag is not None:
                flag_out = any(bool(g[sum(row)] > 0) for g, row in zip(gathered, size_rows))
        else:
            gathered = [torch.empty(0, dtype=torch.uint8, device=device)] * world
        # Split each rank's buffer back into per-request tuples of fields (own fields are reused as-is).
        per_rank = []
        for r, (buf, row) in enumerate(zip(gathered, size_rows)):
            offset, out = 0, []
            for f, n in zip(fields, row):
                out.append(f.reshape(-1) if r == self.t.rank else _from_bytes(buf[offset : offset + n], f))
                offset += n
            per_rank.append(out)
        start = 0
        for i in members:
            count = len(requests[i].fields)
            results[i] = [tuple(per_rank[r][start : start + count]) for r in range(world)]
            start += count
        return flag_out


def run_lockstep(gens: Sequence[Generator], transport: Transport, nonfinite_local: bool = False,
                 buffers: Optional[dict] = None):
    """Run exchange generators to completion in lockstep; returns (their return values, report).

    ``nonfinite_local``: whether this rank's input holds NaN or Inf, or a callable that says so once
    every generator ran up to its first collective (which carries the flag to every rank), or a 0-d
    bool tensor: the flag is then carried without any host read, and ``report.nonfinite`` is a bool
    tensor on the flag's device (the bucket route).

    ``buffers``: a dict in which to keep the fused collectives' buffers for the next exchange of the
    same tensors (the caller copies the results out before then); None allocates fresh ones.
    """
    report = ExchangeReport(per_tensor_payload=[0] * len(gens))
    phase = _Phase(transport, report, buffers)
    phase.device_flag = isinstance(nonfinite_local, torch.Tensor)
    pending = dict(enumerate(gens))
    inbox: dict[int, object] = {i: None for i in pending}
    outputs: list = [None] * len(gens)

    def local_flag() -> torch.Tensor:
        if phase.device_flag:
            report.nonfinite = nonfinite_local
            return nonfinite_local
        report.nonfinite = bool(nonfinite_local() if callable(nonfinite_local) else nonfinite_local)
        return torch.tensor([1.0 if report.nonfinite else 0.0])

    flag = None if pending else local_flag()
    flag_known = False
    while pending:
        requests = {}
        for i, gen in list(pending.items()):
            start = time.perf_counter()
            try:
                requests[i] = gen.send(inbox[i])
                report.compress_s += time.perf_counter() - start
            except StopIteration as stop:
                report.decompress_s += time.perf_counter() - start
                outputs[i] = stop.value
                del pending[i]
        if flag is None:
            flag = local_flag()
        if not requests:
            break
        results, flag_out = phase.run(requests, None if flag_known else flag)
        phase.index += 1
        if not flag_known:
            flag_known = True
            report.nonfinite = flag_out if phase.device_flag else bool(flag_out)
        inbox = results
    return outputs, report


def simulate(gens_per_rank: Sequence[Sequence[Generator]]):
    """Run N ranks' generators in one process, with exact in-process collectives (sums in rank order).

    Used by tests and the cost model to compare against real process groups; returns per-rank outputs.
    """
    world = len(gens_per_rank)
    pending = [dict(enumerate(g)) for g in gens_per_rank]
    inbox = [{i: None for i in p} for p in pending]
    outputs = [[None] * len(g) for g in gens_per_rank]
    while any(pending):
        requests = [{} for _ in range(world)]
        for r in range(world):
            for i, gen in list(pending[r].items()):
                try:
                    requests[r][i] = gen.send(inbox[r][i])
                except StopIteration as stop:
                    outputs[r][i] = stop.value
                    del pending[r][i]
        if not any(requests):
            break
        inbox = [{} for _ in range(world)]
        for i in requests[0]:
            reqs = [requests[r][i] for r in range(world)]
            if isinstance(reqs[0], AllReduce):
                total = reqs[0].tensor.clone()
                for req in reqs[1:]:
                    total = total + req.tensor if req.op == "sum" else torch.maximum(total, req.tensor)
                for r in range(world):
                    inbox[r][i] = total.clone()
            else:
                fields = [tuple(f.reshape(-1).clone() for f in req.fields) for req in reqs]
                for r in range(world):
                    inbox[r][i] = fields
    return outputs
