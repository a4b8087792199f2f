"""Method-specific tests of the quantisers: QSGD, TernGrad, natural compression.

Statistical tests use fixed seeds and Hoeffding-style tolerances.  One draw of an unbiased stochastic
rounding lies in an interval of known width w, so its standard deviation is at most w / 2; the mean of K
independent draws then deviates from the target by 6 * (w / 2) / sqrt(K) with probability below
2 * exp(-18) ~ 3e-8 per element (Hoeffding; no normal approximation involved).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradzip.bits import packed_nbytes, unpack_bits
from gradzip.collectives import simulate
from gradzip.compressors import make
from gradzip.compressors.base import AllGather, AllReduce, TensorContext

K = 2000  # independent draws per statistical test
SIGMAS = 6.0


def ctx_for(shape, step=0, rank=0, world_size=1, seed=0):
    return TensorContext(key="layer.weight", shape=torch.Size(shape), dtype=torch.float32, step=step,
                         rank=rank, world_size=world_size, seed=seed)


def exchange(comp, xs, step=0, seed=0):
    """Run one exchange over len(xs) simulated ranks; returns each rank's Exchanged."""
    world = len(xs)
    gens = [[comp.exchange(x, ctx_for(x.shape, step, r, world, seed))] for r, x in enumerate(xs)]
    return [out[0] for out in simulate(gens)]


def draws(comp, x, k=K):
    """k independent quantisations of x (one per step), as a float64 (k, n) tensor."""
    return torch.stack([exchange(comp, [x], step=i)[0].sent.reshape(-1) for i in range(k)]).double()


def assert_unbiased(samples, target, width):
    """Mean of the draws equals target, each draw lying in an interval of the given width per element."""
    k = samples.shape[0]
    target, width = target.double().reshape(-1), width.double().reshape(-1)
    err = samples.mean(0) - target
    sigma = width / 2 / math.sqrt(k)  # bound on the std of the mean of k draws (Popoviciu)
    worst = (err.abs() / sigma.clamp_min(1e-300)).max().item()
    assert torch.all(err.abs() <= SIGMAS * sigma), f"element off by {worst:.1f} sigma"
    # Biases too small to see per element still add up over the tensor (plain and sign-weighted sums).
    total_sigma = sigma.square().sum().sqrt()
    for weights in (torch.ones_like(target), target.sign()):
        assert abs((weights * err).sum()) <= SIGMAS * total_sigma


def test_unbiasedness_check_detects_bias():
    # The check above must have power: deterministic floor / nearest rounding to a grid fails it.
    torch.manual_seed(0)
    target = torch.rand(500, dtype=torch.float64) * 4
    floor = target.floor().expand(K, -1)
    nearest = target.round().expand(K, -1)
    for biased in (floor, nearest):
        with pytest.raises(AssertionError):
            assert_unbiased(biased, target, torch.ones_like(target))


# --- shared properties of the family -----------------------------------------------------------------

METHODS = ["qsgd", "terngrad", "natural"]


@pytest.mark.parametrize("name", METHODS)
def test_family_attributes(name):
    comp = make(name)
    assert comp.feedback == "none" and comp.default_feedback == "none"
    assert comp.deterministic is False


@pytest.mark.parametrize("name", METHODS)
def test_rounding_noise_is_private_per_rank_and_reproducible(name):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(1))
    comp = make(name)
    first = exchange(comp, [x, x])
    again = exchange(comp, [x, x])
    assert not torch.equal(first[0].sent, first[1].sent)  # independent noise on each worker
    for a, b in zip(first, again):
        assert torch.equal(a.sent, b.sent) and torch.equal(a.aggregate, b.aggregate)
    later = exchange(comp, [x, x], step=1)
    assert not torch.equal(first[0].sent, later[0].sent)  # fresh noise every step
    # The aggregate is the mean of what the workers sent.
    torch.testing.assert_close(first[0].aggregate, (first[0].sent + first[1].sent) / 2)


# --- QSGD ---------------------------------------------------------------------------------------------

def qsgd_fields(comp, x, step=0):
    gen = comp.exchange(x, ctx_for(x.shape, step))
    request = next(gen)
    assert isinstance(request, AllGather) and request.same_size
    norms, packed = request.fields
    return norms, packed


# bits per element = sign + ceil(log2(s + 1)) level bits; 2 bits at the paper's default s = 1.
@pytest.mark.parametrize("s, bits", [(1, 2), (2, 3), (3, 3), (4, 4), (7, 4), (8, 5), (100, 8), (255, 9),
                                     (256, 10), (2**15 - 1, 16)])
def test_qsgd_bits_and_level_range(s, bits):
    n, bucket = 1000, 128
    comp = make("qsgd", levels=s, bucket_size=bucket, norm="max")
    x = torch.randn(n, generator=torch.Generator().manual_seed(s))
    norms, packed = qsgd_fields(comp, x)
    assert norms.dtype == torch.float32 and norms.numel() == math.ceil(n / bucket)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(n, bits)
    assert comp.payload_bytes(ctx_for(x.shape)) == 4 * math.ceil(n / bucket) + packed_nbytes(n, bits)
    codes = unpack_bits(packed, bits, n).long()
    level, negative = codes >> 1, codes & 1
    assert 0 <= level.min() and level.max() == s  # each bucket's max element sits on the top level
    # Each level is one of the two grid points around |v_i| s / ||v|| (float slack at the boundaries).
    ratio = x.abs().double() * s / torch.repeat_interleave(norms.double(), bucket)[:n]
    assert torch.all(level >= torch.floor(ratio - 1e-4)) and torch.all(level <= torch.ceil(ratio + 1e-4))
    assert torch.equal(negative.bool() & (level > 0), (x < 0) & (level > 0))


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_qsgd_norms_per_bucket(norm):
    x = torch.randn(300, generator=torch.Generator().manual_seed(2))
    norms, _ = qsgd_fields(make("qsgd", bucket_size=128, norm=norm), x)
    buckets = [x[:128], x[128:256], x[256:]]
    expected = [b.norm() if norm == "l2" else b.abs().max() for b in buckets]
    torch.testing.assert_close(norms, torch.stack(expected))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 300), s=st.integers(1, 40), bucket=st.integers(1, 64),
       norm=st.sampled_from(["l2", "max"]), seed=st.integers(0, 2**16))
def test_qsgd_decode_matches_codes(n, s, bucket, norm, seed):
    comp = make("qsgd", levels=s, bucket_size=bucket, norm=norm)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3
    norms, packed = qsgd_fields(comp, x)
    sent = exchange(comp, [x])[0].sent
    codes = unpack_bits(packed, math.ceil(math.log2(s + 1)) + 1, n).long()
    step = torch.repeat_interleave(norms / s, bucket)[:n]
    expected = step * (1 - 2 * (codes & 1)).float() * (codes >> 1).float()  # ||v|| * sign * xi / s
    assert torch.equal(sent, expected)
    assert torch.all(sent.abs() <= torch.repeat_interleave(norms, bucket)[:n] * (1 + 1e-6))


def test_qsgd_exact_on_representable_levels():
    # max-norm: |v_i| s / ||v|| is an integer, so every draw is exact.
    comp = make("qsgd", levels=4, bucket_size=5, norm="max")
    x = torch.tensor([1.0, -0.75, 0.5, -0.25, 0.0, 8.0, 0.0, -2.0, 6.0, 4.0, 0.0, 0.0])
    for step in range(5):
        assert torch.equal(exchange(comp, [x], step=step)[0].sent, x)
    # 2-norm: (1.5, -2) has norm 2.5; with s = 5 the levels are 3 and 4 exactly.
    x = torch.tensor([1.5, -2.0])
    for step in range(5):
        assert torch.equal(exchange(make("qsgd", levels=5), [x], step=step)[0].sent, x)


def test_qsgd_zero_bucket_decodes_to_zero():
    x = torch.cat([torch.zeros(4), torch.tensor([1.0, -3.0, 0.5, 2.0])])
    out = exchange(make("qsgd", bucket_size=4), [x, x])
    assert torch.equal(out[0].sent[:4], torch.zeros(4))
    assert torch.isfinite(out[0].aggregate).all()


@pytest.mark.parametrize("s, norm", [(1, "l2"), (3, "l2"), (4, "max")])
def test_qsgd_unbiased_and_within_variance_bound(s, norm):
    bucket, n = 128, 1000  # 8 buckets, the last one partial
    comp = make("qsgd", levels=s, bucket_size=bucket, norm=norm)
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    norms, _ = qsgd_fields(comp, x)
    samples = draws(comp, x)
    assert_unbiased(samples, x, torch.repeat_interleave(norms / s, bucket)[:n])  # draws are adjacent levels
    if norm == "l2":
        # E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 per bucket; random data sits well below it
        # (about 0.8x at s=1), far more than the sampling error of K draws.
        sq_err = (samples - x.double()).square().mean(0)
        for b in range(len(norms)):
            d = min(bucket, n - b * bucket)
            bound = min(d / s**2, math.sqrt(d) / s) * norms[b].double() ** 2
            assert sq_err[b * bucket:(b + 1) * bucket].sum() <= bound


@pytest.mark.parametrize("params, fragment", [
    ({"levels": 0}, "levels"), ({"levels": -1}, "levels"), ({"levels": 1.5}, "levels"),
    ({"levels": True}, "levels"), ({"levels": 2**15}, "levels"),
    ({"bucket_size": 0}, "bucket_size"), ({"bucket_size": 2.0}, "bucket_size"),
    ({"norm": "l1"}, "norm"), ({"norm": None}, "norm"), ({"feedback": "bogus"}, "feedback"),
])
def test_qsgd_validation(params, fragment):
    with pytest.raises(ValueError, match=fragment):
        make("qsgd", **params)


# --- TernGrad -----------------------------------------------------------------------------------------

def terngrad_steps(comp, x, ctx):
    """Drive one TernGrad exchange by hand on a single rank: (scale request, gather request, result)."""
    gen = comp.exchange(x, ctx)
    scale_req = gen.send(None)
    gather_req = gen.send(scale_req.tensor)
    try:
        gen.send([gather_req.fields])
    except StopIteration as stop:
        return scale_req, gather_req, stop.value
    raise AssertionError("TernGrad yielded more than two requests")


def test_terngrad_wire_and_codes():
    x = torch.randn(1001, generator=torch.Generator().manual_seed(4))
    comp = make("terngrad")
    scale_req, gather_req, result = terngrad_steps(comp, x, ctx_for(x.shape))
    assert isinstance(scale_req, AllReduce) and scale_req.op == "max"
    assert scale_req.tensor.dtype == torch.float32 and scale_req.tensor.shape == (1,)
    assert isinstance(gather_req, AllGather) and gather_req.same_size
    (packed,) = gather_req.fields
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(1001, 2)
    assert comp.payload_bytes(ctx_for(x.shape)) == 4 + packed_nbytes(1001, 2)
    codes = unpack_bits(packed, 2, 1001).long()
    assert codes.max() <= 2  # t + 1 in {0, 1, 2}
    s = scale_req.tensor
    assert torch.equal(result.sent, s * (codes - 1).float())
    t = codes - 1
    assert torch.all((t == 0) | (t == x.sign()))  # a nonzero t always carries the sign of g


def test_terngrad_scale_is_shared_across_ranks():
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(500, generator=gen) * (r + 1) for r in range(4)]
    comp = make("terngrad", clip=None)
    for r, x in enumerate(xs):  # each rank proposes its own max|g| ...
        request = next(comp.exchange(x, ctx_for(x.shape, rank=r, world_size=4)))
        assert request.tensor.item() == x.abs().max().item()
    out = exchange(comp, xs)
    s = max(x.abs().max() for x in xs)  # ... and all of them use the largest one
    for o in out:
        assert torch.equal(o.aggregate, out[0].aggregate)
        assert set(o.sent.abs().unique().tolist()) <= {0.0, s.item()}
    torch.testing.assert_close(out[0].aggregate, torch.stack([o.sent for o in out]).mean(0))


def test_terngrad_clipping():
    x = torch.cat([torch.tensor([100.0, -80.0]), torch.randn(998, generator=torch.Generator().manual_seed(6))])
    bound = 2.5 * x.square().mean().sqrt()
    request = next(make("terngrad").exchange(x, ctx_for(x.shape)))
    torch.testing.assert_close(request.tensor, bound.reshape(1))  # the outliers were clipped
    request = next(make("terngrad", clip=None).exchange(x, ctx_for(x.shape)))
    assert request.tensor.item() == 100.0
    request = next(make("terngrad", clip=10.0).exchange(x, ctx_for(x.shape)))
    torch.testing.assert_close(request.tensor, 4 * bound.reshape(1))


def test_terngrad_keeps_constant_and_single_element_tensors():
    # A standard deviation about the mean would be 0 here and clip everything to zero.
    for x in (torch.tensor([0.3]), torch.tensor(-0.7), torch.full((10,), 0.2)):
        out = exchange(make("terngrad"), [x])[0]
        assert torch.equal(out.sent, x) and torch.equal(out.aggregate, x)  # P(t = sign) = 1


def test_terngrad_all_zero_tensor():
    z = torch.zeros(10)
    out = exchange(make("terngrad"), [z, z, z])
    for o in out:
        assert torch.equal(o.aggregate, z) and torch.equal(o.sent, z)
    x = torch.randn(10, generator=torch.Generator().manual_seed(7))
    out = exchange(make("terngrad"), [z, x])
    assert torch.equal(out[0].sent, z) and torch.isfinite(out[1].aggregate).all()


@pytest.mark.parametrize("clip", [None, 2.5, 1.0])
def test_terngrad_unbiased_for_clipped_gradient(clip):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    x[:3] = torch.tensor([9.0, -7.0, 6.0])  # outliers that clipping removes
    target = x if clip is None else x.clamp(-clip * x.square().mean().sqrt(), clip * x.square().mean().sqrt())
    s = target.abs().max()
    assert_unbiased(draws(make("terngrad", clip=clip), x), target, torch.full_like(x, s))  # t in {0, sign}


@pytest.mark.parametrize("clip", [0, -1.0, math.nan, math.inf, "2.5", True])
def test_terngrad_validation(clip):
    with pytest.raises(ValueError, match="clip"):
        make("terngrad", clip=clip)


# --- natural compression ------------------------------------------------------------------------------

def power_below(mag):
    """2^floor(log2(mag)), exactly (frexp: mag = m * 2^e with m in [0.5, 1))."""
    return torch.ldexp(torch.ones_like(mag), torch.frexp(mag).exponent - 1)


def natural_codes(x, step=0):
    (codes,) = next(make("natural").exchange(x, ctx_for(x.shape, step))).fields
    return codes


def natural_decode(codes):
    return make("natural").decompress((codes,), ctx_for(codes.shape))


def test_natural_exact_on_powers_of_two():
    k = torch.arange(-63, 64)
    x = torch.cat([torch.ldexp(torch.ones(127), k), -torch.ldexp(torch.ones(127), k), torch.zeros(1)])
    expected = torch.cat([k + 64, (k + 64) | 0x80, torch.zeros(1, dtype=torch.long)]).to(torch.uint8)
    for step in range(3):  # no randomness involved: mantissa fraction 0
        codes = natural_codes(x, step)
        assert codes.dtype == torch.uint8 and codes.numel() == x.numel()
        assert torch.equal(codes, expected)
        assert torch.equal(natural_decode(codes), x)


def test_natural_every_code_round_trips():
    codes = torch.arange(256).to(torch.uint8)
    values = natural_decode(codes)
    assert torch.isnan(values[0x80]) and torch.isnan(values).sum() == 1  # 0x80: the non-finite marker
    finite = codes != 0x80
    assert torch.equal(natural_codes(values[finite]), codes[finite])
    e = torch.arange(1, 128)
    assert torch.equal(values[1:128], torch.ldexp(torch.ones(127), e - 64))
    assert torch.equal(values[0x81:], -values[1:128])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=-2.0**62, max_value=2.0**62, width=32, allow_subnormal=True),
                min_size=1, max_size=50),
       st.integers(0, 1000))
def test_natural_draws_a_neighbouring_power_of_two(values, step):
    x = torch.tensor(values, dtype=torch.float32)
    y = natural_decode(natural_codes(x, step))
    mag, out = x.abs().double(), y.abs().double()
    normal = mag >= 2.0**-63
    lower = torch.where(normal, power_below(mag), 0.0)
    upper = torch.where(normal, 2 * lower, 2.0**-63)
    assert torch.all((out == lower) | (out == upper))
    assert torch.all((y == 0) | (y.sign() == x.sign()))


def test_natural_extreme_magnitudes():
    big = torch.tensor([2.0**63, 1.5 * 2.0**63, 1e30, -3.4e38, -(2.0**64)])
    y = natural_decode(natural_codes(big))
    assert torch.equal(y, big.sign() * 2.0**63)  # clamped, sign kept
    bad = torch.tensor([math.nan, math.inf, -math.inf])
    assert torch.isnan(natural_decode(natural_codes(bad))).all()  # overflow is never hidden
    # Below 2^-63 (subnormals included) the result is 0 or +-2^-63, never the NaN marker.
    tiny = torch.tensor([-1e-45, 1e-40, -1e-30, 2.0**-64, -(2.0**-70), -0.0])
    for step in range(200):
        y = natural_decode(natural_codes(tiny, step))
        assert torch.all((y == 0) | (y.abs() == 2.0**-63))
        assert torch.all((y == 0) | (y.sign() == tiny.sign()))


@pytest.mark.parametrize("scale", ["mixed", "tiny"])
def test_natural_unbiased(scale):
    gen = torch.Generator().manual_seed(9)
    if scale == "mixed":
        x = torch.randn(1000, generator=gen) * torch.exp2(torch.randint(-40, 40, (1000,), generator=gen).float())
        width = power_below(x.abs())  # draws in [2^a, 2^(a+1)]
    else:
        x = (torch.rand(1000, generator=gen) * 2 - 1) * 2.0**-62  # around and below the 2^-63 floor
        width = torch.full_like(x, 2.0**-63)  # draws in [0, 2^-63] or [2^-63, 2^-62]
    samples = draws(make("natural"), x)
    assert_unbiased(samples / width.double(), x / width, torch.ones_like(x))  # in units of the width


def test_natural_validation():
    with pytest.raises(ValueError, match="feedback"):
        make("natural", feedback="bogus")
    with pytest.raises(ValueError, match="unknown parameter"):
        make("natural", levels=2)


# -- readable references: the fast paths give their values bit for bit from the same draws ------------------
def _uniforms(ctx, n):
    """The draws the fast paths take: this worker's private stream (``_round_up``)."""
    return torch.rand(n, generator=ctx.generator(torch.device("cpu"), shared=False))


@pytest.mark.parametrize("norm", ["l2", "max"])
@pytest.mark.parametrize("n, bucket, s", [(1024, 512, 1), (1000, 128, 7), (37, 512, 3), (4096, 512, 255)])
def test_qsgd_fast_path_equals_the_papers_equations(n, bucket, s, norm):
    from gradzip.compressors.quantize import qsgd_reference

    comp = make("qsgd", levels=s, bucket_size=bucket, norm=norm)
    for step in range(3):
        x = torch.randn(n, generator=torch.Generator().manual_seed(step)) * 10.0 ** (step - 1)
        x[::11] = 0.0
        ctx = ctx_for(x.shape, step=step)
        fast = comp.decompress(comp.compress(x, ctx), ctx)
        padded = math.ceil(n / bucket) * bucket
        assert torch.equal(fast, qsgd_reference(x, s, _uniforms(ctx, padded)[:n], bucket, norm))


def test_natural_fast_path_equals_the_papers_equations():
    from gradzip.compressors.quantize import natural_reference

    comp = make("natural")
    x = torch.cat([torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 10.0 ** torch.randint(
        -30, 30, (3000,), generator=torch.Generator().manual_seed(2)).float(),
        torch.tensor([0.0, -0.0, 1.0, -2.0, 0.75, 2.0**-70, -(2.0**-64), 2.0**-63, 3.0 * 2.0**62, 2.0**70,
                      -(2.0**64), float("inf"), float("nan")])])
    for step in range(3):
        ctx = ctx_for(x.shape, step=step)
        fast = comp.decompress(comp.compress(x, ctx), ctx)
        reference = natural_reference(x, _uniforms(ctx, x.numel()))
        assert torch.equal(fast.isnan(), reference.isnan())
        assert torch.equal(fast.nan_to_num(), reference.nan_to_num())


@pytest.mark.parametrize("bits, n", [(2, 37), (4, 9), (8, 5), (2, 0)])
def test_bucket_decoding_looks_up_what_unpacking_gives(bits, n):
    """The bucket route's decoding by byte table (QSGD's sign * xi, TernGrad's t) equals unpacking each
    code and converting it, bit for bit (-0.0 for a negative zero level), the last byte's spare codes
    cut off."""
    from gradzip.bits import lookup_codes
    from gradzip.compressors.quantize import _pack_codes, _signed_level_bytes, _ternary_bytes, _unpack_codes

    codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(bits), dtype=torch.int32)
    packed = _pack_codes(codes, bits)
    unpacked = _unpack_codes(packed, bits, n)
    want = (unpacked >> 1).float().mul_((unpacked & 1).float().mul_(-2).add_(1))
    got = lookup_codes(packed, _signed_level_bytes(bits, packed.device), n)
    assert got.shape == (n,) and torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    if bits == 2:
        assert torch.equal(lookup_codes(packed, _ternary_bytes(packed.device), n), unpacked.float().sub_(1))
