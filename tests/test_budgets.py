"""Budgets of a method's exchange per DDP bucket, counted on CPU.

Every registered method runs through the real DDP hook (one-process gloo group) on a small GPT at two
depths, all gradients in one bucket, and one step's exchange is counted with
:func:`gradzip.testing.count_exchanges` (an :class:`~gradzip.testing.OpCounter` entered on the thread
that runs ``state.exchange``: gradzip's communication thread):

- aten operations added per parameter tensor, (ops at depth 8 - ops at depth 2) / (tensors at depth 8
  - tensors at depth 2): at most 2, at most 6 for PowerSGD and 1-bit SGD;
- host reads per step (operations that wait for the device on CUDA: ``.item()``, ``nonzero``,
  ``tolist()``, ...): none for fixed-size methods; at most one per bucket for the methods whose payload
  size depends on the data (threshold, dropping, adaptive_threshold may read one count per bucket);
- operations per bucket that would launch a kernel on a GPU (:func:`gradzip.testing.launching_ops`), at
  depth 2: at most what each method dispatches today (``LAUNCHING``), so that a change that adds
  launches to a bucket fails here, where no GPU is needed to see it (the GPU issue's target is DDP's
  launches plus 40 per bucket; on a GPU an operation launches about 1.7 kernels).

Methods still over budget are listed in ``OVER_BUDGET`` (measured today) and expected to fail, strictly:
once a method meets its budgets its test fails until its entry is removed.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradzip
from gradzip.bench.kernels import BENCH_PARAMS
from gradzip.harness.data import DatasetInfo
from gradzip.harness.models import GPT
from gradzip.testing import OpCounter, count_exchanges, launching_ops

#: Methods over budget today (ops/tensor added per parameter tensor, host reads per step at depth 2 and 8).
OVER_BUDGET: dict = {}

#: Operations a method may add per parameter tensor; PowerSGD and 1-bit SGD get more.
OPS_PER_TENSOR = 2
OPS_PER_TENSOR_OF = {"powersgd": 6, "onebit": 6}
#: Launching operations per bucket at depth 2 today, case by case (budgets: lower them as methods improve).
LAUNCHING = {"none": 0, "fp16": 0, "bf16": 0, "topk": 30, "randomk": 34, "threshold": 26, "dropping": 61, "dgc": 116,
             "csc": 34, "adaptive_threshold": 90, "qsgd": 61, "terngrad": 70, "natural": 46, "onebit": 73,
             "signsgd": 32, "signum": 36, "efsignsgd": 34, "powersgd": 70, "auto": 30, "sparseloco": 58, "sketch": 111,
             "fp16:feedback=residual": 18, "bf16:feedback=residual": 14}
#: Methods whose payload size depends on the data: they may read one count per bucket.
DATA_SIZED = {"threshold", "dropping", "adaptive_threshold", "dgc"}
#: Methods whose buckets the DDP hook averages with its own plain allreduce: no exchange runs.
PLAIN = {"none", "fp16", "bf16"}

DEPTHS = (2, 8)
WARMUP_STEPS = 2  # DDP rebuilds its buckets after the first step; buffers are kept from the second
#: auto explores Top-k, decides on the next step, then moves the bucket to Top-k's route (rebuilding its flat
#: state from the per-tensor one: once); the step after that is what every later step costs.
WARMUP_STEPS_OF = {"auto": 4}
BUCKETS = 1  # bucket_cap_mb below puts every gradient in one bucket
INFO = DatasetInfo("budget", (16,), 64, "language_model")
#: auto, made to compress: Top-k its only candidate, one exploration step, the decision, then the choice.
AUTO_PARAMS = {"candidates": "topk:ratio=0.01", "warmup": 0, "trials": 1, "verify": 0}


def _cases() -> dict:
    """Test id -> (method, parameters): every registered method (DGC and PowerSGD as the kernel benchmark
    runs them, compressing from the first step), and fp16/bf16 with error feedback, which go through the
    exchange where their defaults take the hook's plain allreduce.  ``bucketed=True``: the bucket route
    where a method implements it, as on CUDA, where the state takes it by default (on CPU it does not)."""
    cases = {name: (name, dict(BENCH_PARAMS.get(name, {}))) for name in gradzip.compressors()}
    cases["auto"] = ("auto", dict(AUTO_PARAMS))
    for half in ("fp16", "bf16"):
        cases[f"{half}:feedback=residual"] = (half, {"feedback": "residual"})
    return {case: (method, {**params, "bucketed": True}) for case, (method, params) in cases.items()}


CASES = _cases()


class Step:
    """One depth's counted step."""

    def __init__(self, depth, tensors, counts):
        self.depth = depth
        self.tensors = tensors  # the model's parameter tensors
        self.exchanges = counts.exchanges
        self.plain = counts.plain
        self.exchanged = counts.tensors  # gradients handed to state.exchange
        self.ops = counts.ops
        self.host_reads = counts.host_reads
        self.by_op = counts.by_op()
        self.reads_by_op = counts.reads_by_op()


def _measure(method: str, params: dict, depth: int) -> Step:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = GPT(INFO, layers=depth, width=32, heads=4)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1024)
    state = gradzip.register(ddp, method, **params)
    try:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(depth)

        def step():
            x = torch.randint(0, INFO.num_classes, (4, INFO.input_shape[0] + 1), generator=g)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x[:, :-1]).reshape(-1, INFO.num_classes), x[:, 1:].reshape(-1)).backward()
            opt.step()

        for _ in range(WARMUP_STEPS_OF.get(method, WARMUP_STEPS)):
            step()
        with count_exchanges(state) as counts:
            step()  # backward returns once DDP's future for the bucket is done: the exchange is recorded
        return Step(depth, len(list(model.parameters())), counts)
    finally:
        state.close()


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """case -> {depth: Step}, measured once per case in a one-process gloo group."""
    created = False
    if not dist.is_initialized():
        store = dist.FileStore(str(tmp_path_factory.mktemp("budgets") / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        created = True
    elif dist.get_world_size() != 1:
        pytest.skip("a process group of several ranks is already initialised in this process")
    cache: dict = {}

    def get(case):
        if case not in cache:
            method, params = CASES[case]
            cache[case] = {depth: _measure(method, params, depth) for depth in DEPTHS}
        return cache[case]

    yield get
    if created:
        dist.destroy_process_group()


def _top(counter, n=6) -> str:
    return ", ".join(f"{name} {count}" for name, count in counter.most_common(n)) or "none"


@pytest.mark.parametrize("case", list(CASES))
def test_exchange_is_counted(case, measured):
    """The counted step ran: one bucket, through gradzip's exchange (or, for the methods that take it,
    the hook's plain allreduce, which runs no exchange), with every gradient, and ops were seen."""
    for depth, step in measured(case).items():
        where = f"{case} at depth {depth}"
        if case in PLAIN:
            assert (step.plain, step.exchanges, step.ops) == (BUCKETS, 0, 0), (
                f"{where}: expected the hook's plain allreduce of the bucket, got {step.plain} plain allreduces, "
                f"{step.exchanges} exchanges")
            continue
        assert (step.exchanges, step.plain) == (BUCKETS, 0), (
            f"{where}: {step.exchanges} exchanges and {step.plain} plain allreduces in one step, expected "
            f"{BUCKETS} exchange")
        assert step.exchanged == step.tensors, f"{where}: the exchange got {step.exchanged} of {step.tensors} gradients"
        assert step.ops > 0, f"{where}: the counter saw no operation in the exchange"
    a, b = (measured(case)[d] for d in DEPTHS)
    assert b.tensors > a.tensors, "the deeper model must have more parameter tensors"


def _budget_marks(case):
    if case in OVER_BUDGET:
        # raises=AssertionError: a crash is a failure, not an expected one
        return [pytest.mark.xfail(strict=True, raises=AssertionError, reason=OVER_BUDGET[case])]
    return []


@pytest.mark.parametrize("case", [pytest.param(c, marks=_budget_marks(c)) for c in CASES])
def test_budget(case, measured):
    """Operations added per parameter tensor and host reads per step within the method's budget."""
    method = CASES[case][0]
    steps = measured(case)
    a, b = (steps[d] for d in DEPTHS)
    per_tensor = (b.ops - a.ops) / (b.tensors - a.tensors)
    ops_limit = OPS_PER_TENSOR_OF.get(method, OPS_PER_TENSOR)
    reads_limit = BUCKETS if method in DATA_SIZED else 0
    problems = []
    if per_tensor > ops_limit:
        problems.append(f"{per_tensor:.1f} aten ops added per parameter tensor > {ops_limit} ({a.ops} ops/step at "
                        f"{a.tensors} tensors, {b.ops} at {b.tensors}; at depth {b.depth}: {_top(b.by_op)})")
    for step in (a, b):
        if step.host_reads > reads_limit:
            problems.append(f"{step.host_reads} host reads/step at depth {step.depth} > {reads_limit} "
                            f"({_top(step.reads_by_op)})")
    assert not problems, f"{case}: " + "; ".join(problems)


@pytest.mark.parametrize("case", list(CASES))
def test_launching_operations_per_bucket(case, measured):
    """The bucket's operations that would launch a GPU kernel stay within what the method dispatches
    today (a method registered later gets its count here when it lands)."""
    step = measured(case)[DEPTHS[0]]
    launches = launching_ops(step.by_op) / BUCKETS
    assert case in LAUNCHING, f"{case}: no launch budget in LAUNCHING (it dispatches {launches:g} a bucket)"
    assert launches <= LAUNCHING[case], (f"{case}: {launches:g} launching operations a bucket > {LAUNCHING[case]} "
                                         f"({_top(step.by_op)})")


def test_launching_counts_skip_views_and_allocations():
    """Views (``select.int``, ``slice.Tensor``, ``view``), aliases and bare allocations launch nothing;
    arithmetic, copies and reductions do."""
    x = torch.arange(12.0)
    with OpCounter() as counter:
        y = x.view(3, 4)[1]  # view, select
        z = x[2:5]  # slice
        torch.empty(3)
        (y + 1).sum()  # add, sum
        z.clone()  # clone
    assert launching_ops(counter.ops) == 3, dict(counter.ops)


def test_over_budget_names_known_cases():
    assert set(OVER_BUDGET) <= set(CASES), f"OVER_BUDGET names unknown cases: {set(OVER_BUDGET) - set(CASES)}"


# -- the counter itself ---------------------------------------------------------------------------------------


def test_op_counter_counts_ops_and_host_reads():
    x = torch.arange(6.0)
    with OpCounter() as counter:
        y = x + 1
        y.mul_(2)
        total = y.sum()
        total.item()
        y.tolist()
    assert dict(counter.ops) == {"aten.add": 1, "aten.mul_": 1, "aten.sum": 1, "aten._local_scalar_dense": 1}
    assert counter.total == 4
    assert dict(counter.host_reads) == {"aten._local_scalar_dense": 1, "Tensor.tolist": 1}
    assert counter.reads == 2


def test_op_counter_host_reads():
    x = torch.arange(6.0)
    mask = x > 2
    reads = {
        "item": lambda: x[1].item(),
        "bool": lambda: bool(x[1] > 0),
        "nonzero": lambda: x.nonzero(),
        "masked_select": lambda: x.masked_select(mask),
        "unique": lambda: x.unique(),
        "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        "mask index": lambda: x[mask],
        "mask put": lambda: x.clone().__setitem__(mask, torch.ones(3)),
        "equal": lambda: torch.equal(x, x),
        "numpy": lambda: x.numpy(),
        "asarray": lambda: np.asarray(x),
        "tolist": lambda: x.tolist(),
    }
    for what, fn in reads.items():
        with OpCounter() as counter:
            fn()
        assert counter.reads == 1, f"{what}: {dict(counter.host_reads)}"
    free = {
        "nonzero_static": lambda: x.nonzero_static(size=3),
        "repeat_interleave with output_size": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
        "repeat_interleave by an int": lambda: x.repeat_interleave(2),
        "masked fill by index": lambda: x.clone().__setitem__(mask, 0.0),
        "arithmetic": lambda: (x * 2).sum(),
    }
    for what, fn in free.items():
        with OpCounter() as counter:
            fn()
        assert counter.total > 0 and counter.reads == 0, f"{what}: {dict(counter.host_reads)}"


def test_op_counter_is_thread_local_and_restores_tensor_methods():
    originals = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy", "__array__")}
    x = torch.arange(4.0)
    other = threading.Thread(target=lambda: (x + 1, x.tolist(), x.sum().item()))
    with OpCounter() as counter:
        other.start()
        other.join()
    assert counter.total == 0 and counter.reads == 0, "another thread's ops were counted"
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals
    with pytest.raises(RuntimeError):
        with OpCounter():
            raise RuntimeError("restored on errors too")
    assert {name: torch.Tensor.__dict__.get(name) for name in originals} == originals
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_count_exchanges_counts_on_the_communication_thread():
    """Every exchange call is counted, also when it runs on the state's own thread (submit, as the DDP
    hook does), and the instance is left as it was."""
    state = gradzip.GradzipState("topk", ratio=0.5)
    try:
        named = [("a", torch.randn(10)), ("b", torch.randn(3, 4))]
        with count_exchanges(state) as counts:
            state.exchange(named)
            state.submit(named, lambda aggregates: aggregates).wait()
        assert counts.exchanges == 2 and counts.plain == 0 and counts.tensors == 4
        assert all(call.total > 0 for call in counts.calls)
        assert counts.ops == sum(counts.by_op().values())
        assert "exchange" not in vars(state) and "record_dense" not in vars(state)
        state.exchange(named)
        assert counts.exchanges == 2, "counted after the block"
    finally:
        state.close()
