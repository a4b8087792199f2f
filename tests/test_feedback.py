"""Error feedback as objects composed with a compressor through GradzipState(..., feedback=...)."""
import contextlib

import pytest
import torch

import gradzip
from gradzip import feedback, kernels, make
from gradzip.collectives import LocalTransport
from gradzip.compressors import base
from gradzip.feedback import MomentumCorrection, NoFeedback, Residual, make_feedback, scheme_of
from gradzip.state import GradzipState
from tests import workers


def test_make_feedback():
    assert isinstance(make_feedback(None), NoFeedback)
    assert make_feedback("residual") == Residual()
    m = MomentumCorrection(0.5)
    assert make_feedback(m) is m
    assert make_feedback("momentum", momentum=0.5, nesterov=True).params() == {
        "momentum": 0.5, "nesterov": True, "clip_norm": None}
    with pytest.raises(ValueError, match=r"^unknown feedback 'ef'; valid: none, residual, momentum$"):
        make_feedback("ef")


def test_state_feedback_overrides_compressor_scheme():
    plain = GradzipState("topk", ratio=0.01, feedback="none")
    res = GradzipState("topk", ratio=0.01)
    assert plain.compressor.feedback == "none" and isinstance(scheme_of(plain.compressor), NoFeedback)
    assert res.compressor.feedback == "residual" and isinstance(scheme_of(res.compressor), Residual)
    built = GradzipState(make("topk", ratio=0.01), feedback=NoFeedback())
    assert built.compressor.feedback == "none" and isinstance(scheme_of(built.compressor), NoFeedback)
    assert Residual.state_keys == ("residual",) and MomentumCorrection.state_keys == ("momentum", "velocity")
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    for state, kept in ((plain, set()), (res, {"residual"}), (built, set())):
        out, = state.exchange([("w", g.clone())])
        assert set(state.tensors["w"]) & {"residual", "momentum", "velocity"} == kept
        assert torch.count_nonzero(out) == 21  # ceil(1% of 2048): the same Top-k under either scheme


def test_dgc_momentum_params_reach_the_object():
    state = GradzipState("dgc", momentum=0.8, nesterov=True, clip_norm=2.0)
    scheme = scheme_of(state.compressor)
    assert isinstance(scheme, MomentumCorrection)
    assert scheme.params() == {"momentum": 0.8, "nesterov": True, "clip_norm": 2.0}
    # A MomentumCorrection given to the state sets the method's own parameters too (params, state dicts).
    given = MomentumCorrection(0.5, nesterov=False)
    state = GradzipState("csc", ratio=0.1, feedback=given)
    assert scheme_of(state.compressor) is given
    assert state.compressor.feedback == "momentum" and state.compressor.momentum == 0.5
    assert state.compressor.applies_momentum


@pytest.mark.parametrize("compressor, feedback, message", [
    ("topk", "momentum", r"^topk: feedback must be one of \['none', 'residual'\], got 'momentum'$"),
    ("sparseloco", Residual(), r"^sparseloco: feedback must be one of \['none'\], got Residual\(\)$"),
])
def test_invalid_combination_is_one_line(compressor, feedback, message):
    with pytest.raises(ValueError, match=message) as info:
        GradzipState(compressor, feedback=feedback)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message):
        GradzipState(make(compressor), feedback=feedback)


def test_each_scheme_owns_a_typed_state():
    from gradzip.compressors.base import TensorContext
    from gradzip.feedback import MomentumState, NoState, ResidualState

    assert NoFeedback.state_keys == () and isinstance(NoFeedback().load(TensorContext("w", (3,), torch.float32)),
                                                      NoState)
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    res = GradzipState("topk", ratio=0.01)
    out, = res.exchange([("w", g.clone())])
    kept = Residual().load(res.context("w", g))
    assert isinstance(kept, ResidualState)
    assert torch.equal(kept.residual + out, g)  # world size 1: what was not sent is what is kept
    dgc = GradzipState("dgc", ratio=0.01, warmup_epochs=0)
    dgc.exchange([("w", g.clone())])
    kept = scheme_of(dgc.compressor).load(dgc.context("w", g))
    assert isinstance(kept, MomentumState) and kept.momentum.shape == kept.velocity.shape == g.shape
    # Staged, not committed: a stage() shows through the context at once, and nowhere else until commit.
    ctx = res.context("w", g)
    Residual().stage(ctx, ResidualState(None))
    assert Residual().load(ctx).residual is None and res.tensors["w"]["residual"] is not None


@pytest.mark.parametrize("name", sorted(__import__("gradzip").compressors()))
def test_no_method_writes_into_a_feedback_schemes_state(name):
    """Without feedback, no per-tensor state entry may carry a name that an error-feedback scheme owns:
    a method's own state (Signum's momentum, SparseLoCo's error) must never be read as feedback's."""
    from gradzip.feedback import FEEDBACKS, make_feedback

    compressor = make(name)
    if "none" not in compressor.feedbacks:
        pytest.skip(f"{name} has no feedback-free variant")
    owned = {k for f in FEEDBACKS for k in make_feedback(f).state_keys}
    state = GradzipState(make(name), feedback="none")
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        state.exchange([("w", g.clone())])
    assert not set(state.tensors.get("w", {})) & owned


@contextlib.contextmanager
def aggregate_buffers():
    """Within: every aggregate buffer ``TensorContext.buffer`` hands out, as (the output lent to that
    context at the time, the buffer), in order."""
    handed, original = [], base.TensorContext.buffer

    def watched(self, name, shape, dtype, device):
        got = original(self, name, shape, dtype, device)
        if name == "aggregate":
            handed.append((self.out, got))
        return got

    base.TensorContext.buffer = watched
    try:
        yield handed
    finally:
        base.TensorContext.buffer = original


def test_the_callers_output_holds_the_aggregate_only_where_that_is_safe():
    """exchange(out=...) builds a tensor's aggregate straight in its output (no copy out) when the
    output is the tensor's own gradient, as DDP's bucket views are, once the compensated input lives
    elsewhere; not while the compressor's input is that memory, nor in an output that overlaps another
    gradient.  Every case equals a plain exchange bit for bit."""
    built_in_out = []
    gen = torch.Generator().manual_seed(0)
    plain = GradzipState("topk", transport=LocalTransport(), seed=1)
    lent = GradzipState("topk", transport=LocalTransport(), seed=1)
    for step in range(3):
        g = torch.randn(2, 300, 40, generator=gen)
        expected = plain.exchange([("a", g[0]), ("b", g[1])])
        bucket = g.clone()
        inputs = [("a", bucket[0]), ("b", bucket[1])]
        # At step 2, a's output is b's gradient: it may only be written once the exchange is over.
        out = [bucket[1], torch.empty(300, 40)] if step == 2 else [bucket[0], bucket[1]]
        with aggregate_buffers() as handed:
            got = lent.exchange(inputs, out=out)
        built_in_out += [lent_out is not None and b.data_ptr() == lent_out.data_ptr() for lent_out, b in handed]
        assert all(torch.equal(a, b) for a, b in zip(expected, got))
    # step 0: the gradient is the compressor's input (no residual yet); then in place; at step 2 not
    # in b's gradient, but in the separate output
    assert built_in_out == [False, False, True, True, False, True]


DONE_WITH_INPUT_EARLY = ["natural", "qsgd", "signsgd", "signum", "terngrad"]


def test_the_methods_done_with_their_input_early_are_these():
    assert sorted(n for n in gradzip.compressors() if type(gradzip.make(n)).done_with_input_early) == DONE_WITH_INPUT_EARLY


@pytest.mark.parametrize("name, feedback_, in_place", [(n, "none", True) for n in DONE_WITH_INPUT_EARLY]
                         + [("signsgd", "residual", False), ("qsgd", "residual", False), ("topk", "none", False)])
def test_without_feedback_a_method_done_with_its_input_builds_the_aggregate_in_it(name, feedback_, in_place):
    """DDP's bucket is both the input and the output: a method that reads its input only before it takes
    its aggregate buffer builds the aggregate there, from the first step, when no feedback reads the
    input afterwards (no copy out); residual feedback (whose first step reads it) and a method without
    the promise get a buffer of their own.  Bit for bit the plain exchange either way."""
    built_in_input = []
    gen = torch.Generator().manual_seed(3)
    params = {"feedback": feedback_, **({"ratio": 0.1} if name == "topk" else {})}
    plain = GradzipState(gradzip.make(name, **params), transport=LocalTransport(), seed=1)
    lent = GradzipState(gradzip.make(name, **params), transport=LocalTransport(), seed=1)
    for step in range(2):
        g = torch.randn(300, 40, generator=gen)
        expected = plain.exchange([("w", g)])
        bucket = g.clone()
        with aggregate_buffers() as handed:
            got = lent.exchange([("w", bucket)], out=[bucket])
        built_in_input += [b.data_ptr() == bucket.data_ptr() for _, b in handed]
        assert got[0] is bucket and torch.equal(expected[0], got[0])
    assert built_in_input[0] is in_place


def test_the_input_check_fused_with_g_plus_e_flags_exactly_the_non_finite_sums(monkeypatch):
    """Error feedback checks g + e in cached chunks instead of the owner reading g again.  A chunk whose
    finite elements sum past fp32's range is checked element by element, not flagged; g + e overflowing
    is flagged (it would be by the output check otherwise).  Same aggregates and states as the owner's
    own check, bit for bit."""
    n = (600, 500)  # two chunks of the fused check, the second partial
    steps = [torch.randn(n, generator=torch.Generator().manual_seed(0)),
             torch.full(n, 1e38),  # finite, but every chunk's sum overflows
             torch.full(n, 3e38),  # finite, but g + e overflows where the residual holds ~1e38
             torch.randn(n, generator=torch.Generator().manual_seed(1))]
    calls = []
    checked_add = feedback._checked_add
    monkeypatch.setattr(feedback, "_checked_add", lambda *a: calls.append(1) or checked_add(*a))

    def run():
        state = GradzipState("topk", transport=LocalTransport())
        outs = [state.exchange([("w", g.clone())])[0] for g in steps]
        return outs, state.tensors["w"]["residual"], state.stats()["nonfinite_exchanges"]

    fused = run()
    assert len(calls) == 3  # every step with a residual
    monkeypatch.setattr(kernels, "CHECK_CHUNK", 1 << 30)  # no tensor is large enough: the owner checks
    unfused = run()
    assert len(calls) == 3
    assert fused[2] == unfused[2] == 1
    assert torch.isfinite(fused[0][1]).all() and torch.isnan(fused[0][2]).all()
    for a, b in zip(fused[0], unfused[0]):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
    assert torch.equal(fused[1], unfused[1]) and torch.isfinite(fused[1]).all()


def test_an_aggregate_checked_as_it_is_copied_may_sum_past_the_float_range():
    """A large dense aggregate copied into ``out`` is checked chunk by chunk as it is copied: finite
    values whose chunk sums overflow fp32 are checked element by element, not flagged."""
    state = GradzipState("none", transport=LocalTransport())
    g = torch.full((600, 500), 1e38)
    g[3, 4] = -3e38
    out = torch.empty_like(g)
    assert state.exchange([("w", g)], out=[out])[0] is out
    assert torch.equal(out, g) and state.stats()["nonfinite_exchanges"] == 0
    g[599, 499] = float("inf")  # in the last, partial chunk
    state.exchange([("w", g)], out=[out])
    assert out.isnan().all() and state.stats()["nonfinite_exchanges"] == 1


def _steps_with_ranks(method, params, world, shape=(600, 500), steps=3):
    """Every rank's aggregates and residuals over a few steps of ``method`` with residual feedback,
    exchanged into the gradients themselves, ranks as threads."""
    def worker(rank, transport):
        state = GradzipState(method, transport=transport, **params)
        seen = []
        for step in range(steps):
            g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + step))
            out = state.exchange([("w", g)], out=[g])[0]
            seen.append((out.clone(), state.tensors["w"]["residual"].clone()))
        return seen

    return workers.run_threads(world, worker)


@pytest.mark.parametrize("method, params, observes", [
    ("csc", {"ratio": 0.05, "chunk_size": 256}, True),
    ("csc", {"ratio": 0.05, "chunk_size": 100}, False),  # 100 divides no cached chunk: norms read again
    ("efsignsgd", {}, True),
], ids=["csc-256", "csc-100", "efsignsgd"])
@pytest.mark.parametrize("world", [1, 3])
def test_reading_while_residual_feedback_writes_gives_the_same_bits(method, params, observes, world, monkeypatch):
    # CSC's chunk norms and EF-signSGD's ||p||_1 chunk sums, taken from each cached chunk of p = g + e as
    # residual feedback writes and checks it (Compressor.read_while_written), are those read afterwards.
    cls = type(make(method))
    observed = []
    original = cls.read_while_written
    monkeypatch.setattr(cls, "read_while_written", lambda self, ctx: observed.append(original(self, ctx)) or observed[-1])
    taken = _steps_with_ranks(method, params, world)
    # Feedback checks g + e as it writes it from the second step on (a 300,000-element tensor).
    assert len(observed) == world * 2 and all((f is not None) == observes for f in observed)
    monkeypatch.setattr(cls, "read_while_written", lambda self, ctx: None)
    again = _steps_with_ranks(method, params, world)
    for rank_taken, rank_again in zip(taken, again):
        for (out_a, e_a), (out_b, e_b) in zip(rank_taken, rank_again):
            assert torch.equal(out_a.view(torch.int32), out_b.view(torch.int32))
            assert torch.equal(e_a.view(torch.int32), e_b.view(torch.int32))


def _named(seed, zero=()):
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (16, 8), "b": (8,), "c": (8, 8), "d": (4,)}
    return [(k, torch.zeros(s) if k in zero else torch.randn(s, generator=g)) for k, s in shapes.items()]


def _piece(state, name, field):
    """``name``'s part of its feedback state ``field`` (its own, or its slice of a group of vectors)."""
    named = _named(0)
    for key, members in state.exchanged_keys(named):
        start = 0
        for i in members:
            if named[i][0] == name:
                value = state.tensors[key].get(field)
                return None if value is None else value.reshape(-1)[start:start + named[i][1].numel()].clone()
            start += named[i][1].numel()


@pytest.mark.parametrize("name, params", [("topk", {"ratio": 0.2}), ("dgc", {"ratio": 0.2, "min_numel": 0, "warmup_epochs": 0}),
                                          ("sparseloco", {"density": 0.2, "chunk": 16})])
@pytest.mark.parametrize("route", [{"bucketed": True}, {"bucketed": False}, {"bucketed": False, "group_vectors_below": 64}])
def test_withheld_gradients_keep_their_feedback_state(name, params, route):
    """exchange(withheld=...) (DDP's hook: a parameter this rank did not use) compresses those gradients
    as if owed nothing and leaves their state as it was; the others are exchanged with theirs."""
    fields = scheme_of(make(name, **params)).state_keys + make(name, **params).owed_state
    states = {w: GradzipState(name, **params, **route) for w in ("withheld", "not")}
    for state in states.values():
        state.exchange(_named(0))
    owed = {f: _piece(states["withheld"], "b", f) for f in fields}
    owed = {f: v for f, v in owed.items() if v is not None and v.abs().sum() > 0}  # DGC sends vectors whole
    assert owed
    got = {w: s.exchange(_named(1, zero=("b",)), withheld={"b"} if w == "withheld" else ()) for w, s in states.items()}
    for f in owed:
        assert torch.equal(_piece(states["withheld"], "b", f), owed[f])
        assert not torch.equal(_piece(states["not"], "b", f), owed[f])  # what withholding saved
    assert torch.count_nonzero(got["withheld"][1]) == 0  # b sent nothing
    if name == "topk":  # the others conserve g + e: what was sent plus what is owed now
        before = GradzipState(name, **params, **route)
        before.exchange(_named(0))
        for i, (key, g) in enumerate(_named(1, zero=("b",))):
            if key != "b":
                torch.testing.assert_close(got["withheld"][i].reshape(-1) + _piece(states["withheld"], key, "residual"),
                                           g.reshape(-1) + _piece(before, key, "residual"), rtol=0, atol=0)


def test_a_withheld_gradient_sent_densely_keeps_what_it_is_owed():
    """An exchange that sends a tensor densely drops its residual (nothing is owed after it); a withheld
    tensor's residual comes back all the same (here the method is made to send densely, as auto does
    once it settles on a dense choice)."""
    state = GradzipState("topk", ratio=0.2, bucketed=False, group_vectors_below=64)
    state.exchange(_named(0))
    owed = {k: _piece(state, k, "residual") for k in "ab"}
    state.compressor.compresses = lambda ctx: False
    state.exchange(_named(1, zero=("a", "b")), withheld={"a", "b"})
    for k in "ab":
        assert torch.equal(_piece(state, k, "residual"), owed[k])
    assert torch.count_nonzero(_piece(state, "d", "residual")) == 0  # d, b's group's other member, was sent
