"""Mixed precision: error feedback under ``torch.amp.GradScaler`` (the hook sees scaled gradients), and
16-bit wire values that error feedback sends saturated instead of overflowing."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradzip
from tests.distributed import run_workers

# -- error feedback follows GradScaler's scale --------------------------------------------------------------

#: (method, parameters): each kind of state held in gradient units: a residual (Top-k; PowerSGD's
#: error, beside its basis Q, which is not), DGC's momentum and velocity, Signum's momentum,
#: SparseLoCo's accumulator.
SCALED_STATE = [
    ("topk", {"ratio": 0.1}),
    ("dgc", {"ratio": 0.1, "min_numel": 256, "warmup_epochs": 0}),
    ("powersgd", {"rank": 2, "dense_steps": 0}),
    ("signum", {}),
    ("sparseloco", {"chunk": 64, "density": 0.1}),
]
STEPS = 12
#: Steps at which rank 1's input holds an Inf: the scaler skips them and halves its scale.
INF_STEPS = (3, 7)


def _train(rank, name, params, bucketed, mode):
    """DDP with gradzip over STEPS steps: ``mode`` "plain" (no loss scaling; the steps whose gradients
    are not finite skipped by hand, as GradScaler does), "follows" (GradScaler, ``grad_scaler=``) or
    "unaware" (GradScaler, the state not told).  The scale starts at 2^8 and doubles every 2 steps
    (growth_interval=2) except where INF_STEPS halve it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.Tanh(), nn.Linear(48, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    scaler = None if mode == "plain" else torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    told = {"grad_scaler": scaler} if mode == "follows" else {}
    state = gradzip.register(ddp, name, bucketed=bucketed, **params, **told)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(100 + rank)
    scales = []
    for step in range(STEPS):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 8, generator=gen)
        if step in INF_STEPS and rank == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        if scaler is None:
            loss.backward()
            if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
                opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    kept = {key: {n: v.clone() for n, v in slot.items()} for key, slot in state.tensors.items()}
    state.close()
    return {"params": [p.detach().clone() for p in model.parameters()], "state": kept, "scales": scales}


def _loss_scaled_runs(rank, world, name, params, modes):
    return {(bucketed, mode): _train(rank, name, params, bucketed, mode)
            for bucketed in (False, True) for mode in modes}


#: State in gradient units, which the scale applies to; other state (PowerSGD's basis Q) is not compared.
GRADIENT_UNITS = {"residual", "momentum", "velocity", "signum_momentum", "sparseloco_error"}
#: PowerSGD divides by norm + epsilon, which is not scaled: equal to rounding, not bit for bit.
ROUNDING = {"powersgd": 1e-5}


def _same(a, b, name):
    if name in ROUNDING:
        return torch.allclose(a, b, rtol=ROUNDING[name], atol=ROUNDING[name] * float(b.abs().max()))
    return torch.equal(a, b)


@pytest.mark.parametrize("name, params", SCALED_STATE, ids=[n for n, _ in SCALED_STATE])
def test_error_feedback_follows_the_loss_scale(name, params):
    """Under GradScaler, with ``grad_scaler=``: the same parameters and the same state (in unscaled
    units) as training without loss scaling, on both routes, through two back-offs and five growths;
    the scaler's scale is powers of two, so "the same" is bit for bit (PowerSGD: to rounding).  Without
    ``grad_scaler=`` the state is kept in the units of the scale at the time, and the runs part."""
    ranks = run_workers(_loss_scaled_runs, 2, name, params, ("plain", "follows", "unaware"))
    for got in ranks:
        for bucketed in (False, True):
            plain, follows, unaware = (got[(bucketed, mode)] for mode in ("plain", "follows", "unaware"))
            where = f"{name}, bucketed={bucketed}"
            assert follows["scales"] == [2.0**e for e in (8, 9, 9, 8, 8, 9, 9, 8, 8, 9, 9, 10)], follows["scales"]
            for a, b in zip(follows["params"], plain["params"]):
                assert _same(a, b, name), (where, (a - b).abs().max())
            held = 0
            for key, slot in plain["state"].items():
                for n, v in slot.items():
                    if n in GRADIENT_UNITS:
                        assert _same(follows["state"][key][n], v, name), (where, key, n)
                        held += 1
            assert held, f"{where}: no state in gradient units was kept"
            drift = max(float((a - b).abs().max()) for a, b in zip(unaware["params"], plain["params"]))
            assert drift > 1e-3, f"{where}: without grad_scaler= the runs should part, differ by {drift}"


# -- 16-bit wire values beyond the range are sent saturated where error feedback keeps the excess ----------

#: Every method whose wire values can be 16-bit and that keeps error feedback (its default, or the other
#: scheme it takes), with parameters that make it compress small tensors; and the gradient dtype.
SATURATING = [
    ("topk", {"ratio": 0.3, "value_dtype": "float16"}, torch.float32),
    ("randomk", {"ratio": 0.5, "value_dtype": "float16"}, torch.float32),
    ("randomk", {"ratio": 0.5}, torch.float16),  # fp16 gradients: the values' dtype is theirs
    ("threshold", {"tau": 1.0, "value_dtype": "float16"}, torch.float32),
    ("dropping", {"drop_ratio": 0.5, "value_dtype": "float16"}, torch.float32),
    ("dgc", {"ratio": 0.3, "min_numel": 0, "warmup_epochs": 0, "value_dtype": "float16"}, torch.float32),
    ("dgc", {"ratio": 0.3, "min_numel": 0, "warmup_epochs": 0, "value_dtype": "float16", "feedback": "residual"},
     torch.float32),
    ("csc", {"chunk_size": 4, "ratio": 0.5, "value_dtype": "float16"}, torch.float32),
    ("csc", {"chunk_size": 4, "ratio": 0.5, "value_dtype": "float16", "feedback": "momentum"}, torch.float32),
    ("fp16", {"feedback": "residual"}, torch.float32),
]
SATURATING_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}-{str(d)[6:]}" for n, p, d in SATURATING]
SHAPES = [(8, 40), (40,), (5, 8)]
#: Values beyond fp16's 65504 planted in the first step's gradients: (tensor, position, value).
HUGE = [(0, (1, 3), 1e5), (0, (6, 17), -2.5e5), (1, (7,), 7e4), (2, (4, 4), 3e6)]


def _gradients(step, rank, dtype):
    """Small gradients, and at step 0 those of HUGE (in fp16 gradients: 6e4 at every step, so that the
    residual pushes them beyond 65504)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    grads = [torch.randn(shape, generator=gen) for shape in SHAPES]
    for tensor, at, value in HUGE:
        if dtype == torch.float16:
            grads[tensor][at] = 6e4 if value > 0 else -6e4
        elif step == 0:
            grads[tensor][at] = value
    return [(f"t{i}", g.to(dtype)) for i, g in enumerate(grads)]


def _increment(state_before, key, g, feedback):
    """What the feedback adds to this step's input: g + e (residual), or DGC's u = m u + g added to v."""
    slot = state_before.get(key, {})
    if feedback == "residual":
        e = slot.get("residual")
        return g if e is None else g + e
    u = slot.get("momentum")
    u = g if u is None else u * 0.9 + g
    v = slot.get("velocity")
    return u if v is None else v + u


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
@pytest.mark.parametrize("name, params, dtype", SATURATING, ids=SATURATING_IDS)
def test_values_beyond_fp16_are_sent_saturated_and_conserved(name, params, dtype, bucketed):
    """At world size 1 (the aggregate is what was sent): every aggregate is finite, no sent value is
    beyond 65504, and sent + new state == old state + gradient exactly, over steps that first carry
    values up to 3e6 and then deliver them, 65504 at a time, out of the feedback's state."""
    state = gradzip.GradzipState(name, bucketed=bucketed, **params)
    feedback = state.compressor.feedback
    held = "residual" if feedback == "residual" else "velocity"
    for step in range(8):
        named = _gradients(step, 0, dtype)
        before = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state.tensors.items()}
        out = state.exchange([(k, g.clone()) for k, g in named])
        assert len(state._route.buckets) == int(bucketed)
        for (key, g), sent in zip(named, out):
            assert torch.isfinite(sent).all(), (key, step)
            whole = name == "dgc" and g.dim() < 2  # DGC sends vectors whole, in the gradients' dtype
            assert whole or float(sent.abs().max()) <= 65504, (key, step)
            kept = state.tensors.get(key, {}).get(held)
            given = _increment(before, key, g.float(), feedback)
            got = sent.float() + (0 if kept is None else kept)
            if dtype == torch.float16:  # the aggregate is handed back in fp16: sent rounded once more
                assert float((got - given).abs().max()) <= 32, (key, step)
            else:
                assert torch.equal(got, given), (key, step, (got - given).abs().max())
    owed = max(float(slot[held].abs().max()) for slot in state.tensors.values() if held in slot)
    if dtype == torch.float32:  # 3e6 is delivered 65504 a step (45 steps): most of it is still owed
        assert owed > 2e6, owed


def _saturating_ranks(rank, world):
    """Every SATURATING case on both routes: per step, the aggregates and this rank's share of them
    (what it was to send, less what its feedback kept)."""
    runs = {}
    for case, (name, params, dtype) in zip(SATURATING_IDS, SATURATING):
        for bucketed in (False, True):
            state = gradzip.GradzipState(name, bucketed=bucketed, **params)
            feedback = state.compressor.feedback
            held = "residual" if feedback == "residual" else "velocity"
            steps = runs[(case, bucketed)] = []
            for step in range(4):
                named = _gradients(step, rank, dtype)
                before = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state.tensors.items()}
                out = state.exchange([(k, g.clone()) for k, g in named])
                mine = [_increment(before, k, g.float(), feedback) - state.tensors.get(k, {}).get(held, 0)
                        for k, g in named]
                steps.append(([a.clone() for a in out], mine))
            state.close()
    return runs


def test_two_ranks_beyond_fp16_sum_to_a_finite_mean():
    """Two gloo ranks holding the same values beyond 65504 (an allreduce of fp16 halves would sum to
    Inf): every aggregate is finite, and it is the mean of what each rank sent (its input less what it
    kept), for every SATURATING case on both routes."""
    ranks = run_workers(_saturating_ranks, 2)
    for (case, bucketed), steps in ranks[0].items():
        for step, ((out0, mine0), (out1, mine1)) in enumerate(zip(steps, ranks[1][(case, bucketed)])):
            for a, b, m0, m1 in zip(out0, out1, mine0, mine1):
                where = (case, bucketed, step)
                assert torch.equal(a, b) and torch.isfinite(a).all(), where
                tol = 32 if a.dtype == torch.float16 else 1e-2
                assert float((a.float() - (m0 + m1) / 2).abs().max()) <= tol, where


def _outlier(rank, world, bucketed, steps=24):
    """Random-k (ratio 0.5, fp16 values) over 2 ranks: at step 0 element 5 is 1e5 on both ranks (their
    fp16 halves sum past 65504) and element 9 is 3e5 on rank 0 (its half alone is beyond), then small
    gradients; every aggregate, the gradients and the final residual."""
    state = gradzip.GradzipState("randomk", ratio=0.5, value_dtype="float16", bucketed=bucketed)
    gen = torch.Generator().manual_seed(rank)
    grads, aggregates = [], []
    for step in range(steps):
        g = torch.randn(64, generator=gen) * 1e-2
        if step == 0:
            g[5] = 1e5
            g[9] = 3e5 if rank == 0 else 1.0
        grads.append(g.clone())
        aggregates.append(state.exchange([("w", g)])[0].clone())
    residual = state.tensors["w"]["residual"].clone()
    state.close()
    return {"grads": torch.stack(grads), "aggregates": torch.stack(aggregates), "residual": residual}


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
def test_randomk_delivers_a_residual_beyond_fp16_over_later_steps(bucketed):
    """Without saturation an element that was not drawn at once stayed in the residual, and every step
    that drew it later overflowed and was skipped, for ever.  Now every aggregate is finite, and the
    outliers' mass reaches the aggregate over later steps: what all aggregates delivered plus what the
    ranks still owe is what they were given, and of the outliers almost nothing is still owed."""
    ranks = run_workers(_outlier, 2, bucketed)
    aggregates = ranks[0]["aggregates"]
    finite = aggregates.isfinite().all(dim=1)
    assert finite.all(), f"steps with finite aggregates: {finite.tolist()}"
    assert torch.equal(aggregates, ranks[1]["aggregates"])
    given = sum(r["grads"].double().sum(0) for r in ranks) / 2
    owed = sum(r["residual"].double() for r in ranks) / 2
    delivered = aggregates.double().sum(0)
    # The fp16 allreduce rounds the sum of the ranks' halves (an ulp is 16 near 32736), which no
    # residual holds: equal up to that.
    torch.testing.assert_close(delivered + owed, given, rtol=1e-5, atol=1e-3)
    assert delivered[5] > 1e5 - 1 and delivered[9] > 1.5e5 - 1, delivered[[5, 9]]
    assert owed[[5, 9]].abs().max() < 1, owed[[5, 9]]
    assert int((aggregates[:, 9] != 0).sum()) >= 3  # 1.5e5 of mean took at least three draws of 65504 at most


# -- the two together: GradScaler at a scale that overflows fp16 on the wire ----------------------------------

#: The methods of tests/test_overflow.py's GradScaler run, with their error feedback: sent saturated.
UNDER_SCALER = [
    ("topk", {"ratio": 0.5, "value_dtype": "float16"}),
    ("randomk", {"ratio": 0.5, "value_dtype": "float16"}),
    ("dgc", {"ratio": 0.5, "value_dtype": "float16", "min_numel": 1, "warmup_steps": 0}),
    ("csc", {"value_dtype": "float16"}),
    ("fp16", {"feedback": "residual"}),
]


def _under_scaler(rank, world):
    from tests.test_overflow import _amp_worker
    return {name: _amp_worker(rank, world, name, params) for name, params in UNDER_SCALER}


def test_with_error_feedback_a_wire_beyond_fp16_skips_no_step():
    """tests/test_overflow.py's GradScaler run at 2^24 (gradients of order 1e-2..1 scaled far beyond
    65504): with error feedback nothing overflows, as the excess is sent later, so no step is skipped
    and the scale does not back off (it backs off where the wire overflows without feedback, there)."""
    ranks = run_workers(_under_scaler, 2)
    for name in ranks[0]:
        for r in ranks:
            assert (r[name]["skipped"], r[name]["taken"], r[name]["nonfinite"]) == (0, 14, 0), name
        for a, b in zip(ranks[0][name]["params"], ranks[1][name]["params"]):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
@pytest.mark.parametrize("name, params, dtype", SATURATING, ids=SATURATING_IDS)
def test_saturation_hides_no_inf_of_the_input(name, params, dtype, bucketed):
    """A clamp turns Inf into 65504: an Inf in the input must still skip the step (the owner reads the
    input of a saturating method), leaving the state as it was."""
    state = gradzip.GradzipState(name, bucketed=bucketed, **params)
    state.exchange(_gradients(0, 0, dtype))
    before = {k: {n: v.clone() for n, v in slot.items()} for k, slot in state.tensors.items()}
    named = _gradients(1, 0, dtype)
    named[0][1][2, 2] = float("-inf")
    out = state.exchange(named)
    assert all(bool(torch.isnan(o).all()) for o in out), [bool(torch.isnan(o).all()) for o in out]
    assert state.stats()["nonfinite_exchanges"] == 1
    assert all(torch.equal(before[k][n], v) for k, slot in state.tensors.items() for n, v in slot.items())


# -- the state's scale, at world size 1 -------------------------------------------------------------------------


def _scaler(scale=None):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if scale is not None:
        scaler.scale(torch.ones(()))  # GradScaler makes its scale tensor on its first scale()
        scaler.update(new_scale=scale)
    return scaler


@pytest.mark.parametrize("bucketed", [False, True], ids=["per-tensor", "bucket"])
@pytest.mark.parametrize("name, params", SCALED_STATE, ids=[n for n, _ in SCALED_STATE])
def test_state_follows_the_scale_it_is_given(name, params, bucketed):
    """Gradients times a scale that changes every step (and a scaler that has not scaled yet: scale 1):
    aggregates are the unscaled run's times the scale, and the state is the unscaled run's (bit for
    bit, PowerSGD to rounding)."""
    scaler = _scaler()
    scaled = gradzip.GradzipState(name, bucketed=bucketed, grad_scaler=scaler, **params)
    plain = gradzip.GradzipState(name, bucketed=bucketed, **params)
    gen = torch.Generator().manual_seed(0)
    for step, scale in enumerate([None, 2.0**4, 2.0**12, 2.0**11, 2.0**13, 2.0**3]):
        if scale is not None:
            scaler.scale(torch.ones(()))  # the first makes the scaler's scale tensor
            scaler.update(new_scale=scale)
        named = [("w", torch.randn(16, 32, generator=gen)), ("b", torch.randn(16, generator=gen))]
        want = plain.exchange(named)
        got = scaled.exchange([(k, g * (scale or 1.0)) for k, g in named])
        for a, b in zip(got, want):
            assert _same(a, b * (scale or 1.0), name), (step, (a - b * (scale or 1.0)).abs().max())
        for key, slot in plain.tensors.items():
            for n, v in slot.items():
                if n in GRADIENT_UNITS:
                    assert _same(scaled.tensors[key][n], v, name), (step, key, n)


def test_the_bucket_route_reads_the_scale_without_a_host_read():
    from gradzip.testing import OpCounter
    scaler = _scaler(2.0**9)
    for name, params in SCALED_STATE:
        state = gradzip.GradzipState(name, bucketed=True, grad_scaler=scaler, **params)
        named = [("w", torch.randn(16, 32)), ("b", torch.randn(16))]
        state.exchange(named)
        reads = OpCounter()
        with reads:
            state.exchange(named)
        plain = gradzip.GradzipState(name, bucketed=True, **params)
        plain.exchange(named)
        base = OpCounter()
        with base:
            plain.exchange(named)
        assert reads.reads == base.reads, (name, reads.host_reads, base.host_reads)


def test_grad_scaler_reaches_the_state_and_is_checked():
    scaler = _scaler()
    model = nn.Linear(4, 2)
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       "topk", ratio=0.5, grad_scaler=scaler)
    assert opt.gradzip_state.grad_scaler is scaler
    assert opt.gradzip_state.loss_scale(torch.device("cpu")) is None  # no scale() yet: nothing to follow
    scaler.scale(torch.ones(()))
    assert opt.gradzip_state.loss_scale(torch.device("cpu")) is scaler._scale
    with pytest.raises(ValueError, match="^grad_scaler must be a torch.amp.GradScaler or None, got float$"):
        gradzip.GradzipState("topk", grad_scaler=2.0**16)
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert gradzip.GradzipState("topk", grad_scaler=disabled).loss_scale(torch.device("cpu")) is None


def test_the_checked_add_of_large_tensors_follows_the_scale(monkeypatch):
    """Residual feedback's g + e checked chunk by chunk (large CPU tensors) adds e at the current scale."""
    import gradzip.feedback as feedback
    calls = []
    checked_add = feedback._checked_add
    monkeypatch.setattr(feedback, "_checked_add", lambda *a, **k: calls.append(1) or checked_add(*a, **k))
    scaler = _scaler(2.0**6)
    scaled = gradzip.GradzipState("topk", ratio=0.01, grad_scaler=scaler)
    plain = gradzip.GradzipState("topk", ratio=0.01)
    gen = torch.Generator().manual_seed(0)
    for scale in (2.0**6, 2.0**9, 2.0**2):
        scaler.update(new_scale=scale)
        g = torch.randn(600, 500, generator=gen)
        want = plain.exchange([("w", g)])[0]
        assert torch.equal(scaled.exchange([("w", g * scale)])[0], want * scale)
        assert torch.equal(scaled.tensors["w"]["residual"], plain.tensors["w"]["residual"])
    assert len(calls) == 4  # steps 2 and 3, in each state
