"""The bucket route (gradzip/buckets.py): every method that implements ``bucket_exchange`` against its own
per-tensor route, across ranks, with non-finite inputs, through a checkpoint, and its exact wire bytes."""
from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import gradzip
from gradzip import kernels
from gradzip.compressors import compressors, make
from gradzip.compressors.bucket import BucketLayout
from gradzip.state import GradzipState

from .workers import run_threads

BUCKETED = sorted(name for name in compressors() if make(name).bucketed)
#: (method, parameters): each bucketed method with its default feedback, and the variants that change
#: what it sends.
CASES = [(name, {}) for name in BUCKETED] + [
    ("fp16", {"feedback": "residual"}), ("bf16", {"feedback": "residual"}), ("topk", {"ratio": 0.3}),
    ("topk", {"ratio": 0.9}), ("topk", {"value_dtype": "float16"}), ("topk", {"feedback": "none"}),
    ("efsignsgd", {"feedback": "none"}), ("powersgd", {"dense_steps": 0}), ("powersgd", {"dense_steps": 0, "rank": 1}),
    ("powersgd", {"dense_steps": 0, "feedback": "none"}), ("powersgd", {"dense_steps": 2, "warm_start": False}),
    ("qsgd", {"bucket_size": 16, "levels": 7}), ("qsgd", {"levels": 3, "norm": "max"}), ("qsgd", {"levels": 300, "bucket_size": 7}),
    ("qsgd", {"levels": 15, "feedback": "residual"}), ("terngrad", {"clip": None}), ("terngrad", {"feedback": "residual"}),
    ("natural", {"feedback": "residual"}),
    ("signsgd", {"scaled": False}), ("signsgd", {"zeros": "plus"}), ("signsgd", {"scaled": False, "zeros": "plus"}),
    ("signsgd", {"feedback": "residual"}), ("signum", {"zeros": "plus"}), ("signum", {"scaled": False, "zeros": "plus"}),
    ("signum", {"beta": 0.5, "feedback": "residual"}), ("onebit", {"feedback": "none"}),
    ("randomk", {"ratio": 0.9, "unbiased": True}), ("randomk", {"ratio": 0.5, "value_dtype": "float16"}),
    ("threshold", {"tau": 1.5}), ("threshold", {"tau": 1.0, "value_dtype": "float16"}),
    ("threshold", {"tau": 1.0, "feedback": "none"}), ("dropping", {"drop_ratio": 0.5, "sample_ratio": 0.25}),
    ("adaptive_threshold", {"ratio": 0.3}), ("adaptive_threshold", {"ratio": 1.0, "feedback": "none"}),
    ("sparseloco", {"chunk": 16}), ("sparseloco", {"chunk": 7, "density": 0.3}), ("sparseloco", {"decay": 0.5, "density": 1.0}),
    ("sketch", {"ratio": 0.1, "rows": 3, "width": 2.0}), ("sketch", {"rows": 20, "width": 1.0}), ("sketch", {"feedback": "none"}),
    ("dgc", {"min_numel": 0, "warmup_epochs": 0, "ratio": 0.3}), ("dgc", {"min_numel": 100, "ratio": 0.1, "nesterov": True, "clip_norm": 1.0}),
    ("dgc", {"min_numel": 0, "ratio": 0.3, "feedback": "residual"}), ("dgc", {"min_numel": 0, "ratio": 0.1, "value_dtype": "float16", "warmup_epochs": 0}),
    ("csc", {"chunk_size": 7, "ratio": 0.3}), ("csc", {"feedback": "momentum", "chunk_size": 8, "ratio": 0.2}),
    ("csc", {"chunk_size": 16, "ratio": 0.5, "value_dtype": "float16"}), ("csc", {"feedback": "none", "chunk_size": 3, "ratio": 0.5})]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items()) or 'default'}" for name, params in CASES]
#: Methods whose per-tensor quantities are float sums (a scale, a norm): equal to the per-tensor route
#: up to the order of those sums, not bit for bit.
SUM_ORDER = {"efsignsgd": 1e-6, "powersgd": 2e-5,  # absolute tolerance: what float sums in another order give
             "signsgd": 1e-6, "signum": 1e-6, "adaptive_threshold": 1e-6, "sparseloco": 1e-6}
#: Methods that draw at random: the bucket route draws by counter (kernels.counter_uniforms), the
#: per-tensor route from a generator per tensor, so the two are compared in expectation instead.
RANDOM = {name for name in BUCKETED if not make(name).deterministic}
#: Odd shapes in one bucket: matrices of one size (one size class), vectors, 0-d, empty, one element.
SHAPES = [(8, 40), (40,), (8, 40), (3, 3, 2), (), (0,), (1,), (40,), (5, 8)]


def _same_starting_state(states, dtype) -> None:
    """The same random values of each method-own state (PowerSGD's bases, a momentum) in every state:
    each route draws its first ones differently (by counter, or from a generator per tensor)."""
    _, named = _bucket(dtype)
    layout = BucketLayout([k for k, _ in named], [g.shape for _, g in named], dtype, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    for name, shapes in states[0].compressor.bucket_state_shapes(layout, 10**9).items():
        for key, shape in zip(layout.keys, shapes):
            if shape is not None:
                value = torch.randn(shape, generator=gen)
                for state in states:
                    state.tensors.setdefault(key, {})[name] = value.clone()


def test_the_methods_with_a_bucket_route():
    assert {"none", "fp16", "bf16", "topk", "efsignsgd"} <= set(BUCKETED)


def _bucket(dtype=torch.float32, seed=0, scale=1.0):
    """A flat buffer and its tensors' views, as DDP hands them over."""
    gen = torch.Generator().manual_seed(seed)
    numels = [torch.Size(s).numel() for s in SHAPES]
    flat = (torch.randn(sum(numels), generator=gen) * scale).to(dtype)
    views = [v.view(s) for v, s in zip(torch.split(flat, numels), SHAPES)]
    return flat, [(f"layer{i}", v) for i, v in enumerate(views)]


def _pair(name, params, **kw):
    return GradzipState(name, bucketed=True, **params, **kw), GradzipState(name, bucketed=False, **params, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_bucket_route_equals_the_per_tensor_route(name, params, dtype):
    """Aggregates and residuals over several steps, into DDP's views and into fresh tensors: equal to
    each tensor's own exchange up to the order of float sums (a per-tensor scale's sum)."""
    if name in RANDOM or params.get("warm_start") is False:
        pytest.skip("random draws differ by route: test_random_methods_are_unbiased_on_the_bucket_route")
    bucketed, reference = _pair(name, params)
    fresh = GradzipState(name, bucketed=True, **params)
    _same_starting_state((bucketed, reference, fresh), dtype)
    exact = name not in SUM_ORDER
    for step in range(4):
        _, named = _bucket(dtype, seed=step)
        expected = reference.exchange([(k, g.clone()) for k, g in named])
        given = [(k, g.clone()) for k, g in named]
        unlent = fresh.exchange(given)
        bucketed.exchange(named, out=[g for _, g in named])
        assert bucketed.last_report is not None and len(bucketed._route.buckets) == 1  # the bucket route ran
        for (key, g), want, other in zip(named, expected, unlent):
            assert g.dtype == dtype and other.shape == want.shape
            if exact:
                assert torch.equal(g, want) and torch.equal(other, want), (key, step)
            else:
                # a last-bit difference in fp32 can cross a rounding boundary of bf16 outputs
                rtol = 1e-5 if dtype == torch.float32 else 2**-7
                torch.testing.assert_close(g.float(), want.float(), rtol=rtol, atol=SUM_ORDER[name])
                assert torch.equal(other, g), key  # the same route, into other memory: the same bits
    for key in reference.tensors:
        mine, theirs = bucketed.tensors.get(key, {}).get("residual"), reference.tensors[key].get("residual")
        if theirs is None or not theirs.numel():
            continue
        assert mine.shape == theirs.shape and mine.dtype == theirs.dtype
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0 if exact else 1e-5)
    assert bucketed.steps == reference.steps


#: Layouts the bucket's own shapes never make: three matrices of one shape at unequal distances (a size
#: class no strided view holds: stacked instead), one tensor alone, a bucket ending in empty tensors.
ODD_LAYOUTS = {"unequal-distances": [(8, 40), (40,), (8, 40), (3,), (8, 40), (5, 8)], "one-tensor": [(8, 40)],
               "ending-empty": [(5,), (8, 40), (0,), (0,)]}


@pytest.mark.parametrize("layout", list(ODD_LAYOUTS))
@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_odd_layouts_equal_the_per_tensor_route(name, params, layout, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", ODD_LAYOUTS[layout])
    test_bucket_route_equals_the_per_tensor_route(name, params, torch.float32)


@pytest.mark.parametrize("layout", list(ODD_LAYOUTS))
@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_odd_layouts_keep_ranks_bit_identical(name, params, layout, monkeypatch):
    """Ranks whose counts differ pad what they send (the data-sized methods): on these layouts too."""
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", ODD_LAYOUTS[layout])
    test_ranks_agree_bit_for_bit_and_average(name, params)


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.01}), ("threshold", {"tau": 2.0}),
                                          ("adaptive_threshold", {"ratio": 0.01})], ids=["topk", "threshold", "adaptive"])
def test_a_bucket_past_16_bit_positions_equals_the_per_tensor_route(name, params, monkeypatch):
    """In a bucket of more than 2^15 elements positions travel as int32, which the receivers add at as
    they come (narrower ones are widened first)."""
    monkeypatch.setattr(sys.modules[__name__], "SHAPES", [(300, 120), (40,), (5, 8)])
    bucketed, reference = _pair(name, params)
    for step in range(2):
        _, named = _bucket(seed=step)
        expected = reference.exchange([(k, g.clone()) for k, g in named])
        bucketed.exchange(named, out=[g for _, g in named])
        assert len(bucketed._route.buckets) == 1
        for (key, g), want in zip(named, expected):
            torch.testing.assert_close(g, want, rtol=0, atol=SUM_ORDER.get(name, 0))


@pytest.mark.parametrize("name, params", [c for c in CASES if c[0] in RANDOM] or [pytest.param(None, None, marks=pytest.mark.skip("no random method is bucketed yet"))])
def test_random_methods_are_unbiased_on_the_bucket_route(name, params):
    """A random method's mean aggregate over many steps (fresh draws each step, as the step counter
    moves) equals the per-tensor route's, whose draws come from a generator per tensor: the same
    expectation (TernGrad's clipping bias included), within 6 standard errors of their difference; and
    the draws differ from step to step."""
    flat, named = _bucket(seed=3)
    steps, means, variances = 400, [], []
    for bucketed in (True, False):
        state = GradzipState(name, bucketed=bucketed, **params)
        outs = torch.stack([torch.cat([o.reshape(-1) for o in state.exchange(named)]) for _ in range(steps)]).double()
        means.append(outs.mean(0))
        variances.append(outs.var(0))
        assert not torch.equal(outs[0], outs[1])
    bound = 6 * ((variances[0] + variances[1]) / steps).sqrt() + 1e-3 * (1 + flat.double().abs())
    assert bool(((means[0] - means[1]).abs() <= bound).all()), ((means[0] - means[1]).abs() - bound).max()


@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_payload_bytes_are_the_bucket_formula(name, params):
    state = GradzipState(name, bucketed=True, **params)
    for _ in range(getattr(state.compressor, "dense_steps", 0)):  # methods that send densely at first
        state.exchange(_bucket()[1])
    _, named = _bucket()
    state.exchange(named)
    layout = BucketLayout([k for k, _ in named], [g.shape for _, g in named], torch.float32, torch.device("cpu"))
    assert state.last_report.payload_bytes == state.compressor.bucket_payload_bytes(layout)
    assert state.stats()["exchanges"] == 1 + getattr(state.compressor, "dense_steps", 0)


@pytest.mark.parametrize("name, params", [c for c in CASES if make(c[0], **c[1]).feedback == "residual"],
                         ids=[i for c, i in zip(CASES, IDS) if make(c[0], **c[1]).feedback == "residual"])
def test_residual_conserves_what_was_not_sent(name, params):
    """At world size 1 the aggregate is what was sent: sent + new residual == g + old residual."""
    state = GradzipState(name, bucketed=True, **params)
    owed = None
    for step in range(3):
        flat, named = _bucket(seed=step)
        g = flat.clone()
        state.exchange(named, out=[v for _, v in named])
        residual = torch.cat([state.tensors[k]["residual"].reshape(-1) for k, _ in named])
        p = g if owed is None else g + owed
        torch.testing.assert_close(flat + residual, p, rtol=0, atol=2e-6)
        owed = residual.clone()


@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_ranks_agree_bit_for_bit_and_average(name, params):
    world = 3

    def rank_run(rank, transport):
        state = GradzipState(name, bucketed=True, transport=transport, **params)
        outs = []
        for step in range(3):
            _, named = _bucket(seed=10 * step + rank)
            state.exchange(named, out=[g for _, g in named])
            outs.append(torch.cat([g.reshape(-1) for _, g in named]))
        return outs

    results = run_threads(world, rank_run)
    for step in range(3):
        for other in results[1:]:
            assert torch.equal(results[0][step], other[step])
    if name in ("none", "fp16", "bf16") and params.get("feedback", "none") == "none":  # the mean itself
        inputs = torch.stack([_bucket(seed=20 + r)[0] for r in range(world)])
        # each rank's x / N rounded once, and the half sum rounded at each addition
        tol = {"none": 1e-6, "fp16": 2e-3, "bf16": 2e-2}[name]
        torch.testing.assert_close(results[0][2], inputs.mean(0), rtol=tol, atol=tol)


@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_a_nonfinite_rank_poisons_every_rank_and_commits_nothing(name, params):
    def rank_run(rank, transport):
        state = GradzipState(name, bucketed=True, transport=transport, **params)
        _, named = _bucket(seed=rank)
        state.exchange(named, out=[g for _, g in named])
        before = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state.tensors.items()}
        _, named = _bucket(seed=5 + rank)
        if rank == 1:
            named[2][1][3, 7] = float("nan")
        state.exchange(named, out=[g for _, g in named])
        poisoned = all(bool(torch.isnan(g).all()) for _, g in named if g.numel())
        kept = all(torch.equal(before[k][n], v) for k, slot in state.tensors.items() for n, v in slot.items())
        saved = state.state_dict()
        return poisoned, kept, saved["steps"], state.stats()["nonfinite_exchanges"]

    for poisoned, kept, steps, skipped in run_threads(2, rank_run):
        assert poisoned and kept and skipped == 1
        assert set(steps.values()) == {1}  # the skipped step was taken back


def test_an_overflowing_fp16_payload_poisons_the_step():
    """A finite input whose fp16 payload overflows, without error feedback (with it the value is sent
    saturated: tests/test_amp.py): the aggregate is not finite, so the step is skipped."""
    state = GradzipState("fp16", bucketed=True)
    _, named = _bucket()
    state.exchange(named)
    _, named = _bucket(seed=1)
    named[0][1][0, 0] = 1e6
    out = state.exchange(named)
    assert all(bool(torch.isnan(o).all()) for o in out if o.numel())
    assert bool(state.last_report.nonfinite)  # the report says so too (DiLoCo's outer step reads it)
    assert state.stats()["nonfinite_exchanges"] == 1 and state.steps["layer0"] == 1


@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_an_aggregate_that_overflows_16_bit_gradients_poisons_the_step(name, params):
    """float16 gradients, one tensor at 60000: an aggregate that rounds to infinity cast back into them
    (QSGD's levels scale by the tensor's norm, 120000 here) poisons the step and commits nothing, on either
    route; any other comes back finite.  The bucket route computes in float32: it once wrote such an
    aggregate into the gradients as Inf, counted nothing and committed the state."""
    outcomes = {}
    for route, state in zip(("bucket", "per-tensor"), _pair(name, params)):
        _, named = _bucket(torch.float16)
        state.exchange(named)
        before = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state.tensors.items()}
        _, named = _bucket(torch.float16, seed=1)
        named[0][1].fill_(60000.0)
        out = [o for o in state.exchange(named) if o.numel()]
        poisoned = state.stats()["nonfinite_exchanges"] == 1
        if poisoned:
            assert all(bool(o.isnan().all()) for o in out), f"{route}: a skipped step not NaN everywhere"
            assert all(torch.equal(before[k][n], v) for k, slot in state.tensors.items() for n, v in slot.items()), (
                f"{route}: a skipped step committed state")
        else:
            assert all(bool(o.isfinite().all()) for o in out), f"{route}: Inf written, the step not skipped"
        outcomes[route] = poisoned
    if name not in RANDOM:
        assert outcomes["bucket"] == outcomes["per-tensor"], outcomes
    if (name, params) in (("qsgd", {}), ("powersgd", {"dense_steps": 0, "feedback": "none"})):
        assert outcomes == {"bucket": True, "per-tensor": True}, outcomes  # the case is one that overflows


@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_resumed_state_continues_bit_for_bit(name, params):
    whole = GradzipState(name, bucketed=True, **params)
    first = GradzipState(name, bucketed=True, **params)
    for step in range(2):
        for state in (whole, first):
            _, named = _bucket(seed=step)
            state.exchange(named, out=[g for _, g in named])
    saved = first.state_dict()
    resumed = GradzipState(name, bucketed=True, **params)
    resumed.load_state_dict(saved)
    for step in range(2, 4):
        _, a = _bucket(seed=step)
        _, b = _bucket(seed=step)
        whole.exchange(a, out=[g for _, g in a])
        resumed.exchange(b, out=[g for _, g in b])
        assert all(torch.equal(x, y) for (_, x), (_, y) in zip(a, b))
    assert whole.state_dict()["steps"] == resumed.state_dict()["steps"]


def test_a_regrouped_bucket_keeps_each_tensors_residual():
    """DDP regroups its buckets after the first step: the residuals follow their keys."""
    state = GradzipState("topk", bucketed=True, ratio=0.1)
    _, named = _bucket()
    state.exchange(named)
    state.record_bucket(named, exchanges=1)  # as DDP's hook does
    owed = {k: v["residual"].clone() for k, v in state.tensors.items()}
    _, again = _bucket(seed=1)
    halves = [again[:4], again[4:]]
    reference = GradzipState("topk", bucketed=False, ratio=0.1)
    reference.exchange([(k, g.clone()) for k, g in named])
    for half in halves:
        for key, _ in half:
            torch.testing.assert_close(state.tensors[key]["residual"], owed[key], rtol=0, atol=0)
        got = state.exchange(half)
        want = reference.exchange([(k, g.clone()) for k, g in half])
        assert all(torch.equal(x, y) for x, y in zip(got, want))
        state.record_bucket(half, exchanges=1)
    assert len(state._route.buckets) == 2
    # the first step's bucket, regrouped since, took the bucket route all the same (also once a state is loaded)
    assert [b["route"] for b in state.describe()["buckets"]] == ["bucket"] * 3
    state.load_state_dict(state.state_dict())
    assert [b["route"] for b in state.describe()["buckets"]] == ["bucket"] * 3


def test_a_regrouped_bucket_still_takes_back_its_skipped_step():
    """DDP regroups its buckets after the first step, which fp16 AMP most often skips: the skip of the
    bucket that goes is learnt all the same (steps taken back, counted), as on the per-tensor route."""
    for bucketed in (True, False):
        state = GradzipState("topk", bucketed=bucketed, ratio=0.1)
        _, named = _bucket()
        named[0][1][0, 0] = float("nan")
        state.exchange(named)
        _, again = _bucket(seed=1)
        for half in (again[:4], again[4:]):
            state.exchange(half)
        assert state.stats()["nonfinite_exchanges"] == 1, bucketed
        assert set(state.state_dict()["steps"].values()) == {1}, bucketed


def _end_to_end(named: list) -> tuple:
    """(one flat run of the gradients, views of it named and shaped as they are), as DDP's bucket views."""
    run = torch.cat([g.reshape(-1) for _, g in named])
    views, at = [], 0
    for key, g in named:
        views.append((key, run[at:at + g.numel()].view(g.shape)))
        at += g.numel()
    return run, views


def _apart_end_to_end(named: list) -> list:
    """The same gradients, each in a storage of its own, lying end to end in memory (as a GPU's caching
    allocator cuts separate tensors from one segment)."""
    flat = torch.cat([g.reshape(-1) for _, g in named]).numpy()
    apart, at = [], 0
    for key, g in named:
        apart.append((key, torch.from_numpy(flat[at:at + g.numel()]).view(g.shape)))
        at += g.numel()
    return apart


def test_gradients_apart_but_end_to_end_are_copied_not_viewed():
    """A view over the first gradient's storage serves only gradients within it; and a gradient moved
    between exchanges, however the others lie, is read where it now is."""
    state, reference = GradzipState("topk", bucketed=True, ratio=0.3), GradzipState("topk", bucketed=False, ratio=0.3)
    for step in range(3):
        named = [(k, g) for k, g in _bucket(seed=step)[1] if g.numel()]  # an empty tensor's data_ptr is 0: no run
        apart = _apart_end_to_end(named)
        assert len({g.untyped_storage().data_ptr() for _, g in apart}) > 1
        got = state.exchange(apart)
        assert all(torch.equal(x, y) for x, y in zip(got, reference.exchange(named)))
    named = [(k, g) for k, g in _bucket(seed=3)[1] if g.numel()]
    _, views = _end_to_end(named)
    moved = [(k, g) for k, g in views]
    for _ in range(2):  # one run, then its third tensor elsewhere with the first and last where they were
        got = state.exchange(moved)
        assert (_ == 0) == (state._route.buckets[tuple(k for k, _ in named)].input_at is not None)  # a view, then not
        assert all(torch.equal(x, y) for x, y in zip(got, reference.exchange([(k, g.clone()) for k, g in moved])))
        moved[2] = (moved[2][0], moved[2][1] + 1.0)


def test_a_run_with_empty_gradients_is_still_viewed(monkeypatch):
    """Empty gradients in DDP's bucket (first, or among the others) hold no data and have no address
    (``data_ptr`` 0): the others still lie end to end, and the input is a view of them."""
    from gradzip import buckets
    named = _bucket(seed=4)[1]  # an empty tensor among them
    named = [("first", torch.empty(0))] + named
    run, views = _end_to_end(named)
    state, reference = GradzipState("topk", bucketed=True, ratio=0.3), GradzipState("topk", bucketed=False, ratio=0.3)
    want = reference.exchange([(k, g.clone()) for k, g in views])
    flat, seen = buckets._Bucket.flat_input, []
    monkeypatch.setattr(buckets._Bucket, "flat_input", lambda self, grads: seen.append(flat(self, grads)) or seen[-1])
    got = state.exchange(views)
    assert seen[0].data_ptr() == run.data_ptr() and all(torch.equal(x, y) for x, y in zip(got, want))


def test_cpu_gradients_keep_the_per_tensor_route_by_default():
    state = GradzipState("topk")
    _, named = _bucket()
    state.exchange(named)
    assert not state._route.buckets
    with pytest.raises(ValueError, match="bucketed must be"):
        GradzipState("topk", bucketed="yes")


def test_methods_without_a_bucket_route_keep_the_per_tensor_route():
    class PerTensorTopK(type(make("topk"))):
        bucketed = False

    state = GradzipState(PerTensorTopK(), bucketed=True)
    _, named = _bucket()
    state.exchange(named)
    assert not state._route.buckets and state.steps["layer0"] == 1
    grouped = GradzipState("topk", bucketed=True, group_vectors_below=64)
    grouped.exchange(_bucket()[1])
    assert not grouped._route.buckets


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-process gloo group, as a DDP job of one rank has."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loss(model, step):
    return model(torch.randn(8, 16, generator=torch.Generator().manual_seed(step))).square().sum()


def test_register_takes_bucketed(one_rank_group):
    """A real DDP hook (one-process gloo group) on the bucket route: the step's gradients are the
    per-tensor route's."""
    grads = {}
    for bucketed in (True, False):
        model = _small_model()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = gradzip.register(ddp, "topk", ratio=0.1, bucketed=bucketed)
        for step in range(3):
            ddp.zero_grad()
            _loss(ddp, step).backward()
        grads[bucketed] = [p.grad.clone() for p in model.parameters()]
        assert bool(state._route.buckets) == bucketed
        state.close()
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))


@pytest.mark.parametrize("name", ["topk", "efsignsgd", "signsgd"])  # deterministic: the same draws either way
def test_the_optimizer_wrapper_and_diloco_take_the_bucket_route(name, one_rank_group):
    """DistributedOptimizer's buckets and DiLoCo's pseudo-gradients go through GradzipState.exchange, so
    they take the bucket route too: the same parameters as the per-tensor route (up to sum order)."""
    finals = {}
    for bucketed in (True, False):
        model = _small_model()
        opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                                           name, bucketed=bucketed)
        diloco = gradzip.DiLoCo(model, opt, sync_every=2, compressor=name)
        diloco.state.bucketed = bucketed  # as on CUDA, where it is the default
        for step in range(4):
            opt.zero_grad()
            _loss(model, step).backward()
            opt.step()
            diloco.step()
        assert bool(opt.gradzip_state._route.buckets) == bool(diloco.state._route.buckets) == bucketed
        finals[bucketed] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(finals[True], finals[False], rtol=1e-5, atol=1e-6)


def test_no_kernel_compiles_in_a_bucket_exchange(monkeypatch):
    """A fused kernel's first compile takes seconds: the bucket route takes only kernels compiled ahead
    (``Kernel.ahead``, tests/test_ahead_kernels.py), never one compiled on its first call (``run``), even
    where the thresholds would let the kernels run (the per-tensor route then runs them)."""
    from gradzip import devices, kernels

    monkeypatch.setattr(devices, "runs_kernels_ahead", lambda where: True)  # a GPU's form: kernels ahead asked for
    monkeypatch.setattr(kernels, "MIN_NUMEL", 1)
    monkeypatch.setattr(kernels, "LARGE_NUMEL", 1)
    calls, ahead = [], []
    for kernel in kernels.KERNELS:
        monkeypatch.setattr(kernel, "min_numel", 1)
        monkeypatch.setattr(kernel, "run", lambda *args, _k=kernel, **static: calls.append(_k.__name__))
        monkeypatch.setattr(kernel, "ahead", lambda *args, _k=kernel, **static: ahead.append(_k.__name__))
    for name in ("signsgd", "qsgd", "efsignsgd", "onebit", "natural", "terngrad", "threshold"):
        GradzipState(name, bucketed=True).exchange(_bucket()[1])
    assert not calls and set(ahead) == {"_qsgd_bucket_encode", "_natural_encode", "_terngrad_bucket_encode",
                                        "_bucket_sign_bits", "_bucket_trits", "_counter_uniforms",
                                        "_bucket_decoded", "_codes_summed", "_segments_scaled", "_onebit_decoded",
                                        "_bucket_trit_vote", "_ef_decoded"}
    GradzipState("efsignsgd", bucketed=False).exchange(_bucket()[1])  # its kernels may return None
    assert calls



@pytest.mark.parametrize("params", [{}, {"ratio": 0.1, "rows": 3, "width": 2.0}, {"rows": 20, "width": 1.0}])
def test_sketch_drawn_in_pieces_equals_the_per_tensor_route(params, monkeypatch):
    """The count sketch draws a large bucket a piece at a time, and again after the allreduce: pieces
    that cut tensors anywhere give each tensor's own sketch, estimates and selection, bit for bit."""
    sketch = sys.modules["gradzip.compressors.sketch"]
    monkeypatch.setattr(sketch, "_MIN_PIECE", 5)
    layout = BucketLayout([f"layer{i}" for i in range(len(SHAPES))], SHAPES, torch.float32, torch.device("cpu"))
    pieces = make("sketch", **params)._plan(layout).pieces
    assert len(pieces) > 3 and any(start not in layout.offsets for start, _ in pieces[1:])
    assert [stop for _, stop in pieces[:-1]] == [start for start, _ in pieces[1:]] and pieces[-1][1] == layout.numel
    test_bucket_route_equals_the_per_tensor_route("sketch", params, torch.float32)


def test_dgc_takes_magnitudes_in_place_and_gives_back_every_bit():
    """DGC's bucket selection reads |v| written over v (a bucket copy less at its peak); v's bits come
    back exactly, signs of zeros and NaN included, also when the block raises."""
    sparse = sys.modules["gradzip.compressors.sparse"]
    values = torch.tensor([1.5, -2.0, 0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), -1e-45])
    p = torch.cat([values, torch.randn(1000)])
    before = p.view(torch.int32).clone()
    with sparse._in_magnitude(p) as magnitudes:
        assert magnitudes is p and not torch.signbit(p).any()
        torch.testing.assert_close(p, torch.from_numpy(abs(p.numpy())), equal_nan=True)
    assert torch.equal(p.view(torch.int32), before)
    with pytest.raises(RuntimeError, match="inside"):
        with sparse._in_magnitude(p):
            raise RuntimeError("inside")
    assert torch.equal(p.view(torch.int32), before)


@pytest.mark.parametrize("ratio, power", [(0.1, 1), (0.3, 5), (0.05, 9)])
def test_dgc_bucket_selection_is_select_per_tensor(ratio, power):
    """DGC's bucket selection (every retry's threshold at once, then one count per tensor and retry)
    picks per tensor what :meth:`DGC.select` picks from the same sample: as many elements, of the same
    magnitudes (ties aside).  Heavy tails (|x|^power) put the sampled threshold too high, so retries run."""
    from gradzip.compressors.base import TensorContext
    from gradzip.compressors.bucket import BucketContext

    shapes = [torch.Size(s) for s in [(8, 40), (40,), (8, 40), (30, 30), (5, 8), (0, 3), (64, 50), (3, 7)]]
    dgc = make("dgc", ratio=ratio, warmup_epochs=0, min_numel=0, sample_ratio=0.05, feedback="none")
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    b = BucketContext(layout, step=3, seed=1)
    p = torch.randn(layout.numel, generator=torch.Generator().manual_seed(power)) ** power
    mask = dgc._bucket_mask(p, b)
    draws = b.uniforms(len(layout), shared=False, salt="dgc")  # the sample starts the mask drew
    for i, (shape, start, n) in enumerate(zip(shapes, layout.offsets, layout.numels)):
        if len(shape) < 2 or not n:
            continue
        first = min(int(draws[i] * min(20, n)), min(20, n) - 1)
        dgc.sample = lambda v, ctx, first=first: v[first::20]
        want = dgc.select(p[start:start + n].clone(), TensorContext(f"t{i}", shape, torch.float32, step=3))
        got = mask[start:start + n].nonzero().view(-1)
        piece = p[start:start + n].abs()
        assert torch.equal(piece[got].sort().values, piece[want].sort().values), i


@pytest.mark.parametrize("drop_ratio, sample_ratio", [(0.9, 0.05), (0.5, 0.3), (0.99, 1.0)])
def test_dropping_bucket_selection_is_select_per_tensor(drop_ratio, sample_ratio):
    """Gradient dropping's bucket mask (every tensor's sample sorted at once, each threshold read off
    it) is, tensor by tensor, what :meth:`GradientDropping.select` sends from the same sample start:
    the same elements.  Sizes around the stride give full and short samples."""
    from gradzip.compressors import sparse
    from gradzip.compressors.base import TensorContext
    from gradzip.compressors.bucket import BucketContext

    shapes = [torch.Size(s) for s in [(8, 40), (40,), (8, 40), (), (19,), (0, 3), (64, 50), (3, 7), (1,)]]
    dropping = make("dropping", drop_ratio=drop_ratio, sample_ratio=sample_ratio, feedback="none")
    stride = max(1, round(1 / sample_ratio))
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    sent = 0
    for step in range(3):
        b = BucketContext(layout, step=step, seed=1)
        p = torch.randn(layout.numel, generator=torch.Generator().manual_seed(step))
        mask = dropping.bucket_mask(p, b)
        draws = b.uniforms(len(layout), shared=False, salt="dropping")  # the sample starts the mask drew
        for i, (shape, start, n) in enumerate(zip(shapes, layout.offsets, layout.numels)):
            span = min(stride, n)
            first = min(int(draws[i] * span), span - 1) if n else 0
            dropping_i = make("dropping", drop_ratio=drop_ratio, sample_ratio=sample_ratio, feedback="none")
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(sparse, "strided_sample", lambda v, ratio, ctx, first=first: v[first::stride])
                want = dropping_i.select(p[start:start + n].clone(), TensorContext(f"t{i}", shape, torch.float32, step=step))
            got = mask[start:start + n].nonzero().view(-1)
            assert torch.equal(got, want.sort().values), (step, i)
            sent += got.numel()
    assert sent > 0


def test_csc_bucket_selection_breaks_ties_as_per_tensor():
    """Chunk norms that tie (every element +-1 or 0) are picked as the per-tensor route picks them: the
    lower chunk first, within each tensor, over the bucket's one sort."""
    shapes = [(6, 4), (5,), (6, 4), (3, 3), (0,), (7, 2)]
    numels = [torch.Size(s).numel() for s in shapes]
    bucketed, reference = (GradzipState("csc", bucketed=flag, chunk_size=4, ratio=0.4) for flag in (True, False))
    for step in range(3):
        flat = torch.randint(-1, 2, (sum(numels),), generator=torch.Generator().manual_seed(step)).float()
        named = [(f"t{i}", v.view(s)) for i, (v, s) in enumerate(zip(torch.split(flat, numels), shapes))]
        expected = reference.exchange([(k, g.clone()) for k, g in named])
        bucketed.exchange(named, out=[g for _, g in named])
        for (key, got), want in zip(named, expected):
            assert torch.equal(got, want), (step, key)


AUTO_TOPK = {"candidates": "topk:ratio=0.3", "warmup": 0, "trials": 1, "verify": 0}


def _until_auto_decides(state, keys, seed=0) -> int:
    step = 0
    while state.compressor.bucket_method(keys, state.tensors) is None:
        assert step < 10, "auto did not decide"
        _, named = _bucket(seed=seed + step)
        state.exchange(named)
        step += 1
    return step


def test_auto_moves_a_decided_bucket_onto_its_choices_route():
    """Per tensor while auto explores and decides; then Top-k's bucket route, continuing from the residuals
    the per-tensor exchanges left: every later step equals a per-tensor Top-k holding the same residuals."""
    state = GradzipState("auto", bucketed=True, **AUTO_TOPK)
    keys = [k for k, _ in _bucket()[1]]
    assert state.describe()["route"] == "per-tensor until it decides, then its choice's route"
    step = _until_auto_decides(state, keys)
    assert step >= 2 and not state._route.buckets  # the undecided exchanges ran per tensor
    assert state.compressor.choices(state.tensors) == dict.fromkeys(keys, "topk:ratio=0.3")
    reference = GradzipState("topk", bucketed=False, ratio=0.3)
    owed = {k: {"residual": slot["residual"].clone()} for k, slot in state.tensors.items() if "residual" in slot}
    assert any(bool(r["residual"].any()) for r in owed.values())  # a residual to carry over
    reference.tensors.update(owed)
    for s in range(step, step + 3):
        _, a = _bucket(seed=s)
        _, b = _bucket(seed=s)
        got = state.exchange(a, out=[g for _, g in a])
        want = reference.exchange(b)
        assert len(state._route.buckets) == 1  # Top-k's bucket route
        assert all(torch.equal(x, y) for x, y in zip(got, want)), s
    for key, slot in reference.tensors.items():
        torch.testing.assert_close(state.tensors[key]["residual"], slot["residual"], rtol=0, atol=0)
    assert state.compressor.choices(state.tensors) == dict.fromkeys(keys, "topk:ratio=0.3")  # still reported


def test_auto_on_its_choices_route_keeps_ranks_identical_and_resumes():
    keys = [k for k, _ in _bucket()[1]]

    def rank_run(rank, transport):
        state = GradzipState("auto", bucketed=True, transport=transport, **AUTO_TOPK)
        step = _until_auto_decides(state, keys, seed=100 * rank)
        outs = []
        for s in range(step, step + 3):
            _, named = _bucket(seed=100 * rank + s)
            state.exchange(named, out=[g for _, g in named])
            outs.append(torch.cat([g.reshape(-1) for _, g in named]))
        saved = state.state_dict()
        resumed = GradzipState("auto", bucketed=True, transport=transport, **AUTO_TOPK)
        resumed.load_state_dict(saved)
        nxt = []
        for st in (state, resumed):
            _, named = _bucket(seed=100 * rank + 50)
            st.exchange(named, out=[g for _, g in named])
            nxt.append(torch.cat([g.reshape(-1) for _, g in named]))
        return outs, nxt, len(state._route.buckets), len(resumed._route.buckets)

    results = run_threads(2, rank_run)
    for outs, nxt, routed, resumed_routed in results:
        assert (routed, resumed_routed) == (1, 1)  # a resumed auto goes straight to its choice's route
        assert torch.equal(nxt[0], nxt[1])  # and continues bit for bit
        assert all(torch.equal(a, b) for a, b in zip(outs, results[0][0]))


def test_counter_hashes_are_distinct_keys_and_the_uniforms_top_bits():
    """kernels.counter_hashes: distinct int32 keys (Random-k ranks by them: no ties), whose top 24 bits
    are counter_uniforms' draws."""
    like, seed = torch.empty(1 << 20), torch.tensor(12345, dtype=torch.int32)
    keys = kernels.counter_hashes(like, seed)
    assert keys.dtype == torch.int32 and keys.unique().numel() == keys.numel()
    top = (keys >> 8) & 0xFFFFFF
    assert torch.equal(top.float() * 2.0**-24, kernels.counter_uniforms(like, seed))


@pytest.mark.parametrize("shapes", [[(5, 3), (0,), (7,), (), (4, 4)], [(1,)], [(0,), (3,)],
                                    [(33,), (64,), (0,), (31,)]])
def test_spreading_per_tensor_and_per_chunk_values_over_the_elements(shapes):
    """per_element and per_chunk (an int32 gather index) equal repeat_interleave by the tensors' and the
    chunks' lengths, empty tensors and chunk sizes that do and do not divide the tensors included."""
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    per_tensor = torch.arange(1.0, len(shapes) + 1)
    assert torch.equal(layout.per_element(per_tensor), per_tensor.repeat_interleave(layout.lengths))
    for size in (1, 2, 8, 16, 1000):
        lengths = layout.chunk_lengths(size)
        per_chunk = torch.arange(1.0, lengths.numel() + 1)
        assert torch.equal(layout.per_chunk(per_chunk, size), per_chunk.repeat_interleave(lengths)), size


@pytest.mark.parametrize("shapes", [[(5, 3), (0,), (7,), (), (4, 4)], [(0,)], [(0,), (3,)],
                                    [(40_000,), (0,), (16_384,), (16_385,), (2,)]])
def test_per_tensor_reductions_cut_long_tensors_into_pieces(shapes):
    """BucketLayout.reduce: per tensor its sum or max (at least 0; 0 for an empty tensor), where no
    first-level segment is longer than PIECE (one GPU block each), and counts exact in float64."""
    from gradzip.compressors.bucket import PIECE
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    values = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0))
    parts = torch.split(values, layout.numels)
    sums = torch.stack([p.double().sum() for p in parts]).float() if parts else torch.zeros(0)
    torch.testing.assert_close(layout.reduce(values), sums, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layout.segment_sum(values.half()), layout.reduce(values.half().float()))
    maxes = torch.stack([p.max().clamp(min=0) if p.numel() else torch.tensor(0.0) for p in parts])
    assert torch.equal(layout.reduce(values, "max"), maxes)
    counts = layout.reduce(values.ge(0).float(), total=torch.float64)
    assert counts.dtype == torch.float64 and torch.equal(counts, torch.tensor([float(p.ge(0).sum()) for p in parts],
                                                                              dtype=torch.float64))
    starts = layout.chunk_offsets(PIECE).tolist()  # the first level's pieces
    assert all(0 < b - a <= PIECE for a, b in zip(starts, starts[1:])) and starts[-1] == layout.numel
    assert torch.equal(layout.chunk_offsets(PIECE).diff(), layout.chunk_lengths(PIECE))
    assert layout._piece_offsets.diff().tolist() == [-(-n // PIECE) for n in layout.numels]
    start, length, tensor = layout.piece_table  # the same pieces, for a kernel: start, length, tensor
    assert start.tolist() == starts[:-1] and torch.equal(length, layout.chunk_lengths(PIECE).int())
    assert tensor.tolist() == [i for i, n in enumerate(layout.numels) for _ in range(-(-n // PIECE))]
    assert torch.equal(layout.reduce_pieces(layout.chunk_reduce(values, "max", PIECE), "max"), maxes)
    rows = [values.ge(t).float() for t in (-0.5, 0.0, 1.0)]  # several rows' counts at once: as each alone
    each = layout.reduce_each(iter(rows), total=torch.float64)
    assert each.shape == (3, len(layout)) and torch.equal(each, torch.stack([layout.reduce(r, total=torch.float64)
                                                                             for r in rows]))
    assert torch.equal(layout.reduce_each([values, values.neg()], "max"),
                       torch.stack([layout.reduce(values, "max"), layout.reduce(values.neg(), "max")]))


def test_lowbias32_is_the_unsigned_hash():
    """kernels.lowbias32_ against the hash written with Python's unbounded integers."""
    def reference(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    x = torch.tensor([v - 2**32 if v >= 2**31 else v for v in values], dtype=torch.int32)
    got = [v & 0xFFFFFFFF for v in kernels.lowbias32_(x.clone()).tolist()]
    assert got == [reference(v) for v in values]
    assert torch.equal(kernels.lowbias32_(x.clone(), scratch=torch.empty_like(x)), kernels.lowbias32_(x.clone()))
    # contiguous words take the int16-halves form of the 16-bit rounds, strided ones the shifts: the same hash
    rows = torch.stack([x, x.flip(0)])
    strided = torch.stack([x, x], 1)[:, 0]
    assert not strided.is_contiguous()
    assert [v & 0xFFFFFFFF for v in kernels.lowbias32_(rows.clone())[1].tolist()] == [reference(v) for v in values[::-1]]
    assert [v & 0xFFFFFFFF for v in kernels.lowbias32_(strided).tolist()] == [reference(v) for v in values]


def test_stacked_rows_are_a_view_where_the_tensors_are_equally_spaced():
    """BucketLayout.stacked: the same rows as torch.stack, as a view of the flat buffer when the members
    start at equal distances (one block's tensor in each block), else a copy."""
    shapes = [(4, 3), (5,), (4, 3), (5,), (4, 3), (2,), (4, 3)]
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], shapes, torch.float32, torch.device("cpu"))
    flat = torch.arange(float(layout.numel))
    parts = torch.split(flat, layout.numels)
    for members, view in (([0, 2, 4], True), ([0, 2, 4, 6], False), ([1, 3], True), ([6], True), ([0, 4], True)):
        rows = layout.stacked(flat, members)
        assert torch.equal(rows, torch.stack([parts[i] for i in members])), members
        assert (rows.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()) == view, members


@pytest.mark.parametrize("shapes", [SHAPES, [(4, 3), (3,), (4, 3), (2, 2, 3), (1,), (0,), (1, 5), (5, 1), (4, 3)],
                                    [(7,)], [(0,), (2, 6)], [(3, 3)] * 4])
def test_one_bit_column_index_is_each_elements_column(shapes):
    """1-bit SGD's column of every element, rebuilt each exchange from O(rows) numbers: the same as
    numbering the columns group by group (a group: one matrix shape) and looking each element up."""
    from gradzip.compressors.sign import OneBit, _columns
    layout = BucketLayout([f"t{i}" for i in range(len(shapes))], [torch.Size(s) for s in shapes], torch.float32,
                          torch.device("cpu"))
    groups, columns, plan = _columns(layout)
    expected = torch.full((layout.numel,), -1, dtype=torch.int64)
    first = 0
    for size, rows, cols in groups:
        for i in size.members:
            at = layout.offsets[i]
            expected[at:at + size.numel] = first + torch.arange(size.numel) % cols
            first += cols
    assert first == columns and bool((expected >= 0).all())
    index = plan.column_index()
    assert index.dtype == torch.int32 and torch.equal(index.long(), expected)
    assert all(OneBit.matrix_shape(layout.shapes[i]) == (rows, cols) for size, rows, cols in groups for i in size.members)


class _SlowSteps(dict):
    """Step counters whose reads off gradzip's thread take a while: ``stats()`` there, having taken a
    skip, takes its counters back only after an exchange running meanwhile has read and written them."""

    def get(self, key, default=None):
        if threading.current_thread().name != "gradzip-comm":
            time.sleep(0.005)
        return super().get(key, default)


def test_stats_beside_running_exchanges_keep_the_step_counters_exact():
    # DiLoCo's overlapped outer step: the thread exchanges while the training thread reads stats().
    state = GradzipState("topk", ratio=0.5, bucketed=True)
    state.steps = _SlowSteps()
    grads = [torch.ones(6, 4), torch.ones(5)]
    stop = threading.Event()
    reader = threading.Thread(target=lambda: [state.stats() for _ in iter(stop.is_set, True)])
    reader.start()
    try:
        for step in range(12):  # each step waits for the lock the reader all but holds: some 0.8 s a step
            poisoned = [g.clone() for g in grads]
            if step % 2:
                poisoned[0][0, 0] = float("nan")  # skipped: its counters are taken back
            state.submit([("w", poisoned[0]), ("b", poisoned[1])], lambda aggregates: None).wait()
    finally:
        stop.set()
        reader.join()
    assert state.stats()["nonfinite_exchanges"] == 6
    assert dict(state.steps) == {"w": 6, "b": 6}
    state.close()
