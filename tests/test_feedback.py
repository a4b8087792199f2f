"""Error feedback as objects composed with a compressor through GradzipState(..., feedback=...)."""
import pytest
import torch

from gradzip import make
from gradzip.feedback import MomentumCorrection, NoFeedback, Residual, make_feedback, scheme_of
from gradzip.state import GradzipState


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
