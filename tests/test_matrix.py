"""The shared test matrix: every registered compressor, picked up from the registry automatically.

Round trip (shapes, dtypes), exact wire bytes against the method's own formula, error-feedback
conservation, cross-rank agreement, odd inputs and non-finite inputs.  Real multi-process checks of
the same properties are in test_distributed.py.
"""
from __future__ import annotations

import pytest
import torch

import gradzip
from gradzip import feedback
from gradzip.collectives import LocalTransport, run_lockstep, simulate
from gradzip.compressors import compressor_class
from gradzip.compressors.base import TensorContext
from gradzip.compressors.dense import NoCompression
from tests.workers import odd_inputs, params_for

NAMES = gradzip.compressors()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(64, 40), (1000,), (6, 5, 3, 3)]


def build(name, **extra):
    return gradzip.make(name, **{**params_for(name), **extra})


def grads(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.1).to(dtype)


def test_registry_lists_every_required_method():
    required = {"none", "fp16", "bf16", "topk", "randomk", "threshold", "dropping", "dgc", "csc", "qsgd",
                "terngrad", "natural", "onebit", "signsgd", "signum", "efsignsgd", "powersgd"}
    assert required <= set(NAMES)


def test_unknown_names_and_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="unknown compressor 'tpk'.*topk"):
        gradzip.make("tpk")
    with pytest.raises(ValueError, match="unknown parameter.*ratoi.*valid: ratio"):
        gradzip.make("topk", ratoi=0.1)
    with pytest.raises(ValueError, match="feedback must be one of"):
        gradzip.make("topk", feedback="sometimes")


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_has_a_default_and_repr_round_trips(name):
    c = gradzip.make(name)
    assert c.name == name
    again = gradzip.make(name, **{k: v for k, v in c.params().items() if k in gradzip.parameters_of(name)})
    assert repr(again) == repr(c)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_shape_and_dtype(name, dtype):
    state = gradzip.GradzipState(build(name))
    for step in range(4):
        named = [(f"t{i}", grads(shape, dtype, step * 10 + i)) for i, shape in enumerate(SHAPES)]
        out = state.exchange(named)
        for (_, g), o in zip(named, out):
            assert o.shape == g.shape and o.dtype == g.dtype
            assert torch.isfinite(o).all()


def _exchange_one(compressor, x, ctx):
    run = compressor.exchange if compressor.compresses(ctx) else NoCompression().exchange
    (result,), report = run_lockstep([run(x.float(), ctx)], LocalTransport())
    return result, report


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES + [(13,), (9, 7)], ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_match_the_methods_formula(name, shape, dtype):
    compressor = build(name)
    x = grads(shape, dtype, 3)
    for step in (0, 50):  # some methods start dense (PowerSGD's dense_steps)
        ctx = TensorContext("w", x.shape, dtype, step=step)
        compressed = compressor.compresses(ctx)  # asked before the exchange, as feedback.py does
        result, report = _exchange_one(compressor, x, ctx)
        if compressed:
            kept = int(result.mask.sum()) if result.mask is not None else None
            expected = compressor.payload_bytes(ctx, kept)
        else:
            expected = x.numel() * x.element_size()
        assert report.per_tensor_payload == [expected]
        assert report.payload_bytes == expected
        # One byte or element more on the wire: the non-finite flag rides along the first collective.
        assert expected <= report.wire_bytes <= expected + 8 * (1 + 2 * report.collectives)


def _close(a, b, scale):
    # Conservation holds up to one rounding of the subtraction p - sent.
    return torch.allclose(a, b, rtol=0, atol=4 * torch.finfo(torch.float32).eps * float(scale) + 1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_conserves_everything(name):
    cls = compressor_class(name)
    for scheme in cls.feedbacks:
        state = gradzip.GradzipState(build(name, feedback=scheme))
        for step in range(6):
            named = [(f"t{i}", grads(shape, torch.float32, 100 * step + i)) for i, shape in enumerate(SHAPES)]
            before = {k: dict(v) for k, v in state.tensors.items()}
            out = state.exchange(named)
            for (key, g), sent in zip(named, out):  # world size 1: the aggregate is what was sent
                old, new = before.get(key, {}), state.tensors.get(key, {})
                if scheme == "residual":
                    p = g + old.get("residual", 0)
                    kept = new.get("residual", torch.zeros_like(g))
                    assert _close(sent + kept, p, p.abs().max()), f"{scheme} step {step} {key}"
                elif scheme == "momentum":
                    c = state.compressor
                    u_old = old.get("momentum", torch.zeros_like(g))
                    if c.nesterov:
                        increment = (u_old + g) * c.momentum + g
                    else:
                        increment = c.momentum * u_old + g
                    v_in = old.get("velocity", 0) + increment
                    kept = new.get("velocity", torch.zeros_like(g))
                    if c.clip_norm is None:
                        assert _close(sent + kept, v_in, v_in.abs().max()), f"{scheme} step {step} {key}"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_ranks_agree_bit_for_bit(name, world):
    compressor = build(name)
    for step in (0, 50):
        gens = []
        for rank in range(world):
            x = grads((24, 40), torch.float32, rank)
            ctx = TensorContext("w", x.shape, x.dtype, step=step, rank=rank, world_size=world)
            gens.append([feedback.exchange(compressor, x, ctx)])
        outs = [[r.aggregate for r in rank_outs] for rank_outs in simulate(gens)]
        for rank in range(1, world):
            assert torch.equal(outs[0][0], outs[rank][0])
        assert outs[0][0].shape == (24, 40)


@pytest.mark.parametrize("name", NAMES)
def test_odd_inputs(name):
    state = gradzip.GradzipState(build(name))
    for step in range(3):
        named = odd_inputs(step)
        out = state.exchange(named)
        for (_, g), o in zip(named, out):
            assert o.shape == g.shape and o.dtype == g.dtype and torch.isfinite(o).all()


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_gives_nan_and_keeps_state(name):
    state = gradzip.GradzipState(build(name))
    named = odd_inputs(0)
    state.exchange(named)
    saved = state.state_dict()
    bad = [(k, g.clone()) for k, g in named]
    bad[-1][1][0, 0] = float("nan")
    out = state.exchange(bad)
    assert all(torch.isnan(o).all() for o in out if o.numel())
    after = state.state_dict()
    assert after["steps"] == saved["steps"]
    for key, slot in saved["tensors"].items():
        for n, v in slot.items():
            assert torch.equal(after["tensors"][key][n], v)
    assert state.stats()["nonfinite_exchanges"] == 1


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resume_is_exact(name):
    def run(state, steps):
        return [state.exchange([(f"t{i}", grads(s, torch.float32, 7 * k + i)) for i, s in enumerate(SHAPES)])
                for k in steps]

    # Saved after six steps: past every test warm-up, and after auto's timed plan, which a resumed run
    # must take over rather than measure again.
    first = gradzip.GradzipState(build(name), seed=5)
    run(first, range(6))
    saved = first.state_dict()
    expected = run(first, range(6, 9))
    resumed = gradzip.GradzipState(build(name), seed=0)
    resumed.load_state_dict(saved)
    got = run(resumed, range(6, 9))
    for a, b in zip(expected, got):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_state_dict_of_another_method_is_refused():
    a = gradzip.GradzipState("topk")
    with pytest.raises(ValueError, match="state_dict is for compressor 'topk'"):
        gradzip.GradzipState("none").load_state_dict(a.state_dict())
