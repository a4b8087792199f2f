"""Method-specific checks of the sign family: onebit, signsgd, signum, efsignsgd."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.collectives import LocalTransport, run_lockstep, simulate
from gradzip.compressors import make
from gradzip.compressors.base import TensorContext
from gradzip.compressors.sign import decode_signs, encode_signs, majority_vote
from gradzip.state import GradzipState

SIGN_METHODS = ["onebit", "signsgd", "signum", "efsignsgd"]


def ctx_for(x, rank=0, world_size=1, **kw):
    return TensorContext(key="w", shape=x.shape, dtype=x.dtype, rank=rank, world_size=world_size, **kw)


def exchange_ranks(comp, xs, ctxs=None):
    """Run one exchange per rank in-process; returns the per-rank Exchanged results."""
    ctxs = ctxs or [ctx_for(x, r, len(xs)) for r, x in enumerate(xs)]
    return [out[0] for out in simulate([[comp.exchange(x, c)] for x, c in zip(xs, ctxs)])]


# -- bit codec ------------------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(allow_nan=False, width=32), min_size=0, max_size=70))
def test_encode_decode_is_exact_sign_with_zero_as_plus(values):
    x = torch.tensor(values, dtype=torch.float32)
    packed = encode_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(values) / 8)
    expected = torch.where(x >= 0, 1.0, -1.0)
    assert torch.equal(decode_signs(packed, x.shape), expected)


def test_zero_and_negative_zero_encode_as_plus_one():
    x = torch.tensor([0.0, -0.0, -1e-30, 1e-30, float("inf"), float("-inf")])
    assert decode_signs(encode_signs(x), x.shape).tolist() == [1.0, 1.0, -1.0, 1.0, 1.0, -1.0]


def test_majority_vote_ties_give_zero():
    signs = [torch.tensor([1.0, 1.0, -1.0, -1.0]), torch.tensor([1.0, -1.0, 1.0, -1.0])]
    assert majority_vote(signs).tolist() == [1.0, 0.0, 0.0, -1.0]


# -- onebit ---------------------------------------------------------------------------------------------

def test_onebit_column_means_hand_computed():
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0], [-1.0, 0.0]])
    comp = make("onebit")
    means, packed = comp.compress(x, ctx_for(x))
    # column 0: positives {1, 3} -> 2, negatives {-1} -> -1; column 1: positives {4, 0} -> 2, negatives {-2}
    assert means.dtype == torch.float32 and means.tolist() == [2.0, 2.0, -1.0, -2.0]
    out = exchange_ranks(comp, [x])[0]
    assert out.sent.tolist() == [[2.0, -2.0], [2.0, 2.0], [-1.0, 2.0]]
    # Quantising with the group means keeps every column sum.
    assert torch.allclose(out.sent.sum(0), x.sum(0))


def test_onebit_empty_group_mean_is_zero_and_views():
    comp = make("onebit")
    x = torch.tensor([[1.0, -1.0], [2.0, -3.0]])  # column 0 all >= 0, column 1 all < 0
    means, _ = comp.compress(x, ctx_for(x))
    assert means.tolist() == [1.5, 0.0, 0.0, -2.0]
    # 1-D: one column, 0-d: 1 x 1, higher dims flatten the trailing ones.
    assert comp.matrix_shape(torch.Size([7])) == (7, 1)
    assert comp.matrix_shape(torch.Size([])) == (1, 1)
    assert comp.matrix_shape(torch.Size([3, 4, 5])) == (3, 20)
    assert comp.matrix_shape(torch.Size([0, 5])) == (0, 5)
    v = torch.tensor([1.0, 3.0, -4.0])
    assert exchange_ranks(comp, [v])[0].sent.tolist() == [2.0, 2.0, -4.0]


def test_onebit_error_feedback_shrinks_the_error_over_steps():
    g = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))

    def rel_error_of_running_mean(feedback, steps):
        state = GradzipState("onebit", feedback=feedback)
        total = torch.zeros_like(g)
        errors = {}
        for t in range(1, max(steps) + 1):
            total += state.exchange([("w", g)])[0]
            if t in steps:
                errors[t] = ((total / t - g).norm() / g.norm()).item()
        return errors

    ef = rel_error_of_running_mean("residual", (1, 10, 400))
    plain = rel_error_of_running_mean("none", (1, 10, 400))
    assert ef[1] > 0.2  # one step really is lossy
    # With EF the mean of what was sent approaches g like ||e_T|| / T; without it the bias stays.
    assert ef[10] < ef[1] / 2 and ef[400] < ef[10] / 10 and ef[400] < 0.01
    assert plain[400] == pytest.approx(plain[1], rel=1e-5)


# -- signsgd / signum: majority vote over simulated ranks ------------------------------------------------

def test_signsgd_majority_vote_three_ranks():
    xs = [torch.tensor([1.0, -2.0, 0.5, -0.1, 0.0]),
          torch.tensor([2.0, -1.0, -0.5, 0.3, -1.0]),
          torch.tensor([-3.0, 5.0, -0.5, 0.2, -1.0])]
    outs = exchange_ranks(make("signsgd"), xs)
    for r, out in enumerate(outs):
        assert out.aggregate.tolist() == [1.0, -1.0, -1.0, 1.0, -1.0]
        assert torch.equal(out.sent, torch.where(xs[r] >= 0, 1.0, -1.0))


def test_signsgd_majority_vote_ties_four_ranks():
    xs = [torch.tensor([1.0, 1.0, -1.0, 1.0]),
          torch.tensor([1.0, -1.0, -1.0, 1.0]),
          torch.tensor([1.0, -1.0, 1.0, -1.0]),
          torch.tensor([-1.0, 1.0, -1.0, 0.0])]  # 0 votes +1
    outs = exchange_ranks(make("signsgd"), xs)
    for out in outs:
        assert out.aggregate.tolist() == [1.0, 0.0, -1.0, 1.0]


def test_signum_momentum_is_staged_and_sent_sign_follows_it():
    comp = make("signum", beta=0.5)
    x1 = torch.tensor([4.0, -4.0, 1.0])
    ctx = ctx_for(x1)
    out = exchange_ranks(comp, [x1], [ctx])[0]
    m1 = ctx.updates["signum_momentum"]
    assert m1.tolist() == [2.0, -2.0, 0.5]  # (1 - beta) * x with m_0 = 0
    assert ctx.state == {} and out.sent.tolist() == [1.0, -1.0, 1.0]

    # Next step from the committed momentum: m = 0.5 * m1 + 0.5 * x2.  x2 disagrees in sign everywhere,
    # but only the last element's momentum flips.
    x2 = torch.tensor([-1.0, 1.0, -3.0])
    ctx2 = ctx_for(x2, state={"signum_momentum": m1}, step=1)
    out2 = exchange_ranks(comp, [x2], [ctx2])[0]
    assert ctx2.updates["signum_momentum"].tolist() == [0.5, -0.5, -1.25]
    assert ctx2.state["signum_momentum"] is m1  # committed state untouched until GradzipState commits
    assert out2.sent.tolist() == [1.0, -1.0, -1.0]


def test_signum_votes_on_each_ranks_momentum():
    comp = make("signum", beta=0.0)  # beta = 0: momentum is the input itself, so the vote is signSGD's
    xs = [torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0]), torch.tensor([-1.0, 1.0])]
    outs = exchange_ranks(comp, xs)
    assert all(o.aggregate.tolist() == [1.0, 1.0] for o in outs)


def test_signum_state_survives_gradzip_state_steps():
    state = GradzipState("signum", beta=0.9)
    g = torch.tensor([1.0, -1.0])
    state.exchange([("w", g)])
    state.exchange([("w", -0.5 * g)])
    m = state.tensors["w"]["signum_momentum"]
    assert torch.allclose(m, 0.9 * 0.1 * g + 0.1 * (-0.5 * g))


# -- efsignsgd ------------------------------------------------------------------------------------------

def test_efsignsgd_scale_is_mean_abs():
    p = torch.tensor([[3.0, -1.0, 0.0], [-2.0, 0.5, -0.5]])
    comp = make("efsignsgd")
    scale, packed = comp.compress(p, ctx_for(p))
    assert scale.dtype == torch.float32 and scale.shape == (1,)
    assert scale.item() == pytest.approx(p.abs().mean().item())  # ||p||_1 / n = 7 / 6
    out = exchange_ranks(comp, [p])[0]
    assert torch.allclose(out.sent, (7 / 6) * torch.where(p >= 0, 1.0, -1.0))


def test_efsignsgd_aggregate_is_mean_of_deltas():
    xs = [torch.tensor([1.0, -3.0]), torch.tensor([-4.0, -2.0])]  # scales 2 and 3
    outs = exchange_ranks(make("efsignsgd"), xs)
    for r, out in enumerate(outs):
        assert out.aggregate.tolist() == [(2.0 - 3.0) / 2, (-2.0 - 3.0) / 2]
    assert outs[1].sent.tolist() == [-3.0, -3.0]


def test_efsignsgd_converges_where_signsgd_stalls():
    # f(x) = 0.5 * sum h_i x_i^2, deterministic gradients, same learning rate for both methods.
    h = torch.linspace(0.1, 2.0, 20)
    x0 = torch.randn(20, generator=torch.Generator().manual_seed(1))

    def loss_after(name, lr=0.3, steps=300):
        state = GradzipState(name)
        x = x0.clone()
        for _ in range(steps):
            x = x - lr * state.exchange([("x", h * x)])[0]
        return 0.5 * (h * x * x).sum().item()

    start = 0.5 * (h * x0 * x0).sum().item()
    ef, plain = loss_after("efsignsgd"), loss_after("signsgd")
    assert ef < 1e-8 * start
    # signSGD moves every coordinate by lr each step, so it ends oscillating around the optimum.
    assert plain > 0.01 * start and plain > 1e6 * ef


# -- wire sizes and validation ---------------------------------------------------------------------------

@pytest.mark.parametrize("shape, expected", [
    ((3, 5), {"onebit": 8 * 5 + 2, "signsgd": 2, "signum": 2, "efsignsgd": 4 + 2}),
    ((13,), {"onebit": 8 + 2, "signsgd": 2, "signum": 2, "efsignsgd": 4 + 2}),
    ((2, 3, 3), {"onebit": 8 * 9 + 3, "signsgd": 3, "signum": 3, "efsignsgd": 4 + 3}),
    ((), {"onebit": 8 + 1, "signsgd": 1, "signum": 1, "efsignsgd": 4 + 1}),
])
def test_wire_bytes_for_sizes_not_divisible_by_8(shape, expected):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for name in SIGN_METHODS:
        comp = make(name)
        ctx = ctx_for(x)
        assert comp.payload_bytes(ctx) == expected[name], name
        _, report = run_lockstep([comp.exchange(x, ctx)], LocalTransport())
        assert report.payload_bytes == expected[name], name


@pytest.mark.parametrize("name", SIGN_METHODS)
def test_feedback_defaults_and_determinism(name):
    comp = make(name)
    assert comp.deterministic
    assert comp.feedback == {"onebit": "residual", "efsignsgd": "residual"}.get(name, "none")


@pytest.mark.parametrize("beta", [1.0, -0.1, 1.5, float("nan"), "0.9", None, True])
def test_signum_rejects_bad_beta(beta):
    with pytest.raises(ValueError, match="beta"):
        make("signum", beta=beta)


@pytest.mark.parametrize("name", SIGN_METHODS)
def test_bad_feedback_and_unknown_params_are_rejected(name):
    with pytest.raises(ValueError, match="feedback"):
        make(name, feedback="bogus")
    with pytest.raises(ValueError, match="unknown parameter"):
        make(name, ratio=0.5)
