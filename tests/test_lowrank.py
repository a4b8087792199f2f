"""PowerSGD (gradzip/compressors/lowrank.py): equations, warm start, multi-rank agreement, error feedback."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradzip
from gradzip.collectives import simulate
from gradzip.compressors.base import TensorContext
from gradzip.compressors.lowrank import PowerSGD, orthogonalize
from gradzip.state import GradzipState


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def low_rank(n: int, m: int, r: int, seed: int = 0) -> torch.Tensor:
    g = gen(seed)
    return torch.randn(n, r, generator=g) @ torch.randn(r, m, generator=g)


def run(comp, xs, *, step=0, states=None, key="w"):
    """One exchange on len(xs) simulated ranks; returns (Exchanged per rank, contexts)."""
    world = len(xs)
    states = states or [{} for _ in xs]
    ctxs = [TensorContext(key, xs[0].shape, torch.float32, step=step, rank=r, world_size=world, state=states[r])
            for r in range(world)]
    outs = simulate([[comp.exchange(x, ctx)] for x, ctx in zip(xs, ctxs)])
    return [o[0] for o in outs], ctxs


def first_request(comp, x, ctx):
    return next(comp.exchange(x, ctx)).tensor


def rel_err(a, b):
    return (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item()


# -- the equations -----------------------------------------------------------------------------------

@pytest.mark.parametrize("r", [1, 2, 4])
def test_rank_r_matrix_is_reconstructed_in_one_step(r):
    x = low_rank(40, 30, r, seed=r)
    (out,), _ = run(PowerSGD(rank=r, dense_steps=0), [x])
    assert rel_err(out.aggregate, x) < 1e-5
    assert torch.equal(out.aggregate, out.sent)  # one worker: its contribution is the aggregate


def test_rank_one_step_matches_hand_computation():
    # M = [[1,2],[3,4],[5,6]], warm start Q = [1,1]^T (normalised to [1,1]/sqrt2):
    # P = M Q ∝ [3,7,11] -> p = [3,7,11]/sqrt(179); Q = M^T p = [79,100]/sqrt(179); M_hat = p Q^T.
    M = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    comp = PowerSGD(rank=1, dense_steps=0, min_compression=0)
    (out,), ctxs = run(comp, [M], states=[{"Q": torch.ones(2, 1)}])
    expected = torch.tensor([[3.0], [7.0], [11.0]]) @ torch.tensor([[79.0, 100.0]]) / 179
    torch.testing.assert_close(out.aggregate, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ctxs[0].updates["Q"], torch.tensor([[79.0], [100.0]]) / math.sqrt(179))


def test_rank_two_step_matches_qr_reference_on_two_ranks():
    # Reference written independently of the implementation's Gram-Schmidt: QR with R's diagonal made
    # positive gives the same orthonormal P.
    M1, M2 = torch.randn(6, 5, generator=gen(1)), torch.randn(6, 5, generator=gen(2))
    Q0 = torch.randn(5, 2, generator=gen(3))
    comp = PowerSGD(rank=2, dense_steps=0, min_compression=0)
    outs, ctxs = run(comp, [M1, M2], states=[{"Q": Q0}, {"Q": Q0.clone()}])

    Qn, R = torch.linalg.qr(Q0)
    Qn = Qn * torch.sign(torch.diagonal(R))
    P, R = torch.linalg.qr(M1 @ Qn + M2 @ Qn)
    P = P * torch.sign(torch.diagonal(R))
    Q1, Q2 = M1.T @ P, M2.T @ P
    Qbar = (Q1 + Q2) / 2
    torch.testing.assert_close(outs[0].aggregate, P @ Qbar.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0].sent, P @ Q1.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].sent, P @ Q2.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ctxs[1].updates["Q"], Qbar, rtol=1e-5, atol=1e-5)


def test_warm_started_power_iteration_approaches_best_rank_r_error():
    # Fixed matrix with a spectral gap after r: subspace iteration converges to the top-r subspace, so
    # the error falls towards the Eckart-Young optimum.  Without warm start every step restarts.
    n, m, r = 64, 48, 2
    U, _ = torch.linalg.qr(torch.randn(n, n, generator=gen(5)))
    V, _ = torch.linalg.qr(torch.randn(m, m, generator=gen(6)))
    s = torch.cat([torch.tensor([10.0, 8.0]), 6.0 * 0.9 ** torch.arange(m - 2.0)])
    M = U[:, :m] @ torch.diag(s) @ V.T
    best = torch.linalg.norm(s[r:]).item()

    def errors(warm_start):
        comp, state, errs = PowerSGD(rank=r, dense_steps=0, warm_start=warm_start), {}, []
        for step in range(12):
            (out,), (ctx,) = run(comp, [M], step=step, states=[state])
            state = {**state, **ctx.updates}
            errs.append(torch.linalg.norm(M - out.aggregate).item())
        return errs

    warm = errors(True)
    # Error decreases step after step (rounding slack only) ...
    assert all(b < a for a, b in zip(warm[:6], warm[1:6])), warm
    assert all(b <= a * (1 + 1e-5) for a, b in zip(warm, warm[1:])), warm
    # ... from well above the optimum (1.17x here) to it.
    assert warm[0] > 1.1 * best
    assert warm[-1] < 1.0001 * best
    cold = errors(False)
    assert min(cold) > 1.1 * best  # a fresh Q each step: no step gets close to the optimum


# -- orthogonalisation ----------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 40), r=st.integers(1, 5), zeros=st.sets(st.integers(0, 4)))
def test_orthogonalize_gives_orthonormal_or_zero_columns(seed, n, r, zeros):
    r = min(r, n)
    a = torch.randn(n, r, generator=gen(seed), dtype=torch.float64) * 10.0 ** (seed % 7 - 3)
    zero = [i for i in sorted(zeros) if i < r]
    a[:, zero] = 0
    before = a.clone()
    # float64 and a negligible epsilon: what is left is Gram-Schmidt's own rounding (the shrink that
    # epsilon causes is checked exactly below).
    q = orthogonalize(a, 1e-30)
    assert torch.equal(a, before)  # input untouched
    live = [i for i in range(r) if i not in zero]
    assert torch.isfinite(q).all()
    assert torch.equal(q[:, zero], torch.zeros(n, len(zero), dtype=q.dtype))
    gram = q[:, live].T @ q[:, live]
    torch.testing.assert_close(gram, torch.eye(len(live), dtype=q.dtype), rtol=0, atol=1e-6)
    # Same span as the input: projecting the input onto the columns changes nothing.
    torch.testing.assert_close(q @ (q.T @ a), a, rtol=0, atol=1e-9 * a.abs().max().item())


def test_orthogonalize_divides_by_norm_plus_epsilon():
    a = torch.tensor([[3e-8, 0.0, 1.0], [4e-8, 0.0, 1.0]])  # column norms 5e-8, 0, sqrt(2)
    q = orthogonalize(a, 1e-8)
    torch.testing.assert_close(q[:, 0], a[:, 0] / 6e-8)  # a tiny column is shrunk by norm / (norm + eps)
    assert torch.equal(q[:, 1], torch.zeros(2))          # a zero column stays zero: no 0/0
    torch.testing.assert_close(torch.linalg.vector_norm(q[:, 2]), torch.tensor(1.0))
    assert torch.isfinite(orthogonalize(torch.zeros(4, 2), 1e-8)).all()


def test_zero_gradient_gives_zero_without_nan_and_the_basis_recovers():
    comp = PowerSGD(rank=2, dense_steps=0)
    (out,), (ctx,) = run(comp, [torch.zeros(20, 30)])
    assert torch.equal(out.aggregate, torch.zeros(20, 30)) and torch.equal(out.sent, torch.zeros(20, 30))
    assert torch.equal(ctx.updates["Q"], torch.zeros(30, 2))
    # A zero warm-start basis would stay zero forever; it is redrawn, so the next matrix is recovered.
    x = low_rank(20, 30, 2, seed=9)
    (out,), _ = run(comp, [x], step=1, states=[ctx.updates])
    assert rel_err(out.aggregate, x) < 1e-5


# -- when to compress --------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,rank,min_compression,expected", [
    ((9, 9), 2, 2.0, True),          # (9+9)*2*2 = 72 < 81
    ((8, 8), 2, 2.0, False),         # (8+8)*2*2 = 64, not < 64: the paper's strict rule
    ((100, 3), 1, 2.0, True),        # 103*1*2 = 206 < 300
    ((100, 3), 2, 2.0, False),       # 103*2*2 = 412 > 300
    ((30, 30), 8, 1.0, True),        # 60*8*1 = 480 < 900
    ((30, 30), 8, 2.0, False),       # 60*8*2 = 960 > 900
    ((16, 3, 3, 3), 2, 2.0, True),   # conv: 16 x 27, (16+27)*2*2 = 172 < 432
    ((64,), 1, 0.0, False),          # 1-D tensors go dense
    ((), 1, 0.0, False),
    ((1,), 1, 0.0, False),
    ((0, 5), 1, 0.0, False),         # empty
    ((5, 0), 1, 0.0, False),
    ((3, 0, 4), 1, 0.0, False),
    ((2, 2), 4, 0.0, True),          # rank clamped to min(n, m) = 2
])
def test_pays_rule(shape, rank, min_compression, expected):
    ctx = TensorContext("w", torch.Size(shape), torch.float32, step=5)
    comp = PowerSGD(rank=rank, dense_steps=0, min_compression=min_compression)
    assert comp.compresses(ctx) is expected


def test_dense_steps_switch():
    comp = PowerSGD(rank=1, dense_steps=10)
    shape = torch.Size((32, 32))
    assert [comp.compresses(TensorContext("w", shape, torch.float32, step=s)) for s in (0, 9, 10, 11)] == \
        [False, False, True, True]
    assert PowerSGD(dense_steps=0).compresses(TensorContext("w", shape, torch.float32, step=0))


def test_payload_bytes_match_bytes_counted():
    state = GradzipState("powersgd", rank=2, dense_steps=1)
    grads = [("conv", torch.randn(16, 3, 3, 3)), ("fc", torch.randn(40, 50)), ("bias", torch.randn(40))]
    for step in range(2):  # step 0 dense, step 1 compressed
        ctxs = [state.context(k, g) for k, g in grads]
        state.exchange(grads)
        assert state.last_report.per_tensor_payload == [state.compressor.payload_bytes(c) for c in ctxs]
    assert state.compressor.payload_bytes(ctxs[1]) == (40 + 50) * 2 * 4
    assert state.compressor.payload_bytes(ctxs[0]) == (16 + 27) * 2 * 4


# -- warm start ------------------------------------------------------------------------------------------

def test_warm_start_reuses_the_stored_basis():
    x = torch.randn(30, 40, generator=gen(11))
    comp = PowerSGD(rank=2, dense_steps=0)
    (out,), (ctx,) = run(comp, [x], step=0)
    Qbar = ctx.updates["Q"]
    assert Qbar.shape == (40, 2)
    nxt = TensorContext("w", x.shape, torch.float32, step=1, state=dict(ctx.updates))
    torch.testing.assert_close(first_request(comp, x, nxt), x @ orthogonalize(Qbar, 1e-8))
    # The basis is the same on every step that has none stored (and differs when one is stored).
    fresh = TensorContext("w", x.shape, torch.float32, step=0)
    assert torch.equal(first_request(comp, x, fresh), first_request(comp, x, TensorContext("w", x.shape,
                                                                                           torch.float32)))
    assert not torch.allclose(first_request(comp, x, nxt), first_request(comp, x, fresh))


def test_without_warm_start_q_is_redrawn_every_step():
    x = torch.randn(30, 40, generator=gen(12))
    comp = PowerSGD(rank=2, dense_steps=0, warm_start=False)
    stored = {"Q": torch.ones(40, 2)}
    req = [first_request(comp, x, TensorContext("w", x.shape, torch.float32, step=s, state=stored)) for s in (3, 3, 4)]
    assert torch.equal(req[0], req[1])         # same step: same draw (all ranks agree)
    assert not torch.allclose(req[0], req[2])  # next step: a new draw
    assert not torch.allclose(req[0], x @ orthogonalize(torch.ones(40, 2), 1e-8))  # stored Q ignored


def test_stored_basis_of_another_shape_is_redrawn():
    # E.g. a checkpoint written with another rank: reusing it would silently change the rank.
    x = torch.randn(30, 40, generator=gen(13))
    comp = PowerSGD(rank=2, dense_steps=0)
    ctx = TensorContext("w", x.shape, torch.float32, state={"Q": torch.ones(40, 3)})
    assert first_request(comp, x, ctx).shape == (30, 2)


# -- several ranks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_and_aggregate_is_mean_of_sent(world):
    comp = PowerSGD(rank=2, dense_steps=0)
    states = [{} for _ in range(world)]
    for step in range(3):
        xs = [torch.randn(24, 36, generator=gen(100 * step + r)) for r in range(world)]
        outs, ctxs = run(comp, xs, step=step, states=states)
        for out in outs[1:]:
            assert torch.equal(out.aggregate, outs[0].aggregate)
        for ctx in ctxs[1:]:
            assert torch.equal(ctx.updates["Q"], ctxs[0].updates["Q"])
        mean_sent = torch.stack([o.sent for o in outs]).mean(0)
        torch.testing.assert_close(outs[0].aggregate, mean_sent, rtol=1e-5, atol=1e-6)
        states = [{**s, **c.updates} for s, c in zip(states, ctxs)]


def test_shared_low_rank_mean_is_recovered_across_ranks():
    # Workers' matrices differ but all lie in the same rank-2 column and row spaces: the mean is exact.
    g = gen(21)
    U, V = torch.randn(24, 2, generator=g), torch.randn(2, 36, generator=g)
    xs = [U @ torch.diag(torch.randn(2, generator=g)) @ V for _ in range(4)]
    outs, _ = run(PowerSGD(rank=2, dense_steps=0), xs)
    assert rel_err(outs[0].aggregate, torch.stack(xs).mean(0)) < 1e-5


# -- error feedback through GradzipState --------------------------------------------------------------

def test_error_feedback_keeps_residual_equal_to_input_minus_sent():
    state = GradzipState("powersgd", rank=1, dense_steps=2)
    assert state.compressor.feedback == "residual"
    residual = torch.zeros(20, 30)
    total_in, total_out = torch.zeros(20, 30), torch.zeros(20, 30)
    for step in range(6):
        g = torch.randn(20, 30, generator=gen(50 + step))
        (agg,) = state.exchange([("w", g)])
        slot = state.tensors.get("w", {})
        if step < 2:  # dense warm-up: exact average, no residual, no basis
            assert torch.equal(agg, g) and "residual" not in slot and "Q" not in slot
            continue
        p = g + residual
        # World size 1: sent == aggregate, so the residual is the compensated input minus the aggregate.
        torch.testing.assert_close(slot["residual"], p - agg, rtol=0, atol=1e-6)
        assert torch.linalg.matrix_rank(agg).item() == 1
        assert slot["Q"].shape == (30, 1)
        residual = slot["residual"]
        total_in += g
        total_out += agg
    # Nothing is lost, only delayed: what was applied plus what is owed equals what came in.
    torch.testing.assert_close(total_out + residual, total_in, rtol=0, atol=1e-5)


# -- shapes ----------------------------------------------------------------------------------------------

def test_conv_weight_is_viewed_as_out_by_in_kh_kw():
    mat = low_rank(8, 4 * 3 * 3, 2, seed=31)
    x = mat.reshape(8, 4, 3, 3)
    comp = PowerSGD(rank=2, dense_steps=0, min_compression=1.0)
    ctx = TensorContext("conv", x.shape, torch.float32)
    assert comp.compresses(ctx)
    assert first_request(comp, x, ctx).shape == (8, 2)
    (out,), (ctx,) = run(comp, [x], key="conv")
    assert out.aggregate.shape == x.shape and out.sent.shape == x.shape
    assert ctx.updates["Q"].shape == (36, 2)
    assert rel_err(out.aggregate, x) < 1e-5


def test_non_contiguous_input():
    base = low_rank(30, 20, 2, seed=41)
    x = base.T  # 20 x 30, not contiguous
    (out,), _ = run(PowerSGD(rank=2, dense_steps=0), [x])
    assert rel_err(out.aggregate, x) < 1e-5


def test_registered_with_documented_defaults():
    assert "powersgd" in gradzip.compressors()
    assert gradzip.parameters_of("powersgd") == {"rank": 2, "dense_steps": 10, "warm_start": True, "epsilon": 1e-8,
                                                 "min_compression": 2.0, "feedback": None}
    comp = gradzip.make("powersgd")
    assert comp.feedback == "residual" and comp.deterministic


# -- parameter validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("params,name", [
    ({"rank": 0}, "rank"), ({"rank": -1}, "rank"), ({"rank": 1.5}, "rank"), ({"rank": True}, "rank"),
    ({"rank": "2"}, "rank"),
    ({"dense_steps": -1}, "dense_steps"), ({"dense_steps": 2.0}, "dense_steps"),
    ({"warm_start": 1}, "warm_start"), ({"warm_start": "yes"}, "warm_start"),
    ({"epsilon": 0}, "epsilon"), ({"epsilon": -1e-8}, "epsilon"), ({"epsilon": float("inf")}, "epsilon"),
    ({"epsilon": float("nan")}, "epsilon"),
    ({"min_compression": -1}, "min_compression"), ({"min_compression": float("nan")}, "min_compression"),
    ({"min_compression": float("inf")}, "min_compression"), ({"min_compression": None}, "min_compression"),
    ({"feedback": "bogus"}, "feedback"), ({"feedback": "momentum"}, "feedback"),
])
def test_invalid_parameters_are_rejected(params, name):
    with pytest.raises(ValueError, match=name) as err:
        gradzip.make("powersgd", **params)
    assert repr(next(iter(params.values()))) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("shapes, min_compression", [
    ([(8, 40), (10, 30), (8, 40), (8, 40), (40,)], 2.0),  # one shape's kept bases not equally spaced: stacked
    ([(8, 40), (30, 6), (8, 40), (12, 20), (1, 7)], 0.0),  # ranks 2 and 1 (1 x 7 pays): a padded Gram-Schmidt each
])
def test_bucket_route_matches_per_tensor_route_over_warm_started_steps(shapes, min_compression):
    """The bucket route's batched, zero-padded Gram-Schmidt and its kept bases (a strided view, or stacked
    where a shape's matrices are not equally spaced) give each matrix what the per-tensor route gives it,
    step after step from the same starting bases, up to the order of float sums."""
    numels = [math.prod(s) for s in shapes]
    states = [GradzipState("powersgd", bucketed=flag, dense_steps=0, rank=2, min_compression=min_compression)
              for flag in (True, False)]
    gen = torch.Generator().manual_seed(3)
    for i, shape in enumerate(shapes):
        if len(shape) == 2:
            q = torch.randn(shape[1], min(2, *shape), generator=gen)  # (m, r)
            for state in states:
                state.tensors.setdefault(f"t{i}", {})["Q"] = q.clone()
    for step in range(4):
        flat = torch.randn(sum(numels), generator=torch.Generator().manual_seed(step))
        named = [(f"t{i}", v.view(s)) for i, (v, s) in enumerate(zip(torch.split(flat, numels), shapes))]
        expected = states[1].exchange([(k, g.clone()) for k, g in named])
        states[0].exchange(named, out=[g for _, g in named])
        assert states[0]._route.buckets, "the bucket route ran"
        for (key, got), want in zip(named, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5, msg=f"step {step}, {key}")


def _bucket_step(state, xs):
    """One bucket-route exchange of the matrices ``xs`` (and a vector, sent densely); the aggregates and
    how many Gaussian draws (their ``log1p``) it made."""
    from gradzip.testing import OpCounter
    named = [(f"t{i}", x.clone()) for i, x in enumerate(xs)] + [("bias", torch.ones(7))]
    with OpCounter() as counter:
        out = state.exchange(named)
    assert state._route.buckets, "the bucket route ran"
    return out[:-1], counter.ops.get("aten.log1p", 0)


def test_bucket_route_recovers_a_zero_basis_from_the_buckets_kept_draw():
    """With warm start the bucket's Gaussian draw is made at its first exchange and kept: a zero
    gradient leaves zero bases, and the next step takes the kept draw in their place and recovers a
    rank-2 matrix in one step, drawing nothing more."""
    state = GradzipState("powersgd", bucketed=True, rank=2, dense_steps=0)
    zeros, draws = _bucket_step(state, [torch.zeros(20, 30), torch.zeros(20, 30)])
    assert draws == 1 and all(torch.equal(z, torch.zeros(20, 30)) for z in zeros)
    assert all(torch.equal(state.tensors[f"t{i}"]["Q"], torch.zeros(30, 2)) for i in range(2))
    xs = [low_rank(20, 30, 2, seed=9), low_rank(20, 30, 2, seed=10)]
    for step in range(2):
        out, draws = _bucket_step(state, xs)
        assert draws == 0, step
        assert all(rel_err(o, x) < 1e-5 for o, x in zip(out, xs)), step


def test_bucket_route_without_warm_start_draws_a_new_basis_every_step():
    x = torch.randn(20, 30, generator=gen(4))
    state = GradzipState("powersgd", bucketed=True, rank=2, dense_steps=0, warm_start=False)
    (first,), draws_first = _bucket_step(state, [x])
    (second,), draws_second = _bucket_step(state, [x])
    assert draws_first == draws_second == 1
    assert not torch.allclose(first, second)  # rank 2 of a full-rank matrix: the basis shows
