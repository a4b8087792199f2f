"""Method-specific checks of the sign family: onebit, signsgd, signum, efsignsgd."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gradzip
from gradzip import testing
from gradzip.collectives import LocalTransport, run_lockstep, simulate
from gradzip.compressors import make
from gradzip.compressors.base import TensorContext
from gradzip.compressors.sign import (decode_signs, decode_trits, encode_signs, encode_trits, majority_vote,
                                     vote_of_trits)
from gradzip.state import GradzipState
from tests import workers

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


def sign_of(x):
    """sign(x) with sign(+-0) = 0, as int8."""
    return torch.where(x > 0, 1, torch.where(x >= 0, 0, -1)).to(torch.int8)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 1e-38, -1e-45, float("inf"), float("-inf")])
                | st.floats(width=32, allow_nan=False), min_size=0, max_size=70))
def test_ternary_codes_round_trip_five_per_byte(values):
    x = torch.tensor(values, dtype=torch.float32)
    packed = encode_trits(x)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(len(values) / 5)
    assert packed.numel() == 0 or int(packed.max()) <= 242  # five base-3 digits
    assert torch.equal(decode_trits(packed, len(values)), sign_of(x))


def test_ternary_layout_is_five_planes():
    # Codes c = sign + 1; element i is digit i // m of byte i % m (m = 3 bytes for 11 elements); the
    # padding codes (elements 11-14) are 0.
    x = torch.tensor([1.0, 0.0, -1.0, -1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    assert encode_trits(x).tolist() == [2 + 3 * 0 + 9 * 1 + 27 * 2,  # elements 0, 3, 6, 9
                                        1 + 3 * 1 + 9 * 1 + 27 * 2,  # elements 1, 4, 7, 10
                                        0 + 3 * 2 + 9 * 1]           # elements 2, 5, 8


@pytest.mark.parametrize("world", [1, 2, 3, 5, 130])
def test_vote_of_trits_is_the_sign_of_the_summed_signs(world):
    g = torch.Generator().manual_seed(world)
    xs = [torch.randint(-1, 2, (1003,), generator=g).float() for _ in range(world)]
    expected = torch.stack(xs).sum(0).sign()
    assert torch.equal(vote_of_trits([encode_trits(x) for x in xs], (17, 59)), expected.reshape(17, 59))


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
    scales = [3.6 / 5, 4.8 / 5, 9.7 / 5]  # ||x_r||_1 / n
    vote = [1.0, -1.0, -1.0, 1.0, -1.0]
    outs = exchange_ranks(make("signsgd"), xs)
    for r, out in enumerate(outs):
        torch.testing.assert_close(out.aggregate, torch.tensor(vote) * sum(scales) / 3)
        torch.testing.assert_close(out.sent, sign_of(xs[r]).float() * scales[r])
    unscaled = exchange_ranks(make("signsgd", scaled=False), xs)
    for r, out in enumerate(unscaled):
        assert out.aggregate.tolist() == vote
        assert torch.equal(out.sent, sign_of(xs[r]).float())  # rank 0's zero is sent as 0


def test_signsgd_majority_vote_ties_four_ranks():
    xs = [torch.tensor([1.0, 1.0, -1.0, 1.0, 0.0]),
          torch.tensor([1.0, -1.0, -1.0, 1.0, 0.0]),
          torch.tensor([1.0, -1.0, 1.0, -1.0, -0.0]),
          torch.tensor([-1.0, 1.0, -1.0, 0.0, 2.0])]
    # The zero abstains: +1 +1 -1 (0) -> +1; the last column is one vote against three abstentions.
    for out in exchange_ranks(make("signsgd", scaled=False), xs):
        assert out.aggregate.tolist() == [1.0, 0.0, -1.0, 1.0, 1.0]
    # The paper's 1-bit code reads 0 (and -0.0) as +1: the third column ties, the last is carried by zeros.
    for out in exchange_ranks(make("signsgd", scaled=False, zeros="plus"), xs):
        assert out.aggregate.tolist() == [1.0, 0.0, -1.0, 1.0, 1.0]
    zeros = [torch.tensor([0.0, -1.0]), torch.tensor([0.0, -1.0]), torch.tensor([-0.0, 1.0])]
    assert exchange_ranks(make("signsgd", scaled=False), zeros)[0].aggregate.tolist() == [0.0, -1.0]
    assert exchange_ranks(make("signsgd", scaled=False, zeros="plus"), zeros)[0].aggregate.tolist() == [1.0, -1.0]


def test_scaled_vote_is_the_vote_times_the_mean_of_the_ranks_scales():
    xs = [torch.tensor([[1.0, -3.0], [0.0, 4.0]]), torch.tensor([[2.0, -2.0], [-6.0, 0.0]])]
    for name in ("signsgd", "signum"):
        params = {"beta": 0.0} if name == "signum" else {}  # beta = 0: the momentum is the input
        for zeros, vote in (("abstain", [[1.0, -1.0], [-1.0, 1.0]]), ("plus", [[1.0, -1.0], [0.0, 1.0]])):
            outs = exchange_ranks(make(name, zeros=zeros, **params), xs)
            for out in outs:
                assert out.aggregate.tolist() == (torch.tensor(vote) * (2.0 + 2.5) / 2).tolist()
            assert outs[1].sent.tolist() == [[2.5, -2.5], [-2.5, 2.5 if zeros == "plus" else 0.0]]


def test_signum_momentum_is_staged_and_sent_sign_follows_it():
    comp = make("signum", beta=0.5)
    x1 = torch.tensor([4.0, -4.0, 1.0])
    ctx = ctx_for(x1)
    out = exchange_ranks(comp, [x1], [ctx])[0]
    m1 = ctx.updates["signum_momentum"]
    assert m1.tolist() == [2.0, -2.0, 0.5]  # (1 - beta) * x with m_0 = 0
    assert ctx.state == {} and out.sent.tolist() == [1.5, -1.5, 1.5]  # mean |m1| * sign(m1)

    # Next step from the committed momentum: m = 0.5 * m1 + 0.5 * x2.  x2 disagrees in sign everywhere,
    # but only the last element's momentum flips.
    x2 = torch.tensor([-1.0, 1.0, -3.0])
    ctx2 = ctx_for(x2, state={"signum_momentum": m1}, step=1)
    out2 = exchange_ranks(comp, [x2], [ctx2])[0]
    assert ctx2.updates["signum_momentum"].tolist() == [0.5, -0.5, -1.25]
    assert ctx2.state["signum_momentum"] is m1  # committed state untouched until GradzipState commits
    assert out2.sent.tolist() == [0.75, -0.75, -0.75]


def test_signum_votes_on_each_ranks_momentum():
    comp = make("signum", beta=0.0, scaled=False)  # beta = 0: the momentum is the input, the vote signSGD's
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


def test_signum_applies_momentum_itself():
    assert make("signum").applies_momentum
    assert not any(make(name).applies_momentum for name in ("signsgd", "efsignsgd", "onebit"))


def _signum_step(momentum):
    """One ``DistributedOptimizer`` step of Signum around torch's SGD with ``momentum``: the parameters
    before, the model and the optimizer."""
    model = workers.small_model()
    before = [p.detach().clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    opt = gradzip.DistributedOptimizer(inner, model.named_parameters(), "signum")
    x, y = workers.batch(0, 0)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return before, model, opt


def test_signum_with_optimizer_momentum_is_a_checked_error():
    with pytest.raises(ValueError, match="use torch.optim.SGD with momentum=0"):
        _signum_step(momentum=0.9)


def test_signum_with_plain_sgd_steps():
    before, model, opt = _signum_step(momentum=0)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all("signum_momentum" in slot for slot in opt.gradzip_state.tensors.values())


# -- exact zeros: coordinates whose gradient is 0 on every rank -----------------------------------------

def _zero_coordinate_displacement(name, steps, **params):
    """Two ranks (threads) exchange random gradients whose row 3 and column 5 are 0 on both ranks; returns
    rank 0's running sum of the aggregate at those coordinates (the parameter displacement over -lr),
    max |.| after each step, and the largest |aggregate| seen anywhere."""
    def worker(rank, transport):
        torch.set_num_threads(1)
        state = GradzipState(name, transport=transport, **params)
        gen = torch.Generator().manual_seed(rank)
        total, history, largest = torch.zeros(16, 12), [], 0.0
        for _ in range(steps):
            g = torch.randn(16, 12, generator=gen) * (1 + rank)
            g[3], g[:, 5] = 0.0, 0.0
            (aggregate,) = state.exchange([("w", g)])
            total += aggregate
            history.append(max(float(total[3].abs().max()), float(total[:, 5].abs().max())))
            largest = max(largest, float(aggregate.abs().max()))
        return history, largest
    return workers.run_threads(2, worker)[0]


@pytest.mark.parametrize("params", [{}, {"scaled": False}, {"beta": 0.5}, {"beta": 0.5, "scaled": False}])
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_exact_zeros_abstain_so_zero_gradient_coordinates_never_move(name, params):
    params = {k: v for k, v in params.items() if k != "beta" or name == "signum"}
    history, largest = _zero_coordinate_displacement(name, 40, **params)
    assert largest > 0 and history == [0.0] * 40


@pytest.mark.parametrize("scaled", [False, True])
def test_paper_sign_of_zero_is_plus_one_so_zero_gradient_coordinates_drift(scaled):
    history, largest = _zero_coordinate_displacement("signsgd", 40, zeros="plus", scaled=scaled)
    if not scaled:
        assert history == [float(t) for t in range(1, 41)]  # +1 (the learning rate) every step
    assert history[-1] > 30 * largest  # scaled: +s every step, s near its largest value


@pytest.mark.parametrize("name", ["efsignsgd", "onebit"])
def test_error_feedback_keeps_zero_gradient_coordinates_bounded(name):
    # The first step sends sign(0) = +1 (onebit: the column's mean of the entries >= 0); the residual
    # then holds minus that and the next steps send it back: the coordinate oscillates by about one step
    # and does not drift (measured: max displacement 1.0 / 1.9 over 400 steps, one step up to 1.6 / 3.0).
    history, largest = _zero_coordinate_displacement(name, 400)
    assert max(history) < 2 * largest
    assert max(history[200:]) < 1.5 * max(history[:200])  # no growth
    # Without error feedback the same coordinates drift about one step per step.
    plain, plain_largest = _zero_coordinate_displacement(name, 400, feedback="none")
    assert plain[-1] > 100 * plain_largest and plain[-1] > 1.8 * plain[199]


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

    def loss_after(name, lr=0.3, steps=300, **params):
        state = GradzipState(name, **params)
        x = x0.clone()
        for _ in range(steps):
            x = x - lr * state.exchange([("x", h * x)])[0]
        return 0.5 * (h * x * x).sum().item()

    start = 0.5 * (h * x0 * x0).sum().item()
    ef, plain = loss_after("efsignsgd"), loss_after("signsgd", scaled=False)
    assert ef < 1e-8 * start
    # signSGD moves every coordinate by lr each step, so it ends oscillating around the optimum.
    assert plain > 0.01 * start and plain > 1e6 * ef


# -- wire sizes and validation ---------------------------------------------------------------------------

VARIANTS = {  # label: (method, parameters)
    "onebit": ("onebit", {}),
    "efsignsgd": ("efsignsgd", {}),
    "signsgd": ("signsgd", {}),
    "signsgd unscaled": ("signsgd", {"scaled": False}),
    "signsgd plus": ("signsgd", {"zeros": "plus"}),
    "signsgd paper": ("signsgd", {"scaled": False, "zeros": "plus"}),
    "signum": ("signum", {}),
    "signum paper": ("signum", {"scaled": False, "zeros": "plus"}),
}


@pytest.mark.parametrize("shape, expected", [
    # ternary: ceil(n / 5); bits: ceil(n / 8); + 4 for a scale
    ((3, 5), {"onebit": 8 * 5 + 2, "efsignsgd": 4 + 2, "signsgd": 4 + 3, "signsgd unscaled": 3,
              "signsgd plus": 4 + 2, "signsgd paper": 2, "signum": 4 + 3, "signum paper": 2}),
    ((13,), {"onebit": 8 + 2, "efsignsgd": 4 + 2, "signsgd": 4 + 3, "signsgd unscaled": 3,
             "signsgd plus": 4 + 2, "signsgd paper": 2, "signum": 4 + 3, "signum paper": 2}),
    ((2, 3, 3), {"onebit": 8 * 9 + 3, "efsignsgd": 4 + 3, "signsgd": 4 + 4, "signsgd unscaled": 4,
                 "signsgd plus": 4 + 3, "signsgd paper": 3, "signum": 4 + 4, "signum paper": 3}),
    ((), {"onebit": 8 + 1, "efsignsgd": 4 + 1, "signsgd": 4 + 1, "signsgd unscaled": 1,
          "signsgd plus": 4 + 1, "signsgd paper": 1, "signum": 4 + 1, "signum paper": 1}),
    ((0,), {"onebit": 8, "efsignsgd": 4, "signsgd": 4, "signsgd unscaled": 0,
            "signsgd plus": 4, "signsgd paper": 0, "signum": 4, "signum paper": 0}),
])
def test_wire_bytes_for_sizes_not_divisible_by_5_or_8(shape, expected):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    for label, (name, params) in VARIANTS.items():
        comp = make(name, **params)
        ctx = ctx_for(x)
        assert comp.payload_bytes(ctx) == expected[label], label
        _, report = run_lockstep([comp.exchange(x, ctx)], LocalTransport())
        assert report.payload_bytes == expected[label], label


@pytest.mark.parametrize("name", SIGN_METHODS)
def test_feedback_defaults_and_determinism(name):
    comp = make(name)
    assert comp.deterministic
    assert comp.feedback == {"onebit": "residual", "efsignsgd": "residual"}.get(name, "none")


@pytest.mark.parametrize("beta", [1.0, -0.1, 1.5, float("nan"), "0.9", None, True])
def test_signum_rejects_bad_beta(beta):
    with pytest.raises(ValueError, match="beta"):
        make("signum", beta=beta)


@pytest.mark.parametrize("name", ["signsgd", "signum"])
@pytest.mark.parametrize("param, value, allowed", [("scaled", 1, "True or False"), ("scaled", "yes", "True or False"),
                                                   ("zeros", "minus", "'abstain', 'plus'"),
                                                   ("zeros", None, "'abstain', 'plus'")])
def test_bad_scaled_and_zeros_are_one_line_errors(name, param, value, allowed):
    with pytest.raises(ValueError) as err:
        make(name, **{param: value})
    message = str(err.value)
    assert message.startswith(param) and allowed in message and repr(value) in message and "\n" not in message


@pytest.mark.parametrize("name", SIGN_METHODS)
def test_bad_feedback_and_unknown_params_are_rejected(name):
    with pytest.raises(ValueError, match="feedback"):
        make(name, feedback="bogus")
    with pytest.raises(ValueError, match="unknown parameter"):
        make(name, ratio=0.5)


@pytest.mark.parametrize("params", [{"scaled": False}, {"scaled": False, "zeros": "plus"}, {"zeros": "plus"}], ids=str)
@pytest.mark.parametrize("name", ["signsgd", "signum"])
def test_every_vote_variant_turns_a_nonfinite_input_into_nan(name, params):
    # Scaled votes leave the input's check to their scale (carries_nonfinite); unscaled ones cannot.
    assert make(name, **params).carries_nonfinite == params.get("scaled", True)
    testing.check_nonfinite(lambda: make(name, **params))
