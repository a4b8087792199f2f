"""Checks every compressor must pass, for methods written outside gradzip too.

    from gradzip.testing import check_compressor
    check_compressor(MyCompressor)           # a zero-argument factory (a class with defaults is one)
    check_compressor("topk")                 # a registered name
    check_compressor(gradzip.make("topk", ratio=0.1), distributed=False)   # a built instance

Each check gets a fresh compressor: an instance is deep-copied, a name or a factory is called again.
The checks are those gradzip's own test matrix runs on every registered method (tests/test_matrix.py
calls the functions below one by one):

- ``round_trip``: fp32, fp16 and bf16 gradients of several shapes come back with their shape and dtype,
  finite, over several steps;
- ``wire_bytes``: the bytes handed to collectives equal the method's own ``payload_bytes`` formula;
- ``error_feedback``: under each scheme in ``feedbacks``, sent + kept == compensated input
  (residual: g + e; DGC's momentum correction: v + u);
- ``ranks_agree``: 2 and 3 simulated ranks (``collectives.simulate``) get the same aggregate, bit for bit,
  within the method's ``bound`` where it gives one;
- ``odd_inputs``: empty, 0-d, one-element, non-contiguous and odd-sized tensors;
- ``nonfinite``: a NaN input gives NaN everywhere and commits no state;
- ``state_dict``: a run resumed from ``state_dict()`` continues bit for bit;
- ``reuse``: exchanging into ``out`` (the integrations' way: buffers kept across steps, state double
  buffered) gives the same aggregates and state as plain exchanges, bit for bit, also with 3 ranks
  (threads) each exchanging its gradients into themselves;
- ``distributed`` (``distributed=True``): two real gloo processes (:func:`gradzip.launcher.run_workers`)
  get identical results.  The compressor travels to them by pickle, so its class (or factory) must be
  importable by module and name: defined at the top level of a module, not in a function or a notebook.
  When it cannot be pickled this check is skipped with a warning saying why.

A failed check raises AssertionError whose message names the compressor, the check and what broke.
This module imports only gradzip's core and launcher; the core does not import it.

Counting what an exchange costs (tests/test_budgets.py checks the budgets with it; benchmarks may too):

    with count_exchanges(state) as counts:   # every state.exchange call runs inside an OpCounter
        train_one_step()
    counts.ops, counts.host_reads, counts.exchanges, counts.plain

:class:`OpCounter` counts every aten operation dispatched on the thread that entered it, and the
"host reads": operations that wait for the device on CUDA (``.item()``, ``nonzero``, ``tolist()``, ...).
"""
from __future__ import annotations

import collections
import contextlib
import copy
import functools
import pickle
import threading
import warnings
import weakref
from typing import Callable, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from . import feedback
from .collectives import LocalTransport, ThreadGroup, run_lockstep, simulate
from .compressors.base import Compressor, TensorContext
from .compressors.dense import NoCompression
from .compressors.registry import make
from .launcher import run_workers
from .state import GradzipState

__all__ = ["check_compressor", "CHECKS", "DTYPES", "SHAPES", "WIRE_SHAPES", "odd_inputs", "grads", "factory_of",
           "check_round_trip", "check_wire_bytes", "check_error_feedback", "check_ranks_agree", "check_odd_inputs",
           "check_nonfinite", "check_state_dict", "check_reuse", "check_distributed",
           "OpCounter", "MemoryCounter", "ExchangeCount", "ExchangeCounts", "count_exchanges", "HOST_READ_OPS"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((64, 40), (1000,), (6, 5, 3, 3))
WIRE_SHAPES = SHAPES + ((13,), (9, 7))

Factory = Callable[[], Compressor]


def odd_inputs(rank):
    """Empty, 0-d, one-element, non-contiguous and odd-sized tensors with rank-dependent values."""
    g = torch.Generator().manual_seed(rank + 1)
    return [
        ("empty", torch.empty(0)),
        ("empty2d", torch.empty(0, 7)),
        ("scalar", torch.randn((), generator=g)),
        ("one", torch.randn(1, generator=g)),
        ("transposed", torch.randn(9, 5, generator=g).t()),
        ("odd", torch.randn(1001, generator=g) * (rank + 1)),
        ("matrix", torch.randn(33, 40, generator=g)),
    ]


def grads(shape, dtype, seed):
    """A reproducible gradient-like tensor (standard deviation 0.1)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.1).to(dtype)


def factory_of(compressor: Union[Compressor, str, Factory]) -> Factory:
    """A zero-argument callable returning a fresh compressor, picklable when the compressor is."""
    if isinstance(compressor, Compressor):
        return functools.partial(copy.deepcopy, compressor)
    if isinstance(compressor, str):
        return functools.partial(make, compressor)
    if callable(compressor):
        return compressor
    raise TypeError(f"check_compressor needs a Compressor, a registered name or a zero-argument factory, "
                    f"got {type(compressor).__name__}")


def _fresh(factory: Factory) -> Compressor:
    c = factory()
    if not isinstance(c, Compressor):
        raise TypeError(f"the factory returned {type(c).__name__}, not a gradzip Compressor")
    return c


def _fail(c: Compressor, check: str, detail: str):
    raise AssertionError(f"{c.name or type(c).__name__}: {check}: {detail}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _check_each_step(c, check, fn):
    """Run ``fn()``; an exception other than a failed check becomes one naming the compressor and check."""
    try:
        return fn()
    except AssertionError:
        raise
    except Exception as exc:
        raise AssertionError(f"{c.name or type(c).__name__}: {check}: raised {type(exc).__name__}: {exc}") from exc


def _guarded(check: str):
    def wrap(fn):
        @functools.wraps(fn)
        def run(factory, *args, **kwargs):
            factory = factory_of(factory)
            c = _fresh(factory)
            return _check_each_step(c, check, lambda: fn(factory, c, *args, **kwargs))
        return run
    return wrap


# -- the checks ---------------------------------------------------------------------------------------------


@_guarded("round trip")
def check_round_trip(factory, c, dtype=torch.float32, steps=4):
    """Shapes and dtypes are kept and the output is finite, over ``steps`` steps of ``SHAPES``."""
    state = GradzipState(c)
    for step in range(steps):
        named = [(f"t{i}", grads(shape, dtype, step * 10 + i)) for i, shape in enumerate(SHAPES)]
        out = state.exchange(named)
        for (key, g), o in zip(named, out):
            where = f"{_dtype_name(dtype)} tensor {key} of shape {tuple(g.shape)} at step {step}"
            if o.shape != g.shape or o.dtype != g.dtype:
                _fail(c, "round trip", f"{where} came back as {tuple(o.shape)} {_dtype_name(o.dtype)}")
            if not torch.isfinite(o).all():
                _fail(c, "round trip", f"{where} came back with non-finite values")


def _exchange_one(compressor, x, ctx):
    run = compressor.exchange if compressor.compresses(ctx) else NoCompression().exchange
    (result,), report = run_lockstep([run(x.float(), ctx)], LocalTransport())
    return result, report


@_guarded("wire bytes")
def check_wire_bytes(factory, c, shape=(13,), dtype=torch.float32, steps=(0, 50)):
    """The payload counted by the collectives equals ``payload_bytes`` (``kept`` from the mask when sparse);
    a tensor the method does not compress costs n * itemsize.  Wire bytes add at most the health flag,
    size headers and padding."""
    x = grads(shape, dtype, 3)
    for step in steps:  # some methods start dense (PowerSGD's dense_steps)
        ctx = TensorContext("w", x.shape, dtype, step=step)
        compressed = c.compresses(ctx)  # asked before the exchange, as feedback.py does
        result, report = _exchange_one(c, x, ctx)
        if compressed:
            kept = int(result.mask.sum()) if result.mask is not None else None
            expected = c.payload_bytes(ctx, kept)
        else:
            expected = x.numel() * x.element_size()
        where = f"wire bytes for shape {tuple(shape)} {_dtype_name(dtype)} at step {step}"
        if report.per_tensor_payload != [expected] or report.payload_bytes != expected:
            _fail(c, where, f"payload {report.payload_bytes} != formula {expected}"
                  + ("" if compressed else " (a tensor sent densely costs n * itemsize)"))
        # One byte or element more on the wire: the non-finite flag rides along the first collective.
        limit = expected + 8 * (1 + 2 * report.collectives)
        if not expected <= report.wire_bytes <= limit:
            _fail(c, where, f"wire {report.wire_bytes} outside [{expected}, {limit}] "
                  "(payload plus flag, size headers and padding)")


def _close(a, b, scale):
    # Conservation holds up to one rounding of the subtraction p - sent.
    return torch.allclose(a, b, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(scale) + 1e-12)


def _sent_as_plain_cast(sent: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``sent`` is ``p`` cast to fp16 or bf16 and back, exactly (world size 1)."""
    return any(torch.equal(sent, p.to(half).float()) for half in (torch.float16, torch.bfloat16))


@_guarded("error feedback")
def check_error_feedback(factory, c, steps=6):
    """sent + kept == compensated input under every scheme in ``feedbacks`` (world size 1), except
    that a tensor sent as a plain fp16 or bf16 cast of the compensated input may keep no residual
    (``auto`` sends its half-cast choices so, without error feedback, to use the integration's plain
    allreduce; which tensors it casts depends on measured times)."""
    for scheme in c.feedbacks:
        state = GradzipState(_fresh(factory), feedback=scheme)
        cs = state.compressor
        for step in range(steps):
            named = [(f"t{i}", grads(shape, torch.float32, 100 * step + i)) for i, shape in enumerate(SHAPES)]
            before = {k: dict(v) for k, v in state.tensors.items()}
            out = state.exchange(named)
            for (key, g), sent in zip(named, out):  # world size 1: the aggregate is what was sent
                old, new = before.get(key, {}), state.tensors.get(key, {})
                if scheme == "residual":
                    p = g + old.get("residual", 0)
                    kept = new.get("residual", torch.zeros_like(g))
                elif scheme == "momentum" and cs.clip_norm is None:
                    u_old = old.get("momentum", torch.zeros_like(g))
                    increment = (u_old + g) * cs.momentum + g if cs.nesterov else cs.momentum * u_old + g
                    p = old.get("velocity", 0) + increment
                    kept = new.get("velocity", torch.zeros_like(g))
                else:
                    continue
                if scheme == "residual" and "residual" not in new and _sent_as_plain_cast(sent, p):
                    continue  # a plain half cast keeps no residual by design (auto's, as PyTorch's fp16 hook)
                if not _close(sent + kept, p, p.abs().max()):
                    lost = float((sent + kept - p).abs().max())
                    _fail(c, "error feedback", f"scheme {scheme!r}, tensor {key} of shape {tuple(g.shape)} at step "
                          f"{step}: sent + kept differs from the compensated input by up to {lost:.3g} "
                          f"(|input| up to {float(p.abs().max()):.3g}): the {scheme} state lost mass")


@_guarded("ranks agree")
def check_ranks_agree(factory, c, world=2, steps=(0, 50)):
    """``world`` simulated ranks with different gradients get the same aggregate, bit for bit."""
    for step in steps:
        gens = []
        for rank in range(world):
            x = grads((24, 40), torch.float32, rank) * (1000.0 if step else 1.0)  # and scales above 1
            ctx = TensorContext("w", x.shape, x.dtype, step=step, rank=rank, world_size=world)
            gens.append([feedback.exchange(c, x, ctx)])
        results = [rank_outs[0] for rank_outs in simulate(gens)]
        outs = [r.aggregate for r in results]
        for r in results:  # a bound that lets the finiteness check skip the aggregate must hold
            # (2^-20: room for the rounding of a scale times a level, or of a few products summed)
            if r.bound is not None and r.aggregate.numel() and not float(r.bound) * (1 + 2**-20) >= float(r.aggregate.abs().max()):
                _fail(c, "ranks agree", f"world {world}, step {step}: the aggregate's bound {float(r.bound):.6g} is "
                      f"below its largest magnitude {float(r.aggregate.abs().max()):.6g}")
        if tuple(outs[0].shape) != (24, 40):
            _fail(c, "ranks agree", f"the aggregate of a (24, 40) tensor has shape {tuple(outs[0].shape)}")
        for rank in range(1, world):
            if not torch.equal(outs[0], outs[rank]):
                _fail(c, "ranks agree", f"world {world}, step {step}: rank {rank}'s aggregate differs from rank 0's "
                      f"by up to {float((outs[0] - outs[rank]).abs().max()):.3g}")


@_guarded("odd inputs")
def check_odd_inputs(factory, c, steps=3):
    """Empty, 0-d, one-element, non-contiguous and odd-sized tensors (:func:`odd_inputs`)."""
    state = GradzipState(c)
    for step in range(steps):
        named = odd_inputs(step)
        out = state.exchange(named)
        for (key, g), o in zip(named, out):
            if o.shape != g.shape or o.dtype != g.dtype or not torch.isfinite(o).all():
                _fail(c, "odd inputs", f"tensor {key!r} of shape {tuple(g.shape)} at step {step} came back as "
                      f"{tuple(o.shape)} {_dtype_name(o.dtype)}, finite: {bool(torch.isfinite(o).all())}")


@_guarded("non-finite input")
def check_nonfinite(factory, c):
    """A NaN in one tensor gives NaN in every output and changes no state."""
    state = GradzipState(c)
    named = odd_inputs(0)
    state.exchange(named)
    saved = state.state_dict()
    bad = [(k, g.clone()) for k, g in named]
    bad[-1][1][0, 0] = float("nan")
    out = state.exchange(bad)
    finite = [k for (k, _), o in zip(bad, out) if o.numel() and not torch.isnan(o).all()]
    if finite:
        _fail(c, "non-finite input", f"a NaN in tensor {bad[-1][0]!r} left tensors {finite} not all NaN")
    after = state.state_dict()
    if after["steps"] != saved["steps"]:
        _fail(c, "non-finite input", "the step counters advanced on a NaN step")
    for key, slot in saved["tensors"].items():
        for n, v in slot.items():
            if not torch.equal(after["tensors"][key][n], v):
                _fail(c, "non-finite input", f"state {n!r} of tensor {key!r} changed on a NaN step")
    if state.stats()["nonfinite_exchanges"] != 1:
        _fail(c, "non-finite input", "the NaN step was not counted in stats()['nonfinite_exchanges']")
    # A large tensor after warm steps, exchanged plainly and into itself (as DDP's bucket): error
    # feedback checks g + e as it computes it, and an aggregate copied out is checked as it is copied.
    for into in (False, True):
        big = GradzipState(_fresh(factory))
        for step in range(2):
            g = grads((600, 500), torch.float32, step)
            big.exchange([("big", g)], out=[g] if into else None)
        saved = big.state_dict()
        for where, value in ((7, float("inf")), (299_990, float("nan")), (262_150, float("-inf"))):
            g = grads((600, 500), torch.float32, 5)
            g.view(-1)[where] = value
            out = big.exchange([("big", g)], out=[g] if into else None)[0]
            how = "exchanged into itself" if into else "exchanged"
            if not torch.isnan(out).all():
                _fail(c, "non-finite input", f"{value} at element {where} of a 600x500 tensor {how} left its output "
                      "not all NaN")
            if any(not torch.equal(big.tensors["big"][n], v) for n, v in saved["tensors"].get("big", {}).items()):
                _fail(c, "non-finite input", f"{value} at element {where} of a 600x500 tensor {how} changed its state")


@_guarded("state_dict resume")
def check_state_dict(factory, c, warmup=6, steps=3):
    """A state saved after ``warmup`` steps and loaded into a fresh one continues bit for bit."""
    def run(state, ks):
        return [state.exchange([(f"t{i}", grads(s, torch.float32, 7 * k + i)) for i, s in enumerate(SHAPES)])
                for k in ks]

    # Saved after six steps: past warm-ups and auto's timed plan, which a resumed run must take over.
    first = GradzipState(c, seed=5)
    run(first, range(warmup))
    saved = first.state_dict()
    expected = run(first, range(warmup, warmup + steps))
    resumed = GradzipState(_fresh(factory), seed=0)
    resumed.load_state_dict(saved)
    got = run(resumed, range(warmup, warmup + steps))
    for k, (a, b) in enumerate(zip(expected, got)):
        for i, (x, y) in enumerate(zip(a, b)):
            if not torch.equal(x, y):
                _fail(c, "state_dict resume", f"step {warmup + k}, tensor t{i} of shape {tuple(x.shape)}: the "
                      f"resumed run differs by up to {float((x - y).abs().max()):.3g}")


#: Shapes above the size from which an exchange into ``out`` keeps its buffers across steps.
REUSE_SHAPES = ((320, 300), (1000,), (600, 500))


@_guarded("reused buffers")
def check_reuse(factory, c, steps=5, nan_step=2):
    """Exchanging into ``out`` (as the integrations do, the inputs themselves included, which keeps
    buffers and double-buffered state across steps) gives the same aggregates and state, bit for bit,
    as plain exchanges, also after a skipped non-finite step (at ``nan_step``).  For a method that
    decides from measured times (``measures_time``) two runs may decide differently: only shapes,
    dtypes, finiteness and the state's names are compared then."""
    plain, reused = GradzipState(c, seed=3), GradzipState(_fresh(factory), seed=3)
    exact = not c.measures_time
    for step in range(steps):
        named = [(f"t{i}", grads(s, torch.float32, 11 * step + i)) for i, s in enumerate(REUSE_SHAPES)]
        if step == nan_step:
            named[0][1].view(-1)[7] = float("nan")
        expected = plain.exchange(named)
        inputs = [(k, g.clone()) for k, g in named]
        out = [inputs[0][1]] + [torch.full_like(g, 5.0) for _, g in inputs[1:]]  # the first in place, as DDP's
        got = reused.exchange(inputs, out=out)
        for i, (a, b, o) in enumerate(zip(expected, got, out)):
            if b is not o:
                _fail(c, "reused buffers", f"step {step}: exchange(out=...) returned tensor {i} not written into out")
            if not _same_result(a, b, exact):
                _fail(c, "reused buffers", f"step {step}, tensor t{i} of shape {tuple(a.shape)}: exchanging into out "
                      f"differs from a plain exchange")
        a, b = plain.state_dict(), reused.state_dict()
        for key, slot in a["tensors"].items():
            for n, v in slot.items():
                w = b["tensors"].get(key, {}).get(n)
                if w is None or (exact and not torch.equal(v.nan_to_num(7.0), w.nan_to_num(7.0))):
                    _fail(c, "reused buffers", f"step {step}: state {n!r} of tensor {key!r} differs when exchanging "
                          "into out (buffers or spares reused while still in use)")
        if a["steps"] != b["steps"] or set(a["tensors"]) != set(b["tensors"]):
            _fail(c, "reused buffers", f"step {step}: the states hold different tensors or step counters")
    _check_reuse_across_ranks(factory, c, exact)


def _same_result(a: torch.Tensor, b: torch.Tensor, exact: bool) -> bool:
    """Same shape, dtype and NaN positions, and (``exact``) the same values bit for bit."""
    return (a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.isnan(), b.isnan())
            and (not exact or torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))))


def _check_reuse_across_ranks(factory, c, exact, world=3, steps=3):
    """3 ranks (threads of :class:`ThreadGroup`), each exchanging its gradients into themselves as DDP's
    bucket, get the aggregates of plain exchanges: what a method builds in lent memory never overwrites
    an input or a payload that another rank's data is still decoded against."""
    runs = []
    for into_inputs in (False, True):
        group, outputs, errors = ThreadGroup(world), [None] * world, []

        def worker(rank):
            try:
                state = GradzipState(_fresh(factory), seed=3, transport=group.transport(rank))
                outputs[rank] = []
                for step in range(steps):
                    named = [(f"t{i}", grads(s, torch.float32, 100 * rank + 11 * step + i)) for i, s in enumerate(REUSE_SHAPES)]
                    got = state.exchange(named, out=[g for _, g in named] if into_inputs else None)
                    outputs[rank].append([t.clone() for t in got])
            except BaseException as exc:  # release the other ranks from their barrier, report below
                errors.append(exc)
                group.barrier.abort()

        threads = [threading.Thread(target=worker, args=(rank,), daemon=True) for rank in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        if any(t.is_alive() for t in threads):
            _fail(c, "reused buffers", f"{world} ranks exchanging into their inputs did not finish in 120 s")
        if errors:
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        runs.append(outputs)
    plain, lent = runs
    for rank in range(world):
        for step in range(steps):
            for i, (a, b) in enumerate(zip(plain[rank][step], lent[rank][step])):
                if not _same_result(a, b, exact):
                    _fail(c, "reused buffers", f"{world} ranks, rank {rank}, step {step}, tensor t{i}: exchanging "
                          "into the inputs themselves differs from a plain exchange")


def _distributed_worker(rank, world, factory, steps):
    """Runs in each worker process: ``steps`` exchanges of regular and odd tensors; returns the outputs."""
    state = GradzipState(factory())
    outs = []
    for step in range(steps):
        named = [(f"t{i}", grads(s, torch.float32, 100 * rank + 10 * step + i)) for i, s in enumerate(SHAPES)]
        outs.append(state.exchange(named + odd_inputs(rank + step)))
    state.close()
    return outs


def _unpicklable(factory) -> str:
    try:
        pickle.dumps(factory)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def check_distributed(factory, world=2, steps=3, timeout=240.0) -> bool:
    """Two (``world``) real gloo processes get identical outputs with their shapes, finite.

    Returns False, with a warning, when the factory cannot be pickled to the workers.
    """
    factory = factory_of(factory)
    c = _fresh(factory)
    why = _unpicklable(factory)
    if why:
        warnings.warn(f"{c.name or type(c).__name__}: distributed check skipped: the compressor cannot be sent "
                      f"to worker processes ({why}); define its class or factory at the top level of an "
                      "importable module, or pass distributed=False", stacklevel=2)
        return False
    try:
        results = run_workers(_distributed_worker, world, factory, steps, timeout=timeout, every_rank=True)
    except RuntimeError as exc:
        _fail(c, f"distributed ({world} gloo processes)", f"the workers failed: {exc}")
    shapes = [tuple(s) for s in SHAPES] + [tuple(g.shape) for _, g in odd_inputs(0)]
    for step in range(steps):
        first = results[0][step]
        if [tuple(t.shape) for t in first] != shapes:
            _fail(c, "distributed", f"step {step}: output shapes {[tuple(t.shape) for t in first]} != {shapes}")
        if not all(torch.isfinite(t).all() for t in first):
            _fail(c, "distributed", f"step {step}: rank 0 got non-finite values")
        for rank in range(1, world):
            for i, (a, b) in enumerate(zip(first, results[rank][step])):
                if not torch.equal(a, b):
                    _fail(c, "distributed", f"step {step}, tensor {i} of shape {tuple(a.shape)}: rank {rank} "
                          f"differs from rank 0 over {world} gloo processes")
    return True


#: Every check of :func:`check_compressor` with the arguments it runs: (name, function, kwargs).
CHECKS = (
    [("round_trip", check_round_trip, {"dtype": d}) for d in DTYPES]
    + [("wire_bytes", check_wire_bytes, {"shape": s, "dtype": d}) for s in WIRE_SHAPES for d in DTYPES]
    + [("error_feedback", check_error_feedback, {})]
    + [("ranks_agree", check_ranks_agree, {"world": w}) for w in (2, 3)]
    + [("odd_inputs", check_odd_inputs, {}), ("nonfinite", check_nonfinite, {}), ("state_dict", check_state_dict, {})]
    + [("reuse", check_reuse, {})]
)


def check_compressor(compressor: Union[Compressor, str, Factory], *, distributed: bool = True) -> list:
    """Run every check on ``compressor`` (a built instance, a registered name, or a zero-argument factory
    returning a fresh instance); raises AssertionError naming the compressor and the check on the first
    failure.  Returns the names of the checks that ran ("distributed" only when it did run).
    """
    factory = factory_of(compressor)
    ran = []
    for name, check, kwargs in CHECKS:
        check(factory, **kwargs)
        if name not in ran:
            ran.append(name)
    if distributed and check_distributed(factory):
        ran.append("distributed")
    return ran


# -- counting an exchange's operations and host reads ----------------------------------------------------------

#: aten operations (overload packets) that wait for the device on CUDA: they hand the host a value, or an
#: output whose size depends on the data.  ``nonzero_static`` does not (its size is given).
HOST_READ_OPS = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "equal", "bincount"})

#: Tensor methods that read a tensor's values into Python without dispatching an aten operation on CPU
#: (a CUDA tensor would first be copied to the host): counted as host reads while an OpCounter counts.
HOST_READ_METHODS = ("tolist", "numpy", "__array__")

_MISSING = object()


class _Local(threading.local):
    """This thread's active counters of each kind, and whether a counted Tensor method is running."""

    def __init__(self):
        self.counters: list = []  # OpCounters
        self.memory_counters: list = []
        self.reading = 0


_local = _Local()


class _Patches:
    """Attributes of ``owner`` replaced (``make(original)``, per name) while any counter of one kind is
    active on any thread, and put back when the last one exits."""

    _lock = threading.Lock()

    def __init__(self, owner, make: dict):
        self.owner, self.make = owner, make
        self.users = 0
        self.saved: dict = {}

    def acquire(self) -> None:
        with self._lock:
            if self.users == 0:
                for name, make in self.make.items():
                    self.saved[name] = vars(self.owner).get(name, _MISSING)
                    setattr(self.owner, name, make(getattr(self.owner, name)))
            self.users += 1

    def release(self) -> None:
        with self._lock:
            self.users -= 1
            if self.users == 0:
                for name, saved in self.saved.items():
                    if saved is _MISSING:
                        delattr(self.owner, name)
                    else:
                        setattr(self.owner, name, saved)
                self.saved.clear()


class _CountingMode(TorchDispatchMode):
    """A dispatch mode that also counts what dispatches nothing, through ``patches`` applied while it is
    active; it is listed, while active, in this thread's ``_local`` list named ``active``."""

    patches: _Patches
    active: str

    def __enter__(self):
        self.patches.acquire()
        try:
            entered = super().__enter__()
        except BaseException:
            self.patches.release()
            raise
        getattr(_local, self.active).append(self)
        return entered

    def __exit__(self, *exc_info):
        try:
            counters = getattr(_local, self.active)
            if self in counters:  # the innermost entry of this counter
                del counters[len(counters) - 1 - counters[::-1].index(self)]
            return super().__exit__(*exc_info)
        finally:
            self.patches.release()


def _off_cpu(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta")


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _host_read(func, args, kwargs) -> bool:
    """Whether this aten call waits for the device on CUDA (see :class:`OpCounter`)."""
    name = func.overloadpacket.__name__
    if name in HOST_READ_OPS or name.startswith(("unique", "_unique")):
        return True
    if name == "repeat_interleave":  # with a tensor of repeats the output size must be read, unless given
        repeats = args[1] if func._overloadname == "self_Tensor" and len(args) > 1 else args[0] if args else None
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "index":  # x[mask]: a boolean index is turned into positions (nonzero) inside the kernel
        return any(_is_mask(i) for i in (args[1] if len(args) > 1 else kwargs.get("indices", ())) or ())
    if name in ("index_put", "index_put_", "_index_put_impl", "_index_put_impl_"):
        # x[mask] = v: only a one-element value goes to masked_fill without reading the mask
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        value = args[2] if len(args) > 2 else kwargs.get("values")
        return any(_is_mask(i) for i in indices or ()) and not (isinstance(value, torch.Tensor) and value.numel() == 1)
    # Blocking copies from a device to the host (a non-blocking one, into pinned memory behind an event,
    # waits for nothing then: a read of it later is the caller's to order)
    if name == "_to_copy":
        device = kwargs.get("device")
        return (_off_cpu(args[0]) and device is not None and torch.device(device).type == "cpu"
                and not kwargs.get("non_blocking", False))
    if name == "copy_":
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (len(args) > 1 and _off_cpu(args[1]) and isinstance(args[0], torch.Tensor)
                and args[0].device.type == "cpu" and not non_blocking)
    if name in ("_copy_from", "_copy_from_and_resize"):
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return (len(args) > 1 and _off_cpu(args[0]) and isinstance(args[1], torch.Tensor)
                and args[1].device.type == "cpu" and not non_blocking)
    return False


def _counting_method(name: str, original):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        counters = _local.counters
        if not counters or _local.reading:
            return original(self, *args, **kwargs)
        for counter in counters:
            counter.host_reads[f"Tensor.{name}"] += 1
        _local.reading += 1  # __array__ calls numpy(): one read, and the aten calls inside it are not reads
        try:
            return original(self, *args, **kwargs)
        finally:
            _local.reading -= 1
    method._gradzip_counting = True
    return method


class OpCounter(_CountingMode):
    """Counts every aten operation dispatched on the thread that enters it, by overload packet
    (``"aten.add_"``), and the host reads among them: the operations that wait for the device on CUDA.

    Host reads (``host_reads``, by name): ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``),
    ``nonzero`` (not ``nonzero_static``), ``masked_select``, every ``unique*``/``_unique*``, ``equal``,
    ``bincount``, ``repeat_interleave`` with a tensor of repeats and no ``output_size``, indexing with a
    boolean mask (``x[mask]``; ``x[mask] = v`` unless ``v`` has one element: that is a masked_fill),
    blocking copies from a device to the CPU (not ``non_blocking`` ones into pinned memory), and the
    Tensor methods ``tolist``, ``numpy`` and ``__array__`` (``np.asarray(t)``), which dispatch no aten
    operation on CPU: while any OpCounter is active those methods are patched on ``torch.Tensor``
    (restored when the last one exits) and count for the active counters of the calling thread only.
    Everything is counted as it runs on CPU, where no read waits: the counts say what the same code
    would wait for on a GPU (a CPU-only route, e.g. through numpy, counts although CUDA would not take it).

    Only the operations that reach the dispatcher from Python are seen: views and ``detach`` count,
    the operations a kernel calls inside itself do not (a profiler counts those too).

    A fused kernel that the bucket route runs (:meth:`gradzip.kernels.Kernel.ahead`) counts as one
    operation, ``"fused:<kernel>"``.

    Dispatch modes are thread-local: ops on other threads (autograd's, a communication thread) are not
    counted; :func:`count_exchanges` enters a counter on whichever thread runs ``state.exchange``.
    """

    sees_fused_kernels = True

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.host_reads: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        """aten operations counted."""
        return sum(self.ops.values())

    @property
    def reads(self) -> int:
        """Host reads counted."""
        return sum(self.host_reads.values())

    def saw_fused_kernel(self, name: str, result) -> None:
        self.ops[f"fused:{name}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[str(func.overloadpacket)] += 1
        if not _local.reading and _host_read(func, args, kwargs):
            self.host_reads[str(func.overloadpacket)] += 1
        return func(*args, **kwargs)



class MemoryCounter(_CountingMode):
    """Bytes of the storages that operations dispatched inside the block (on the thread that enters it)
    allocate, while a tensor on them lives: ``peak`` is the most alive at once, ``live`` what is alive
    now.  Storages that existed before (an operation's inputs, in-place results) do not count.  Exact, not
    sampled: what the same code would ask a GPU's caching allocator for, before its rounding.  A fused
    kernel of the bucket route (:meth:`gradzip.kernels.Kernel.ahead`) counts its result's storage (the
    buffers it allocates inside itself are not seen).  ``torch.tensor`` of Python data dispatches no
    allocation (a layout's tables built from lists): while any MemoryCounter is active it is patched to
    count for the calling thread's counters.
    """

    sees_fused_kernels = True

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tensors: collections.Counter = collections.Counter()  # storage address -> live tensors on it
        self._sizes: dict[int, int] = {}
        self._lock = threading.Lock()  # a finaliser may run on another thread

    def _release(self, address: int) -> None:
        with self._lock:
            self._tensors[address] -= 1
            if not self._tensors[address]:
                del self._tensors[address]
                self.live -= self._sizes.pop(address)

    def saw_fused_kernel(self, name: str, result) -> None:
        self._allocated(result, set())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in _tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        self._allocated(out, inputs)
        return out

    def _allocated(self, out, inputs: set) -> None:
        """Count the storages of ``out``'s tensors that are new (not among ``inputs``) while they live."""
        for t in _tensors_in(out):
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
            with self._lock:
                if nbytes == 0 or (address in inputs and address not in self._sizes):
                    continue
                if address not in self._sizes:
                    self._sizes[address] = nbytes
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self._tensors[address] += 1
            weakref.finalize(t, self._release, address)


def _counting_tensor(made):
    """``torch.tensor`` that counts its result for this thread's active MemoryCounters."""
    @functools.wraps(made)
    def tensor(*args, **kwargs):
        t = made(*args, **kwargs)
        for counter in list(_local.memory_counters):
            counter._allocated(t, set())
        return t
    return tensor


OpCounter.patches, OpCounter.active = _Patches(torch.Tensor, {
    name: functools.partial(_counting_method, name) for name in HOST_READ_METHODS}), "counters"
MemoryCounter.patches, MemoryCounter.active = _Patches(torch, {"tensor": _counting_tensor}), "memory_counters"


def _tensors_in(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


#: Operations that launch no kernel: bare allocations and metadata (views and aliases are found by
#: their overloads: ``OpOverload.is_view``).
_NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided", "aten.detach",
              "aten.lift_fresh", "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset"}


def launching_ops(by_op) -> int:
    """Of ``by_op`` (``"aten.name"`` -> count, as :class:`OpCounter` counts them), the operations that would
    launch a kernel on a GPU: not views, aliases, bare allocations or metadata.  A proxy: on a GPU some
    operations launch several kernels (``topk``, ``cumsum``, ``sort``)."""
    def launches(name: str) -> bool:
        # A packet's tensor overloads are all views or none are (``slice``'s non-view ones take lists),
        # and the counts are by packet: any view overload makes it a view.
        packet = None if name.startswith("fused:") else getattr(torch.ops.aten, name.split(".", 1)[1], None)
        views = packet is not None and any(getattr(packet, o).is_view for o in packet.overloads())
        return name.startswith("fused:") or (name not in _NO_KERNEL and not views)
    return sum(count for name, count in by_op.items() if launches(name))


class ExchangeCount:
    """One counted ``state.exchange`` call: its ``tensors`` (gradients handed to it) and its counter."""

    def __init__(self, tensors: int, counter: OpCounter):
        self.tensors = tensors
        self.ops = counter.ops
        self.host_reads = counter.host_reads
        self.total = counter.total
        self.reads = counter.reads

    def __repr__(self):
        return f"ExchangeCount(tensors={self.tensors}, ops={self.total}, host_reads={self.reads})"


class ExchangeCounts:
    """What :func:`count_exchanges` saw: ``calls`` (one :class:`ExchangeCount` per ``state.exchange``
    call, i.e. per DDP bucket sent through gradzip's thread, in order) and ``plain``: buckets the DDP
    hook averaged with its own plain allreduce (``state.record_dense`` or ``record_plain``), which run no exchange and so
    count no operation here."""

    def __init__(self):
        self.calls: list[ExchangeCount] = []
        self.plain = 0
        self._lock = threading.Lock()

    def _add(self, call: ExchangeCount) -> None:
        with self._lock:
            self.calls.append(call)

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.plain = 0

    @property
    def exchanges(self) -> int:
        return len(self.calls)

    @property
    def ops(self) -> int:
        """aten operations over every counted exchange."""
        return sum(c.total for c in self.calls)

    @property
    def host_reads(self) -> int:
        """Host reads over every counted exchange."""
        return sum(c.reads for c in self.calls)

    @property
    def tensors(self) -> int:
        return sum(c.tensors for c in self.calls)

    def by_op(self) -> collections.Counter:
        """Operations by name over every counted exchange."""
        total: collections.Counter = collections.Counter()
        for c in self.calls:
            total.update(c.ops)
        return total

    def reads_by_op(self) -> collections.Counter:
        total: collections.Counter = collections.Counter()
        for c in self.calls:
            total.update(c.host_reads)
        return total

    def __repr__(self):
        return (f"ExchangeCounts(exchanges={self.exchanges}, plain={self.plain}, tensors={self.tensors}, "
                f"ops={self.ops}, host_reads={self.host_reads})")


@contextlib.contextmanager
def count_exchanges(state: GradzipState):
    """Within the block, every ``state.exchange(...)`` call runs inside its own :class:`OpCounter`, on
    whichever thread calls it (the DDP hook's exchanges run on the state's communication thread), and
    every plain allreduce the DDP hook runs itself is counted in ``plain``.  Yields an
    :class:`ExchangeCounts`; a call is recorded when it returns (or raises), so once a training step's
    backward has returned, its buckets are in ``calls``.

    Only the instance's attributes are patched (``exchange``, ``record_dense`` and ``record_plain``), and
    restored on exit.
    """
    counts = ExchangeCounts()
    saved = {name: vars(state).get(name, _MISSING) for name in ("exchange", "record_dense", "record_plain")}
    exchange, record_dense, record_plain = state.exchange, state.record_dense, state.record_plain

    @functools.wraps(exchange)
    def counted_exchange(named_grads, *args, **kwargs):
        counter = OpCounter()
        try:
            with counter:
                return exchange(named_grads, *args, **kwargs)
        finally:
            counts._add(ExchangeCount(len(named_grads), counter))

    @functools.wraps(record_dense)
    def counted_record_dense(*args, **kwargs):
        with counts._lock:
            counts.plain += 1
        return record_dense(*args, **kwargs)

    @functools.wraps(record_plain)
    def counted_record_plain(*args, **kwargs):
        with counts._lock:
            counts.plain += 1
        return record_plain(*args, **kwargs)

    state.exchange, state.record_dense, state.record_plain = counted_exchange, counted_record_dense, counted_record_plain
    try:
        yield counts
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                vars(state).pop(name, None)
            else:
                setattr(state, name, value)
