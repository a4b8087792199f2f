"""Method-specific tests of the sparsifiers: Random-k, Threshold, Gradient dropping, DGC and CSC.

The shared matrix (test_matrix.py) covers shapes, dtypes, byte counts and odd inputs for every method;
here each method's own equations and pitfalls are checked.
"""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip import GradzipState, feedback
from gradzip.collectives import LocalTransport, run_lockstep, simulate
from gradzip.compressors import compressors, make
from gradzip.compressors.base import AllGather, AllReduce, TensorContext
from gradzip.compressors.sparse import DGC

MINE = ["randomk", "threshold", "dropping", "dgc", "csc"]


def ctx_for(shape, key="w", dtype=torch.float32, **kw):
    return TensorContext(key=key, shape=torch.Size(shape), dtype=dtype, **kw)


def exchange_ranks(comp, xs, **kw):
    """One tensor per simulated rank; returns each rank's Exchanged."""
    ctxs = [ctx_for(x.shape, rank=r, world_size=len(xs), **kw) for r, x in enumerate(xs)]
    outs = simulate([[comp.exchange(x, ctx)] for x, ctx in zip(xs, ctxs)])
    return [out[0] for out in outs]


def exchange_one(comp, x, **kw):
    return exchange_ranks(comp, [x], **kw)[0]


def bytes_counted_and_claimed(comp, x, **kw):
    ctx = ctx_for(x.shape, **kw)
    (out,), report = run_lockstep([comp.exchange(x, ctx)], LocalTransport())
    kept = None if out.mask is None else int(out.mask.sum())
    return report.per_tensor_payload[0], comp.payload_bytes(ctx, kept)


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def assert_upper_set(x, mask):
    """Everything sent is at least as large in magnitude as everything kept back; zeros are never sent."""
    a = x.abs().reshape(-1)
    m = mask.reshape(-1)
    assert not (m & (a == 0)).any()
    if m.any() and (~m).any():
        assert a[m].min() >= a[~m].max()


def test_registration_order():
    assert compressors()[:9] == ["none", "fp16", "bf16", "topk", *MINE]


@pytest.mark.parametrize("name", MINE)
def test_params_round_trip(name):
    comp = make(name)
    assert make(name, **comp.params()).params() == comp.params()


# -- Random-k ---------------------------------------------------------------------------------------------


def test_randomk_same_positions_on_every_rank_and_mean_of_values():
    comp = make("randomk", ratio=0.05)
    xs = [randn(20, 30, seed=r) for r in range(3)]
    outs = exchange_ranks(comp, xs, step=5)
    mask = outs[0].mask
    assert int(mask.sum()) == math.ceil(0.05 * 600)
    mean = (xs[0] + xs[1] + xs[2]) / 3
    for x, out in zip(xs, outs):
        assert torch.equal(out.mask, mask)
        torch.testing.assert_close(out.aggregate, torch.where(mask, mean, 0.0))
        assert torch.equal(out.sent, torch.where(mask, x, 0.0))


def test_randomk_allreduces_values_without_indices():
    comp = make("randomk", ratio=0.1)
    x = randn(1000)
    request = next(comp.exchange(x, ctx_for(x.shape)))
    assert isinstance(request, AllReduce) and request.op == "sum"
    assert request.tensor.shape == (100,) and request.tensor.dtype == torch.float32
    assert bytes_counted_and_claimed(comp, x) == (400, 400)
    assert bytes_counted_and_claimed(make("randomk", ratio=0.1, value_dtype="float16"), x) == (200, 200)
    # Default value dtype: the gradient's own.
    assert bytes_counted_and_claimed(comp, x, dtype=torch.bfloat16) == (200, 200)


def test_randomk_positions_depend_on_step_key_and_seed_only():
    comp = make("randomk", ratio=0.01)
    x = randn(1000)
    rng_before = torch.random.get_rng_state()

    def positions(**kw):
        return exchange_one(comp, x, **kw).mask.nonzero().reshape(-1).tolist()

    base = positions(step=3, key="a")
    assert positions(step=3, key="a") == base  # reproducible
    rank1 = exchange_ranks(comp, [x, -x], step=3, key="a")[1]
    assert rank1.mask.nonzero().reshape(-1).tolist() == base  # rank-independent
    others = [positions(step=4, key="a"), positions(step=3, key="b"), positions(step=3, key="a", seed=1)]
    assert all(sorted(p) != sorted(base) for p in others)
    assert torch.equal(torch.random.get_rng_state(), rng_before)  # the global RNG is never touched


def test_randomk_unbiased_mean_matches_input_within_variance_bound():
    n, ratio, steps = 100, 0.1, 4000
    comp = make("randomk", ratio=ratio, unbiased=True)
    k = math.ceil(ratio * n)
    x = randn(n, seed=1)
    total = torch.zeros(n)
    for step in range(steps):
        out = exchange_one(comp, x, step=step)
        assert int(out.mask.sum()) == k
        total += out.sent
    mean = total / steps
    # sent_i = (n/k) x_i B_i with B_i ~ Bernoulli(k/n): E = x_i, Var = x_i^2 (n/k - 1).
    std = x.abs() * math.sqrt((n / k - 1) / steps)
    assert ((mean - x).abs() <= 5 * std).all()
    # The band is tight enough to reject the unscaled mean (k/n) x of the biased variant.
    assert ((ratio * x - x).abs() > 5 * std).all()


def test_randomk_default_feedback_follows_unbiased():
    assert make("randomk").feedback == "residual"
    assert make("randomk", unbiased=True).feedback == "none"
    assert make("randomk", unbiased=True, feedback="residual").feedback == "residual"


def test_randomk_fp16_sum_cannot_overflow():
    comp = make("randomk", ratio=0.5, value_dtype="float16")
    xs = [torch.full((64,), 40000.0) for _ in range(4)]  # the raw fp16 sum (160000) would be inf
    out = exchange_ranks(comp, xs)[0]
    assert torch.isfinite(out.aggregate).all()
    assert torch.equal(out.aggregate, torch.where(out.mask, 40000.0, 0.0))


# -- Threshold --------------------------------------------------------------------------------------------


def test_threshold_sends_strictly_above_tau_and_averages_ranks():
    comp = make("threshold", tau=0.5)
    xs = [torch.tensor([0.75, -0.5, 0.5, 0.25, -1.0, 0.0]), torch.tensor([2.0, 0.6, -0.7, 0.1, 0.9, -3.0])]
    outs = exchange_ranks(comp, xs)
    assert outs[0].mask.tolist() == [True, False, False, False, True, False]
    assert outs[1].mask.tolist() == [True, True, True, False, True, True]
    expected = (torch.where(xs[0].abs() > 0.5, xs[0], 0.0) + torch.where(xs[1].abs() > 0.5, xs[1], 0.0)) / 2
    for x, out in zip(xs, outs):
        assert torch.equal(out.sent, torch.where(out.mask, x, 0.0))
        torch.testing.assert_close(out.aggregate, expected)
    # Rank 0's 2 (value, uint8 index) pairs take 10 bytes; rank 1's 5 would take 25, more than its 6
    # values (24 bytes), which it sends instead: the two formats met in one sum above.
    assert bytes_counted_and_claimed(comp, xs[0]) == (2 * (4 + 1), 2 * (4 + 1))
    assert bytes_counted_and_claimed(comp, xs[1]) == (6 * 4, 6 * 4)


def _with_zeros(x: torch.Tensor, every: int) -> torch.Tensor:
    """x with -0.0 and +0.0 at alternate multiples of ``every``: signed zeros a selection may send."""
    flat = x.clone().reshape(-1)
    flat[::every] = 0.0
    flat[::2 * every] = -0.0
    return flat.view(x.shape)


DENSE_CASES = [("threshold", {"tau": 0.05}), ("threshold", {"tau": 0.05, "value_dtype": "float16"}),
               ("topk", {"ratio": 0.9}), ("dgc", {"ratio": 0.9, "min_numel": 1, "warmup_epochs": 0})]


@pytest.mark.parametrize("name,params", DENSE_CASES)
def test_a_dense_payload_gives_the_sums_and_residuals_of_the_pairs_it_replaces(name, params, monkeypatch):
    """A sparsifier whose pairs would outweigh n values sends the values: aggregates (ranks mixing both
    formats), residuals and momenta must be those of the pairs, bit for bit, signed zeros included."""
    from gradzip.compressors.sparse import Sparsifier
    # Densities 2%, 60% and 95% of 50x100 elements (2-D: DGC compresses matrices only): rank 0 sends pairs, ranks 1 and 2 values (Top-k and
    # DGC send the same k everywhere, so there every rank switches).
    scales = [0.02, 0.08, 1.0]
    steps = [[_with_zeros(randn(50, 100, seed=10 * step + r) * scales[r], 7) for r in range(3)] for step in range(3)]

    def run(forbid_dense):
        if forbid_dense:
            monkeypatch.setattr(Sparsifier, "sends_dense", lambda self, ctx, kept: False)
        aggregates, residuals, payloads = [], [], []
        states = [GradzipState(make(name, **params), transport=LocalTransport(), seed=0) for _ in range(3)]
        for xs in steps:  # three simulated ranks, then each rank's error feedback on its own state
            gens = [[feedback.exchange(state.compressor, x, state.context("w", x))] for state, x in zip(states, xs)]
            aggregates.append([out[0].aggregate.clone() for out in simulate(gens)])
        for x in steps[0]:  # a whole state's steps at world size 1: residual (and momentum) committed
            state = GradzipState(make(name, **params), transport=LocalTransport(), seed=0)
            for step in range(3):
                aggregates.append(state.exchange([("w", x * (step + 1))]))
                residuals.append({k: v.clone() for k, v in state.tensors["w"].items()})
            payloads.append(state.last_report.payload_bytes)
        monkeypatch.undo()
        return aggregates, residuals, payloads

    dense_aggregates, dense_states, dense_bytes = run(False)
    pair_aggregates, pair_states, pair_bytes = run(True)
    values = 5000 * (2 if "value_dtype" in params else 4)
    assert dense_bytes[2] == values < pair_bytes[2]  # the densest rank did switch
    for a, b in zip(dense_aggregates, pair_aggregates):
        for x, y in zip(a, b):
            assert torch.equal(x, y) and torch.equal(x.signbit(), y.signbit())
    for a, b in zip(dense_states, pair_states):
        assert a.keys() == b.keys() and a
        for key in a:
            assert torch.equal(a[key], b[key]) and torch.equal(a[key].signbit(), b[key].signbit()), key


def test_a_sparsifier_never_claims_more_bytes_than_dense():
    ctx = ctx_for((100, 1000))  # int32 indices: 8-byte pairs against 4-byte values
    for name in ("threshold", "dgc", "dropping"):
        comp = make(name)
        assert [comp.payload_bytes(ctx, kept) for kept in (0, 10, 50_000, 50_001, 100_000)] == \
            [0, 80, 400_000, 400_000, 400_000]
    small = ctx_for((1000,))  # int16 indices
    assert make("threshold").payload_bytes(small, 666) == 666 * 6 and make("threshold").payload_bytes(small, 667) == 4000
    comp = make("topk", ratio=0.6, value_dtype="float16")  # 2-byte values, 2-byte indices: dense above 500
    assert comp.payload_bytes(small) == 2000 and comp.payload_bytes(small, 500) == 2000 == 500 * 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), max_size=200), st.floats(1e-3, 5))
def test_threshold_selection_property(values, tau):
    x = torch.tensor(values, dtype=torch.float32)
    out = exchange_one(make("threshold", tau=tau), x)
    assert torch.equal(out.mask, x.abs() > tau)
    assert torch.equal(out.sent, torch.where(out.mask, x, 0.0))


# -- Gradient dropping ------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), max_size=300), st.sampled_from([0.0, 0.5, 0.9, 0.99]),
       st.sampled_from([0.01, 0.1, 1.0]), st.integers(0, 10**6))
def test_dropping_sends_an_upper_set(values, drop_ratio, sample_ratio, step):
    x = torch.tensor(values, dtype=torch.float32)
    out = exchange_one(make("dropping", drop_ratio=drop_ratio, sample_ratio=sample_ratio), x, step=step)
    assert_upper_set(x, out.mask)
    assert torch.equal(out.sent, torch.where(out.mask, x, 0.0))
    if (x != 0).any():
        assert out.mask.any()  # the sample's own maximum always passes


def test_dropping_exact_when_the_sample_is_everything():
    x = randn(1000, seed=3)
    out = exchange_one(make("dropping", drop_ratio=0.99, sample_ratio=1.0), x)
    assert out.mask.nonzero().reshape(-1).tolist() == sorted(x.abs().topk(10).indices.tolist())


@pytest.mark.parametrize("drop_ratio", [0.9, 0.99])
def test_dropping_density_close_to_one_minus_drop_ratio(drop_ratio):
    n, steps = 100_000, 25
    comp = make("dropping", drop_ratio=drop_ratio, sample_ratio=0.01)
    s = n // 100  # every start draws exactly this many
    keep = s - math.floor(drop_ratio * s)
    densities = [float(exchange_one(comp, randn(n, seed=t), step=t).mask.float().mean()) for t in range(steps)]
    # The density is the tail mass above the keep-th largest of s draws: Beta(keep, s - keep + 1).
    a, b = keep, s - keep + 1
    mean = a / (a + b)
    std = math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1)) / steps)
    assert abs(sum(densities) / steps - mean) < 5 * std
    assert abs(mean - (1 - drop_ratio)) < 1e-3


def test_dropping_never_sends_zeros_of_a_sparse_gradient():
    x = torch.zeros(10_000)
    x[torch.arange(30) * 331] = randn(30, seed=4)
    for step in range(5):
        out = exchange_one(make("dropping"), x, step=step)
        assert out.mask.any() and not (out.mask & (x == 0)).any()
    assert not exchange_one(make("dropping"), torch.zeros(500)).mask.any()


# -- DGC: schedule and selection --------------------------------------------------------------------------


def test_dgc_warmup_schedule():
    comp = make("dgc")
    expected = [0.25, 0.0625, 0.015625, 0.00390625] + [0.001] * 3
    assert [comp.density(e) for e in range(7)] == expected
    # The paper's sparsities (Sec. 3.4): 75%, 93.75%, 98.4375%, 99.6% (99.61), 99.9%.
    for e, pct in enumerate([75, 93.75, 98.4375, 99.6, 99.9]):
        assert abs(100 * (1 - comp.density(e)) - pct) < 0.011
    assert [make("dgc", warmup_epochs=0).density(e) for e in range(3)] == [0.001] * 3
    assert [make("dgc", ratio=0.5).density(e) for e in range(3)] == [0.5] * 3
    assert [make("dgc", ratio=0.01, warmup_epochs=6).density(e) for e in range(7)] == [
        0.25, 0.0625, 0.015625, 0.01, 0.01, 0.01, 0.01]


def test_dgc_warmup_follows_state_epoch():
    state = GradzipState("dgc", sample_ratio=1.0, min_numel=0, feedback="none")
    g = randn(100, 100, seed=5)
    for epoch in range(6):
        state.set_epoch(epoch)
        state.exchange([("w", g)])
        kept = state.last_report.per_tensor_payload[0] // (4 + 2)  # fp32 values, int16 indices
        assert kept == math.ceil(state.compressor.density(epoch) * g.numel())
    assert kept == 10


def _dgc_kept_per_step(state, steps, g):
    """Elements DGC sent in each of ``steps`` exchanges of ``g`` (fp32 values, int16 indices: 6 B each)."""
    kept = []
    for _ in range(steps):
        state.exchange([("w", g)])
        kept.append(state.last_report.per_tensor_payload[0] // (4 + 2))
    return kept


def test_dgc_warmup_advances_by_steps_without_set_epoch():
    # warmup_steps=8 over 4 stages: two exchanges per stage, then ratio (10 of 10,000).
    state = GradzipState("dgc", warmup_steps=8, sample_ratio=1.0, min_numel=0, feedback="none")
    kept = _dgc_kept_per_step(state, 11, randn(100, 100, seed=5))
    assert kept == [2500, 2500, 625, 625, 157, 157, 40, 40, 10, 10, 10]
    assert state.epoch is None and state.steps["w"] == 11
    # warmup_steps=0: no warm-up at all unless set_epoch says otherwise.
    state = GradzipState("dgc", warmup_steps=0, sample_ratio=1.0, min_numel=0, feedback="none")
    assert _dgc_kept_per_step(state, 2, randn(100, 100, seed=5)) == [10, 10]


def test_dgc_default_warmup_steps_reach_ratio_after_1000_exchanges():
    comp = make("dgc")
    assert comp.warmup_steps == 1000
    stages = {step: comp.stage(ctx_for((64, 64), step=step)) for step in (0, 249, 250, 500, 999, 1000, 10**6)}
    assert stages == {0: 0, 249: 0, 250: 1, 500: 2, 999: 3, 1000: 4, 10**6: 4}
    assert [comp.density(stage) for stage in stages.values()] == [0.25, 0.25, 0.0625, 0.015625, 0.00390625,
                                                                  0.001, 0.001]
    # The same through GradzipState's own step counter: 1024 elements, k = ceil(density * 1024).
    state = GradzipState("dgc", sample_ratio=1.0, min_numel=0, feedback="none")
    kept = _dgc_kept_per_step(state, 1001, randn(32, 32, seed=6))
    assert [kept[s] for s in (0, 249, 250, 500, 999, 1000)] == [256, 256, 64, 16, 4, 2]


def test_dgc_set_epoch_overrides_the_step_schedule():
    state = GradzipState("dgc", warmup_steps=4, sample_ratio=1.0, min_numel=0, feedback="none")
    g = randn(100, 100, seed=5)
    assert _dgc_kept_per_step(state, 5, g)[-1] == 10  # past the step warm-up
    for epoch, expected in [(0, 2500), (1, 625), (3, 40), (4, 10)]:
        state.set_epoch(epoch)
        assert _dgc_kept_per_step(state, 1, g) == [expected]


def test_dgc_step_schedule_survives_state_dict_round_trip():
    g = randn(100, 100, seed=5)
    whole = GradzipState("dgc", warmup_steps=8, sample_ratio=1.0, min_numel=0, feedback="none")
    expected = _dgc_kept_per_step(whole, 10, g)
    first = GradzipState("dgc", warmup_steps=8, sample_ratio=1.0, min_numel=0, feedback="none")
    head = _dgc_kept_per_step(first, 3, g)
    resumed = GradzipState("dgc", warmup_steps=8, sample_ratio=1.0, min_numel=0, feedback="none")
    resumed.load_state_dict(first.state_dict())
    assert head + _dgc_kept_per_step(resumed, 7, g) == expected
    assert expected == [2500, 2500, 625, 625, 157, 157, 40, 40, 10, 10]


def test_dgc_hierarchical_top_k_keeps_largest_magnitudes():
    # 100 windows of stride 100: every sampling start sees one offset j of every window, giving a
    # threshold that far more than k = 100 elements pass (unless j is the top offset).  The true top-k
    # is the whole column at the top offset; the first k candidates by index are rows 0-1.
    comp = make("dgc", ratio=0.01, warmup_epochs=0, min_numel=0, feedback="none")
    base = torch.randperm(100, generator=torch.Generator().manual_seed(6)).float() + 1
    x = base.unsqueeze(0) + 1e-3 * torch.arange(100.0).unsqueeze(1)
    x = x * torch.where(randn(100, 100, seed=7) > 0, 1.0, -1.0)
    top = x.abs().reshape(-1).topk(100).indices.sort().values
    assert torch.equal(top % 100, torch.full((100,), int(base.argmax())))
    candidates = (x.abs().reshape(-1) >= 50).nonzero().reshape(-1)
    assert not torch.equal(candidates[:100], top)  # index-order truncation would be wrong
    for step in range(10):
        out = exchange_one(comp, x, step=step)
        assert torch.equal(out.mask.reshape(-1).nonzero().reshape(-1), top)
        assert torch.equal(out.sent, torch.where(out.mask, x, 0.0))


class _HighSample(DGC):
    """A sample that overestimates the threshold: only the maximum passes at first."""

    def sample(self, a, ctx):
        return a.max().reshape(1)


def test_dgc_retry_lowers_threshold_then_keeps_k_largest():
    comp = _HighSample(ratio=0.01, warmup_epochs=0, min_numel=0, feedback="none")
    x = ((torch.randperm(10_000, generator=torch.Generator().manual_seed(8)) + 1) / 10_000).reshape(100, 100)
    out = exchange_one(comp, x)  # 1 passes; halved once, 5000 pass; top-k of those
    expected = torch.zeros(10_000, dtype=torch.bool)
    expected[x.reshape(-1).topk(100).indices] = True
    assert torch.equal(out.mask.reshape(-1), expected)


class _FixedSample(DGC):
    """A sample of 100 magnitudes whose largest overestimates the threshold."""

    def sample(self, v, ctx):
        return torch.tensor([1.0, 0.995, 0.99, 0.98] + [0.1] * 96)


def test_dgc_retry_goes_twice_as_far_down_the_sample_before_halving(monkeypatch):
    from gradzip.compressors import sparse
    thresholds = []

    def spy(flat, threshold, expected):
        thresholds.append(float(threshold))
        return at_least_abs(flat, threshold, expected)

    at_least_abs = sparse._at_least_abs
    monkeypatch.setattr(sparse, "_at_least_abs", spy)
    comp = _FixedSample(ratio=0.01, warmup_epochs=0, min_numel=0, feedback="none")
    x = (torch.arange(1, 10_001) / 10_000).reshape(100, 100)
    out = exchange_one(comp, x)
    # r = 1: 1.0 lets 1 through; the 2nd largest, 0.995, 51; the 4th, 0.98, 201, and the top-k of those
    # is sent.  Halving 1.0 would have let 5001 through.
    assert thresholds == pytest.approx([1.0, 0.995, 0.98])
    expected = torch.zeros(10_000, dtype=torch.bool)
    expected[-100:] = True
    assert torch.equal(out.mask.reshape(-1), expected)


@pytest.mark.parametrize("rest, sent", [(0.2, 100), (0.1, 1)])
def test_dgc_retries_are_bounded(rest, sent):
    # Threshold 1 -> 0.5 -> 0.25 -> 0.125 (three retries): 0.2 passes at the last one, 0.1 never does.
    comp = _HighSample(ratio=0.01, warmup_epochs=0, min_numel=0, feedback="none")
    x = torch.full((100, 100), rest)
    x[0, 7] = 1.0
    out = exchange_one(comp, x)
    assert int(out.mask.sum()) == sent and bool(out.mask[0, 7])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-10, 10, width=32), min_size=1, max_size=400), st.sampled_from([0.001, 0.01, 0.3]),
       st.integers(0, 5), st.integers(0, 10**6))
def test_dgc_selection_property(values, ratio, epoch, step):
    x = torch.tensor(values, dtype=torch.float32).reshape(1, -1)
    comp = make("dgc", ratio=ratio, min_numel=0, sample_ratio=0.1, feedback="none")
    out = exchange_one(comp, x, epoch=epoch, step=step)
    assert int(out.mask.sum()) <= math.ceil(comp.density(epoch) * x.numel())
    assert_upper_set(x, out.mask)
    assert torch.equal(out.sent, torch.where(out.mask, x, 0.0))


def test_dgc_fp16_values_take_six_bytes_per_element():
    x = randn(256, 256, seed=9)  # 65536 elements: int32 indices
    comp = make("dgc", value_dtype="float16", warmup_epochs=0)
    request = next(comp.exchange(x, ctx_for(x.shape)))
    assert isinstance(request, AllGather) and not request.same_size
    assert [f.dtype for f in request.fields] == [torch.float16, torch.int32]
    counted, claimed = bytes_counted_and_claimed(comp, x)
    assert counted == claimed and counted % 6 == 0 and 0 < counted <= 6 * 66
    counted, claimed = bytes_counted_and_claimed(make("dgc", warmup_epochs=0), x)
    assert counted == claimed and counted % 8 == 0


# -- DGC: momentum correction, masking, clipping, dense path (through feedback.py) ------------------------


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_momentum_correction_and_masking_match_reference(nesterov):
    m, k = 0.9, 30
    state = GradzipState("dgc", ratio=k / 600, momentum=m, nesterov=nesterov, warmup_epochs=0, sample_ratio=1.0,
                         min_numel=0)
    u = torch.zeros(20, 30)
    v = torch.zeros(20, 30)
    for step in range(6):
        g = randn(20, 30, seed=10 + step)
        if nesterov:
            u = (u + g) * m
            v = v + u + g
        else:
            u = m * u + g
            v = v + u
        sent = torch.zeros(600, dtype=torch.bool)
        sent[v.abs().reshape(-1).topk(k).indices] = True
        sent = sent.reshape(20, 30)
        expected = torch.where(sent, v, 0.0)
        v = v.masked_fill(sent, 0.0)
        u = u.masked_fill(sent, 0.0)
        (aggregate,) = state.exchange([("w", g)])
        torch.testing.assert_close(aggregate, expected)
        torch.testing.assert_close(state.tensors["w"]["momentum"], u)
        torch.testing.assert_close(state.tensors["w"]["velocity"], v)
        assert (state.tensors["w"]["velocity"][sent] == 0).all()


def test_dgc_local_clipping_scaled_by_inverse_sqrt_of_world_size():
    world, clip = 4, 1.0
    # A vector goes dense, so the stored momentum is exactly the clipped gradient (nothing is masked).
    comp = make("dgc", clip_norm=clip)
    direction = randn(1600, seed=11)
    direction = direction / torch.linalg.vector_norm(direction)
    norms = [0.1, 0.4, 0.8, 10.0]  # 0.8 < clip, but above clip * 4^-1/2 = 0.5
    gs = [norm * direction for norm in norms]
    ctxs = [ctx_for(g.shape, rank=r, world_size=world) for r, g in enumerate(gs)]
    simulate([[feedback.exchange(comp, g, ctx)] for g, ctx in zip(gs, ctxs)])
    for norm, g, ctx in zip(norms, gs, ctxs):
        limit = clip * world ** -0.5
        torch.testing.assert_close(ctx.updates["momentum"], g * min(1.0, limit / (norm + 1e-6)))
    assert float(torch.linalg.vector_norm(ctxs[2].updates["momentum"])) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("shape", [(2048,), (10, 10), ()])
def test_dgc_dense_path_for_vectors_and_small_tensors(shape):
    state = GradzipState("dgc")  # min_numel 1024, dim > 1 only
    ctx = state.context("b", torch.empty(shape))
    assert not state.compressor.compresses(ctx)
    g1, g2 = randn(*shape, seed=12), randn(*shape, seed=13)
    (a1,) = state.exchange([("b", g1)])
    assert torch.equal(a1, g1)
    (a2,) = state.exchange([("b", g2)])
    torch.testing.assert_close(a2, 0.9 * g1 + g2)  # momentum is kept, nothing is masked
    assert "velocity" not in state.tensors["b"]
    torch.testing.assert_close(state.tensors["b"]["momentum"], a2)
    assert state.last_report.per_tensor_payload[0] == g1.numel() * 4 == state.compressor.payload_bytes(ctx)


def test_dgc_compresses_matrices_from_min_numel():
    comp = make("dgc")
    assert comp.compresses(ctx_for((32, 32)))
    assert not comp.compresses(ctx_for((31, 33)))
    assert not comp.compresses(ctx_for((4096,)))
    assert make("dgc", min_numel=0).compresses(ctx_for((1, 1)))


# -- CSC --------------------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.0, 2.0, 2.5, 3.0, float("inf"), float("nan")]), min_size=1, max_size=60),
       st.integers(1, 60), st.booleans())
def test_largest_first_is_the_head_of_a_stable_descending_sort(values, k, continuous):
    from gradzip.compressors.sparse import largest_first
    a = torch.tensor(values) + (torch.rand(len(values), generator=torch.Generator().manual_seed(k)) if continuous else 0)
    expected = torch.sort(a, descending=True, stable=True).indices[:k].sort().values
    assert torch.equal(largest_first(a, k), expected)


def _csc_reference(xs, ratio, chunk):
    n = xs[0].numel()
    nchunks = -(-n // chunk)
    norms = sum(torch.cat([x.reshape(-1), torch.zeros(nchunks * chunk - n)]).reshape(nchunks, chunk).abs().sum(1)
                for x in xs)
    chosen = norms.topk(math.ceil(ratio * nchunks)).indices
    mask = torch.zeros(nchunks * chunk, dtype=torch.bool)
    mask.view(nchunks, chunk)[chosen] = True
    return mask[:n].reshape(xs[0].shape)


def test_csc_all_ranks_pick_the_same_chunks_from_summed_norms():
    chunk, n = 64, 1000  # 16 chunks, the last one 40 elements long
    xs = []
    for r in range(3):
        x = 0.01 * randn(n, seed=20 + r)
        x[r * chunk:(r + 1) * chunk] += 5.0  # each rank's own largest chunk is a different one
        x[15 * chunk:] += 2.0  # the short last chunk wins only through the sum
        xs.append(x)
    comp = make("csc", ratio=0.2, chunk_size=chunk)  # kc = ceil(3.2) = 4
    outs = exchange_ranks(comp, xs)
    expected = torch.zeros(n, dtype=torch.bool)
    for c in (0, 1, 2, 15):
        expected[c * chunk:(c + 1) * chunk] = True
    assert torch.equal(_csc_reference(xs, 0.2, chunk), expected)
    mean = (xs[0] + xs[1] + xs[2]) / 3
    for x, out in zip(xs, outs):
        assert torch.equal(out.mask, expected)
        torch.testing.assert_close(out.aggregate, torch.where(expected, mean, 0.0))
        assert torch.equal(out.sent, torch.where(expected, x, 0.0))
    # 16 fp32 norms + 3 full chunks + the 40 real elements of the last one (padding is not sent).
    assert bytes_counted_and_claimed(comp, xs[0]) == (4 * 16 + 4 * (3 * 64 + 40),) * 2


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 40), st.sampled_from([0.01, 0.3, 1.0]), st.integers(0, 1000))
def test_csc_matches_reference(n, chunk, ratio, seed):
    xs = [randn(n, seed=seed + r) for r in range(2)]
    outs = exchange_ranks(make("csc", ratio=ratio, chunk_size=chunk), xs)
    mask = _csc_reference(xs, ratio, chunk)
    for x, out in zip(xs, outs):
        assert torch.equal(out.mask, mask)
        torch.testing.assert_close(out.aggregate, torch.where(mask, (xs[0] + xs[1]) / 2, 0.0))


@pytest.mark.parametrize("chunk", [1, 7, 256, 5000, 9000])
def test_csc_chunk_norms_in_blocks_are_those_of_the_padded_matrix(chunk):
    x = randn(600_001, seed=chunk)  # several blocks of rows, and a padded last chunk
    nchunks = -(-x.numel() // chunk)
    padded = torch.cat([x, x.new_zeros(nchunks * chunk - x.numel())]).view(nchunks, chunk)
    assert torch.equal(make("csc", chunk_size=chunk).chunk_norms(x, nchunks), padded.abs().sum(dim=1))


def test_csc_requests_are_two_allreduces_and_ties_pick_lowest_chunk_ids():
    comp = make("csc", ratio=0.25, chunk_size=64)
    x = torch.zeros(512)
    gen = comp.exchange(x, ctx_for(x.shape))
    norms = next(gen)
    assert isinstance(norms, AllReduce) and norms.tensor.shape == (8,) and norms.tensor.dtype == torch.float32
    values = gen.send(norms.tensor)
    assert isinstance(values, AllReduce) and values.tensor.shape == (128,)
    with pytest.raises(StopIteration) as stop:
        gen.send(values.tensor)
    assert stop.value.value.mask.nonzero().reshape(-1).tolist() == list(range(128))


def test_csc_momentum_feedback_masks_selected_chunks():
    state = GradzipState("csc", ratio=0.25, chunk_size=8, feedback="momentum", momentum=0.5)
    g = randn(4, 8, seed=30)
    g[2] *= 10  # the chunk (row) with the largest L1 norm
    (aggregate,) = state.exchange([("w", g)])
    chosen = torch.zeros(4, 8, dtype=torch.bool)
    chosen[2] = True
    assert torch.equal(aggregate, torch.where(chosen, g, 0.0))
    assert torch.equal(state.tensors["w"]["momentum"], torch.where(chosen, 0.0, g))
    assert torch.equal(state.tensors["w"]["velocity"], torch.where(chosen, 0.0, g))


# -- parameter validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name, param, value", [
    ("randomk", "ratio", 0), ("randomk", "ratio", 1.5), ("randomk", "unbiased", "yes"),
    ("randomk", "value_dtype", "int8"), ("randomk", "feedback", "momentum"),
    ("threshold", "tau", 0), ("threshold", "tau", -1.0), ("threshold", "tau", float("nan")),
    ("threshold", "tau", float("inf")), ("threshold", "tau", "1e-3"),
    ("dropping", "drop_ratio", 1.0), ("dropping", "drop_ratio", -0.1), ("dropping", "sample_ratio", 0),
    ("dropping", "sample_ratio", 2),
    ("dgc", "ratio", 0), ("dgc", "momentum", 1.0), ("dgc", "momentum", -0.1), ("dgc", "nesterov", 1),
    ("dgc", "clip_norm", 0), ("dgc", "clip_norm", float("inf")), ("dgc", "warmup_epochs", -1),
    ("dgc", "warmup_epochs", 1.5), ("dgc", "warmup_steps", -1), ("dgc", "warmup_steps", 2.5),
    ("dgc", "warmup_steps", None), ("dgc", "sample_ratio", 0), ("dgc", "min_numel", -1),
    ("dgc", "value_dtype", "float64"), ("dgc", "feedback", "bogus"),
    ("csc", "ratio", 0), ("csc", "chunk_size", 0), ("csc", "chunk_size", 2.5), ("csc", "momentum", 1.5),
    ("csc", "nesterov", None), ("csc", "clip_norm", -1.0),
])
def test_invalid_parameters_raise_one_line_value_error(name, param, value):
    with pytest.raises(ValueError) as err:
        make(name, **{param: value})
    message = str(err.value)
    assert param in message and repr(value) in message and "\n" not in message


def test_dgc_exposes_momentum_parameters():
    comp = make("dgc", momentum=0.5, nesterov=True, clip_norm=2.0)
    assert (comp.momentum, comp.nesterov, comp.clip_norm) == (0.5, True, 2.0)
    assert make("dgc").feedback == "momentum" and make("csc").feedback == "residual"
    assert make("csc", feedback="momentum").momentum == 0.9


@pytest.mark.parametrize("case", ["plain", "signed zeros", "ties", "one sign", "small"])
def test_adaptive_threshold_keeps_the_largest_of_each_sign_and_their_means(case):
    # Each side is the ceil(ratio * |P|) largest positive (most negative) values, as a topk over the
    # values of that sign picks them; ties may be broken differently, so the kept values are compared.
    n = 301 if case == "small" else 300_007
    x = torch.randn(n, generator=torch.Generator().manual_seed(5)) * 0.01
    if case == "signed zeros":
        x[::3] = 0.0
        x[1::3] = -0.0
    if case == "ties":
        x = (x * 300).round() / 300
    if case == "one sign":
        x = x.abs()
    comp = make("adaptive_threshold", ratio=0.01)
    for sign in (1.0, -1.0):
        idx, mean = comp._side(x, sign)
        signed = x * sign
        positive = signed[signed > 0]
        k = math.ceil(0.01 * positive.numel())
        expected = torch.topk(positive, k).values
        assert idx.unique().numel() == idx.numel() == k
        assert torch.equal(signed[idx].sort().values, expected.sort().values)
        if k:
            assert torch.allclose(mean, sign * expected.mean(), rtol=1e-5, atol=0)
        else:
            assert case == "one sign" and sign < 0 and float(mean) == 0.0

