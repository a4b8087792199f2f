"""The shared test matrix: every registered compressor, picked up from the registry automatically.

Each check is one of :mod:`gradzip.testing`'s, the ones ``gradzip.testing.check_compressor`` runs on
compressors written outside the package: round trip (shapes, dtypes), exact wire bytes against the
method's own formula, error-feedback conservation, cross-rank agreement, odd inputs, non-finite inputs,
state_dict resume and exchanges into ``out`` with buffers reused across steps.  Real multi-process checks of the same properties are in test_distributed.py.
"""
from __future__ import annotations

import functools

import pytest

import gradzip
from gradzip import testing
from tests.workers import params_for

NAMES = gradzip.compressors()


def build(name, **extra):
    return gradzip.make(name, **{**params_for(name), **extra})


def factory(name):
    """A fresh compressor per check, with the test parameters that make it compress small tensors."""
    return functools.partial(build, name)


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


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_keeps_shape_and_dtype(name, dtype):
    testing.check_round_trip(factory(name), dtype=dtype)


@pytest.mark.parametrize("dtype", testing.DTYPES, ids=str)
@pytest.mark.parametrize("shape", testing.WIRE_SHAPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_wire_bytes_match_the_methods_formula(name, shape, dtype):
    testing.check_wire_bytes(factory(name), shape=shape, dtype=dtype)


@pytest.mark.parametrize("name", NAMES)
def test_error_feedback_conserves_everything(name):
    testing.check_error_feedback(factory(name))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", NAMES)
def test_ranks_agree_bit_for_bit(name, world):
    testing.check_ranks_agree(factory(name), world=world)


@pytest.mark.parametrize("name", NAMES)
def test_odd_inputs(name):
    testing.check_odd_inputs(factory(name))


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_gives_nan_and_keeps_state(name):
    testing.check_nonfinite(factory(name))


@pytest.mark.parametrize("name", NAMES)
def test_state_dict_resume_is_exact(name):
    testing.check_state_dict(factory(name))


@pytest.mark.parametrize("name", NAMES)
def test_exchange_into_out_reuses_buffers_bit_for_bit(name):
    testing.check_reuse(factory(name))


def test_check_compressor_runs_every_check_of_the_matrix():
    checks = {name for name, _, _ in testing.CHECKS}
    assert checks == {"round_trip", "wire_bytes", "error_feedback", "ranks_agree", "odd_inputs", "nonfinite",
                      "state_dict", "reuse"}
    assert testing.check_compressor(factory("topk"), distributed=False) == [
        "round_trip", "wire_bytes", "error_feedback", "ranks_agree", "odd_inputs", "nonfinite", "state_dict",
        "reuse"]


def test_state_dict_of_another_method_is_refused():
    a = gradzip.GradzipState("topk")
    with pytest.raises(ValueError, match="state_dict is for compressor 'topk'"):
        gradzip.GradzipState("none").load_state_dict(a.state_dict())
