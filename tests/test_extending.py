"""docs/extending.md's example compressor, run exactly as written from a module outside the package,
through gradzip.testing.check_compressor; and check_compressor failing loudly on broken compressors."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

import gradzip
from gradzip.compressors import compressors, registry
from gradzip.compressors.base import AllGather, Exchanged, GatheredCompressor
from gradzip.testing import check_compressor

DOC = Path(__file__).resolve().parent.parent / "docs" / "extending.md"


@pytest.fixture(scope="module")
def meansign(tmp_path_factory):
    """The doc's first code block, written to a file outside the package and imported as ``meansign``."""
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    folder = tmp_path_factory.mktemp("outside")
    (folder / "meansign.py").write_text(code)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))  # spawned workers inherit sys.path: they import it too
        try:
            yield importlib.import_module("meansign")
        finally:  # later tests that loop over every registered method must not meet it
            registry._REGISTRY.pop("meansign", None)
            sys.modules.pop("meansign", None)


def test_the_documented_example_passes_every_check(meansign):
    assert "meansign" in compressors()
    c = gradzip.make("meansign")
    assert isinstance(c, meansign.MeanSign) and c.feedback == "residual"
    ran = check_compressor(meansign.MeanSign)  # a factory, including two real gloo processes
    assert ran == ["round_trip", "wire_bytes", "error_feedback", "ranks_agree", "odd_inputs", "nonfinite",
                   "state_dict", "reuse", "distributed"]
    assert check_compressor("meansign", distributed=False)[-1] == "reuse"
    assert check_compressor(gradzip.make("meansign", feedback="none"), distributed=False)


def test_the_example_compresses_as_documented(meansign):
    state = gradzip.GradzipState("meansign")
    g = torch.tensor([[0.5, -1.5], [1.0, 0.0]])
    (out,) = state.exchange([("w", g)])
    assert torch.equal(out, torch.tensor([[0.75, -0.75], [0.75, 0.0]]))
    assert state.stats()["payload_bytes"] == 4 + 4


class OffByOne(GatheredCompressor):
    """Sends n fp32 values but claims one byte more."""

    name = "offbyone"

    def compress(self, x, ctx):
        return (x.reshape(-1).float(),)

    def decompress(self, fields, ctx):
        return fields[0].view(ctx.shape).clone()

    def payload_bytes(self, ctx, kept=None):
        return 4 * ctx.shape.numel() + 1


class LosesTheResidual(OffByOne):
    """Sends half of each value but tells error feedback it sent all of it: the other half is lost."""

    name = "losesresidual"
    default_feedback = "residual"

    def payload_bytes(self, ctx, kept=None):
        return 4 * ctx.shape.numel()

    def exchange(self, x, ctx):
        half = x.reshape(-1).float() * 0.5
        gathered = yield AllGather((half,))
        decoded = [self.decompress(f, ctx) for f in gathered]
        return Exchanged(self.combine(decoded, ctx), x.clone())


def test_a_wrong_wire_formula_fails_with_its_numbers():
    expected = "offbyone: wire bytes for shape (64, 40) float32 at step 0: payload 10240 != formula 10241"
    with pytest.raises(AssertionError, match=re.escape(expected)):
        check_compressor(OffByOne, distributed=False)


def test_a_lost_residual_fails_the_conservation_check():
    with pytest.raises(AssertionError, match=r"losesresidual: error feedback: scheme 'residual', tensor t0 .*"
                                             r"at step 0: sent \+ kept differs"):
        check_compressor(LosesTheResidual, distributed=False)


def test_a_compressor_that_raises_is_named_with_its_check():
    class Raises(OffByOne):
        name = "raises"

        def compress(self, x, ctx):
            raise RuntimeError("boom")

    with pytest.raises(AssertionError, match="raises: round trip: raised RuntimeError: boom"):
        check_compressor(Raises(), distributed=False)


def test_an_unpicklable_compressor_skips_the_process_check_with_a_warning(meansign):
    def local_factory():  # a local function cannot be pickled to worker processes
        return meansign.MeanSign()

    with pytest.warns(UserWarning, match="meansign: distributed check skipped.*top level of an importable module"):
        ran = check_compressor(local_factory)
    assert "distributed" not in ran and "state_dict" in ran
