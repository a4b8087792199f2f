"""The fused kernels (gradzip.kernels) give the reference paths' results bit for bit, and fall back to them.

With the thresholds lowered to 2^16 elements (the defaults, 2^20 and 2^24, would make these tests slow),
tensors just above that take the fused paths (65,792 elements: divisible by neither 5 nor QSGD's bucket
size, so those padded tails are exercised; a test below adds a partly used last byte of sign bits);
``GRADZIP_FUSED=0`` gives the reference path in the same process, from the same private random draws.  Each kernel compiles once per process and
specialisation (a few seconds each), so the cases here are few and small.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from gradzip import devices, feedback, kernels
from gradzip.collectives import simulate
from gradzip.compressors import make, quantize, sign, sparse
from gradzip.compressors.base import TensorContext
from tests import workers

SHAPE = (256, 257)  # 65,792 elements: just above the lowered threshold
LOWERED = 1 << 16

CASES = [
    ("qsgd", {}),
    ("qsgd", {"levels": 7, "norm": "max"}),
    ("terngrad", {}),
    ("terngrad", {"clip": None}),
    ("natural", {}),
    ("efsignsgd", {}),
    ("signsgd", {}),
    ("signsgd", {"zeros": "plus"}),
    ("signsgd", {"scaled": False}),
    ("signum", {}),
    ("signum", {"zeros": "plus", "scaled": False}),
    ("onebit", {}),
    ("adaptive_threshold", {}),  # its two sign counts
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in params.items())}" for name, params in CASES]


def inputs(world, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(SHAPE, generator=gen) * 0.01).to(dtype) for _ in range(world)]
    xs[0][0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-40])  # zeros of both signs, tiny and subnormal
    if world > 1:
        xs[1][:3] = 0  # whole rows of zeros on one rank: abstentions and ties in the votes
    return xs


def run(name, params, xs, monkeypatch, fused, step=5, same_draws=True):
    """Every rank's (aggregate, sent) of one exchange, with the fused path on or off.

    The fused quantisers make their uniforms in the kernel (``kernels.counter_uniforms`` of a seed from
    the worker's private stream); with ``same_draws`` the reference path takes the same draws instead of
    ``torch.rand``'s, so that the two can be compared bit for bit."""
    monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
    if not fused and same_draws:
        monkeypatch.setattr(quantize, "_uniforms", lambda n, ctx, device: kernels.counter_uniforms(
            torch.empty(n, device=device), quantize._seed(ctx, device)))
    comp = make(name, **params)
    ctxs = [TensorContext(key="w", shape=x.shape, dtype=x.dtype, step=step, rank=r, world_size=len(xs))
            for r, x in enumerate(xs)]
    outs = [out[0] for out in simulate([[comp.exchange(x, c)] for x, c in zip(xs, ctxs)])]
    return [(o.aggregate, o.sent) for o in outs]


def bits_of(t):
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_bits(got, expected):
    for pair_got, pair_expected in zip(got, expected):
        for a, b in zip(pair_got, pair_expected):
            assert a.dtype == b.dtype and a.shape == b.shape
            nan = torch.isnan(a)
            assert torch.equal(nan, torch.isnan(b))  # NaNs where the reference has them (any payload)
            assert torch.equal(bits_of(a)[~nan], bits_of(b)[~nan])


@pytest.fixture(autouse=True)
def lowered_thresholds(monkeypatch):
    defaults = {k: k.min_numel for k in kernels.KERNELS}
    monkeypatch.setattr(kernels, "MIN_NUMEL", LOWERED)
    monkeypatch.setattr(kernels, "LARGE_NUMEL", LOWERED)
    for kernel in kernels.KERNELS:
        monkeypatch.setattr(kernel, "min_numel", LOWERED)
    return defaults


def test_default_thresholds_leave_tensors_the_compile_would_not_repay(lowered_thresholds, calls, monkeypatch):
    # A kernel's own threshold: sign packing saves about one pass, so a 2^20-element tensor (a CNN's
    # fc layer) keeps the reference path, and the kernel returns None without compiling.
    from gradzip.compressors import sign
    kernel = sign._pack_signs
    assert lowered_thresholds[kernel] == lowered_thresholds[sign._sign_bytes] == 1 << 24
    assert lowered_thresholds[quantize._qsgd_encode] == 1 << 20
    assert lowered_thresholds[sparse._column_max_abs] == 1 << 24  # Top-k's column maxima: a pass
    assert lowered_thresholds[sparse._above_tau] == lowered_thresholds[sparse._mean_of_dense] == 1 << 24  # Threshold's
    kernel.min_numel = lowered_thresholds[kernel]
    assert kernel(torch.randn(1 << 20)) is None and not kernel._compiled
    # The decoding kernels, on CPUs, where the byte table is one to three passes slower: from 2^24.
    monkeypatch.setattr(kernels, "LARGE_NUMEL", 1 << 24)
    cpu = torch.device("cpu")
    assert not quantize._decodes_fused(1 << 20, 2, cpu) and quantize._decodes_fused(1 << 24, 2, cpu)


@pytest.fixture
def calls(monkeypatch):
    """Counts the fused kernels' calls."""
    count = {"n": 0}
    original = kernels.Kernel.__call__

    def counted(self, *args, **static):
        count["n"] += 1
        return original(self, *args, **static)

    monkeypatch.setattr(kernels.Kernel, "__call__", counted)
    return count


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name, params", CASES, ids=IDS)
def test_fused_equals_reference_bit_for_bit(name, params, world, monkeypatch, calls):
    xs = inputs(world)
    fused = run(name, params, xs, monkeypatch, fused=True)
    assert calls["n"] > 0 and kernels._failure is None
    assert_same_bits(fused, run(name, params, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_bytes_equals_pack_bits(bits):
    # Codes a byte each, packed by whole words; lengths with every partly filled last byte.
    from gradzip.bits import pack_bits
    gen = torch.Generator().manual_seed(bits)
    for n in range(LOWERED, LOWERED + 9):
        codes = torch.randint(0, 1 << bits, (n,), generator=gen, dtype=torch.uint8)
        assert torch.equal(kernels.pack_bytes(codes, bits), pack_bits(codes.to(torch.int64), bits))
    assert kernels.pack_bytes(torch.ones(5, dtype=torch.uint8), 1).tolist() == [0b11111]  # no whole byte


@pytest.mark.parametrize("name, params", [("qsgd", {}), ("terngrad", {}), ("efsignsgd", {})])
def test_codes_packed_in_their_loop_equal_the_reference(name, params, monkeypatch, calls):
    # GPUs pack codes in the loop that computes them; CPUs write them a byte each, then pack those.
    monkeypatch.setattr(devices, "packs_from_bytes", lambda where: False)
    xs = [x.reshape(-1)[:-3].clone() for x in inputs(2, seed=3)]  # a partly filled last byte
    assert_same_bits(run(name, params, xs, monkeypatch, fused=True), run(name, params, xs, monkeypatch, fused=False))
    assert calls["n"] > 0 and kernels._failure is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural", "efsignsgd", "signsgd"])
def test_half_precision_inputs(name, dtype, monkeypatch):
    xs = inputs(2, dtype)
    # QSGD compresses 16-bit inputs (which reach it only when called directly: error feedback hands every
    # method fp32) on its reference path, with torch.rand's draws, in both runs.
    same_draws = name != "qsgd"
    assert_same_bits(run(name, {}, xs, monkeypatch, fused=True),
                     run(name, {}, xs, monkeypatch, fused=False, same_draws=same_draws))


@pytest.mark.parametrize("name", ["qsgd", "natural", "efsignsgd", "signsgd"])
def test_non_contiguous_inputs(name, monkeypatch):
    xs = [x.t() for x in inputs(2, seed=1)]
    assert not xs[0].is_contiguous()
    assert_same_bits(run(name, {}, xs, monkeypatch, fused=True), run(name, {}, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("name, params", [("qsgd", {}), ("terngrad", {}), ("terngrad", {"clip": None}),
                                          ("natural", {}), ("efsignsgd", {}),
                                          ("signsgd", {"zeros": "plus"}), ("adaptive_threshold", {})])
def test_nan_and_inf_as_the_reference(name, params, monkeypatch):
    # Ternary sign codes leave NaN's code unspecified, so zeros="abstain" is not compared here.
    xs = inputs(2, seed=2)
    xs[0][5, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    xs[1][7, 9] = float("inf")
    assert_same_bits(run(name, params, xs, monkeypatch, fused=True),
                     run(name, params, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("name, params", [("qsgd", {}), ("qsgd", {"levels": 7, "norm": "max"}), ("terngrad", {}),
                                          ("natural", {})])
def test_decoding_by_byte_table_equals_the_kernels_and_unpacking(name, params, world, monkeypatch, calls):
    # CPUs decode 2-, 4- and 8-bit codes by looking up whole bytes where no decoding kernel runs (natural
    # compression's mean has one on every device); the fused decoding kernels and the unpacking reference
    # give the same aggregate and the same decoded own payload, bit for bit.
    xs = [x.reshape(-1)[:-1].clone() for x in inputs(world, seed=6)]  # 65,791: a part-filled last byte
    xs[0][9:12] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    monkeypatch.setattr(kernels, "UNROLL_RANKS", 0)  # no decoding kernel: the table's run
    table = run(name, params, xs, monkeypatch, fused=True)
    monkeypatch.setattr(kernels, "UNROLL_RANKS", 16)
    monkeypatch.setattr(devices, "decodes_by_table", lambda where: False)
    decoding = {"n": calls["n"]}
    assert_same_bits(table, run(name, params, xs, monkeypatch, fused=True))
    assert calls["n"] > decoding["n"] + world  # the encoding kernels, then the decoding ones
    assert_same_bits(table, run(name, params, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("params", [{}, {"zeros": "plus", "beta": 0.99}])
def test_signum_momentum_update(params, monkeypatch, calls):
    x, m = inputs(2, seed=3)
    results = []
    for fused in (True, False):
        monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
        ctx = TensorContext(key="w", shape=x.shape, dtype=x.dtype, step=1, state={"signum_momentum": m})
        out = simulate([[make("signum", **params).exchange(x, ctx)]])[0][0]
        results.append([(out.aggregate, ctx.updates["signum_momentum"])])
    assert calls["n"] > 0
    assert_same_bits(*results)
    assert results[0][0][1].is_contiguous()


def record_kernel(monkeypatch, module, name, leading):
    """Wrap the kernel ``module.name``; the list returned gets, for each call, (how many arguments it
    took after the first ``leading``: for a mean over ranks, the ranks' payloads; whether its result
    was used)."""
    kernel, calls = getattr(module, name), []

    def recorded(*args):
        result = kernel(*args)
        calls.append((len(args) - leading, result is not None))
        return result

    monkeypatch.setattr(module, name, recorded)
    return calls


def with_residual(name, xs, kept, monkeypatch, fused):
    """Every rank's (aggregate, new residual) of one exchange whose residual from earlier is ``kept``."""
    monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
    comp = make(name)
    ctxs = [TensorContext(key="w", shape=x.shape, dtype=x.dtype, step=3, rank=r, world_size=len(xs),
                          state={"residual": e.clone()}) for r, (x, e) in enumerate(zip(xs, kept))]
    outs = simulate([[feedback.exchange(comp, x, c)] for x, c in zip(xs, ctxs)])
    return [(out[0].aggregate, c.updates["residual"]) for out, c in zip(outs, ctxs)]


@pytest.mark.parametrize("world", [1, 3])
def test_efsignsgd_residual_from_its_input_equals_the_decoded_one(world, monkeypatch):
    # With a residual kept from earlier, p = g + e is feedback's own: EF-signSGD then computes
    # e' = p - scale * sign(p) in one fused pass over p instead of decoding its own signs.
    xs = inputs(world, seed=4)
    kept = [x.flip(0) * 0.5 for x in inputs(world, seed=5)]
    kept[0][0, :4] = torch.tensor([0.0, -0.0, 0.0, 0.0])  # p keeps x's +0, -0, tiny and subnormal
    used = []
    original = sign._minus_scaled_signs
    monkeypatch.setattr(sign, "_minus_scaled_signs", lambda *args: used.append(1) or original(*args))
    assert_same_bits(*(with_residual("efsignsgd", xs, kept, monkeypatch, fused) for fused in (True, False)))
    assert len(used) == world  # every rank subtracted by the kernel; none in the reference run


@pytest.mark.parametrize("shape", [(257, 257), (257 * 257,)], ids=["matrix", "vector"])  # a partly used last byte
@pytest.mark.parametrize("world", [1, 3])
def test_onebit_mean_comes_from_its_kernel(world, shape, monkeypatch):
    results = record_kernel(monkeypatch, sign, "_mean_of_column_codes", leading=2)
    gen = torch.Generator().manual_seed(16)
    xs = [torch.randn(shape, generator=gen) * 0.01 for _ in range(world)]
    xs[0].view(-1)[:3] = torch.tensor([0.0, -0.0, float("inf")])
    fused = run("onebit", {}, xs, monkeypatch, fused=True)
    assert results == [(world, True)] * world  # on every rank, its result used
    assert_same_bits(fused, run("onebit", {}, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("shape", [SHAPE, (SHAPE[0] * SHAPE[1],)], ids=["matrix", "vector"])
@pytest.mark.parametrize("world", [1, 3])
def test_onebit_residual_from_its_input_equals_the_decoded_one(world, shape, monkeypatch):
    # 1-bit SGD's own bits are p >= 0: e' = p - (a_j where p_ij >= 0, else b_j) in one fused pass over p
    # instead of unpacking and decoding its own payload.  A vector is an n x 1 matrix: one column.
    xs = [x.reshape(shape) for x in inputs(world, seed=14)]
    kept = [x.flip(0).reshape(shape) * 0.5 for x in inputs(world, seed=15)]
    kept[0].view(-1)[:4] = 0.0  # p keeps x's +0, -0, tiny and subnormal
    xs[0].view(-1)[9] = float("nan")
    used = []
    original = sign._minus_column_means
    monkeypatch.setattr(sign, "_minus_column_means", lambda *args: used.append(1) or original(*args))
    assert_same_bits(*(with_residual("onebit", xs, kept, monkeypatch, fused) for fused in (True, False)))
    assert len(used) == world  # every rank subtracted by the kernel; none in the reference run


@pytest.mark.parametrize("rank", [2, 3])
@pytest.mark.parametrize("world", [1, 3])
def test_powersgd_products_fused_equal_the_reference(rank, world, monkeypatch):
    # The aggregate P Qbar^T is written by one kernel, and the residual M - P Q_i^T is computed in place
    # in M (fused multiply-adds in the order of the reference's addcmul_).
    from gradzip.compressors import lowrank
    used = []
    for name in ("_outer_into", "_minus_outer"):
        original = getattr(lowrank, name)
        monkeypatch.setattr(lowrank, name, lambda *a, _f=original, _n=name, **k: used.append(_n) or _f(*a, **k))
    xs = inputs(world, seed=6)
    kept = [x.flip(1) * 0.5 for x in inputs(world, seed=7)]
    results = []
    for fused in (True, False):
        monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
        comp = make("powersgd", rank=rank, dense_steps=0)
        ctxs = [TensorContext(key="w", shape=x.shape, dtype=x.dtype, step=3, rank=r, world_size=world,
                              state={"residual": e.clone()}) for r, (x, e) in enumerate(zip(xs, kept))]
        outs = simulate([[feedback.exchange(comp, x, c)] for x, c in zip(xs, ctxs)])
        results.append([(out[0].aggregate, c.updates["residual"], c.updates["Q"]) for out, c in zip(outs, ctxs)])
        assert sorted(set(used)) == ["_minus_outer", "_outer_into"] and len(used) == 2 * world
    assert_same_bits(*results)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("world", [1, 3])
def test_dgc_momentum_correction_fused_equals_the_reference(nesterov, world, monkeypatch):
    # u = m u + g and v = v + u (Nesterov: u = (u + g) m, v = v + u + g) in one kernel, rounded as the
    # reference's separate steps; then the selection, the masking and the sent values as before.
    used = []
    original = feedback._momentum_step
    monkeypatch.setattr(feedback, "_momentum_step", lambda *a, **k: used.append(1) or original(*a, **k))
    xs = inputs(world, seed=8)
    us, vs = inputs(world, seed=9), inputs(world, seed=10)
    results = []
    for fused in (True, False):
        monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
        comp = make("dgc", ratio=0.01, warmup_epochs=0, momentum=0.9, nesterov=nesterov)
        ctxs = [TensorContext(key="w", shape=x.shape, dtype=x.dtype, step=3, rank=r, world_size=world,
                              state={"momentum": u.clone(), "velocity": v.clone()})
                for r, (x, u, v) in enumerate(zip(xs, us, vs))]
        outs = simulate([[feedback.exchange(comp, x, c)] for x, c in zip(xs, ctxs)])
        results.append([(out[0].aggregate, c.updates["momentum"], c.updates["velocity"])
                        for out, c in zip(outs, ctxs)])
        assert len(used) == world
    assert_same_bits(*results)


@pytest.mark.parametrize("case", ["plain", "nan", "inf", "ties", "tail"])
def test_column_maxima_kernel_gives_the_reference_selections(case, monkeypatch, calls):
    # Top-k's and DGC's column search takes the largest |x| of each column from one kernel: the same
    # candidates, so the same positions in the same order as the reference's amax and amin.
    n = 8 * 9001 + 5  # just above the lowered threshold; a tail the columns leave out
    x = torch.randn(n, generator=torch.Generator().manual_seed(11)) * 0.01
    x[:2] = torch.tensor([-0.0, 0.0])
    if case == "nan":  # off the strided sample (every third element from 0), which would make t NaN
        x[[5, 3001, 40_000]] = float("nan")
    if case == "inf":
        x[7] = float("-inf")
        x[8 * 9001 // 2] = float("inf")
    if case == "ties":
        x = (x * 100).round() / 100
    if case == "tail":
        x[-2] = -1.0
    threshold = torch.topk(x.abs().nan_to_num(0.0), n // 50).values.min()
    results = []
    for fused in (True, False):
        monkeypatch.setenv("GRADZIP_FUSED", "1" if fused else "0")
        before = calls["n"]
        results.append((sparse.top_k_abs(x, n // 100), sparse._at_least_abs(x, threshold, expected=n // 100)))
        assert (calls["n"] - before == 2) == fused and kernels._failure is None
    for got, expected in zip(*results):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("name", ["qsgd", "terngrad", "natural"])
def test_kernels_read_torch_rands_draws_where_they_make_none(name, monkeypatch, calls):
    # On GPUs the kernels take torch.rand's draws, as the reference path does (here: on the CPU).
    monkeypatch.setattr(devices, "draws_in_kernel", lambda where: False)
    xs = inputs(2, seed=11)
    fused = run(name, {}, xs, monkeypatch, fused=True)
    assert calls["n"] > 0
    assert_same_bits(fused, run(name, {}, xs, monkeypatch, fused=False, same_draws=False))


def test_counter_uniforms_in_a_kernel_equal_the_eager_ones_and_look_uniform():
    draw = kernels.fused(kernels.counter_uniforms, min_numel=1)
    like = torch.empty(LOWERED + 3)  # a vector tail after the whole vectors
    for seed in (0, 1, -2**31, 2**31 - 1, 123456789):
        seed = torch.tensor(seed, dtype=torch.int32)
        u = draw(like, seed)
        assert torch.equal(u, kernels.counter_uniforms(like, seed))
        assert float(u.min()) >= 0 and float(u.max()) < 1 and torch.equal(u * 2**24, (u * 2**24).floor())
        counts = torch.histc(u, bins=16, min=0, max=1)
        expected = like.numel() / 16
        assert float(((counts - expected) ** 2 / expected).sum()) < 50  # chi-square, 15 dof: p < 1e-4
        assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.02  # neighbours
    a, b = (draw(like, torch.tensor(s, dtype=torch.int32)) for s in (7, 8))
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.02  # seeds a step apart


def test_small_tensors_and_the_switch_keep_the_reference_path(monkeypatch, calls):
    small = [torch.randn(100, 7)]
    run("qsgd", {}, small, monkeypatch, fused=True)
    assert calls["n"] == 0
    run("qsgd", {}, inputs(1), monkeypatch, fused=False)  # GRADZIP_FUSED=0
    assert calls["n"] == 0 and not kernels.enabled(kernels.MIN_NUMEL)
    monkeypatch.setenv("GRADZIP_FUSED", "1")
    assert not kernels.enabled(kernels.MIN_NUMEL - 1) and kernels.enabled(kernels.MIN_NUMEL)


def test_a_failing_compiler_warns_once_and_falls_back_for_good(monkeypatch):
    monkeypatch.setattr(kernels, "_failure", None)  # restored afterwards: other tests keep fused paths

    def no_compiler(*args, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(torch, "compile", no_compiler)
    # Fresh kernels (nothing compiled yet), as in a process without a compiler.
    for attr in ("_qsgd_encode", "_qsgd_code_bytes", "_qsgd_mean"):
        monkeypatch.setattr(quantize, attr, kernels.fused(getattr(quantize, attr).fn, min_numel=LOWERED))
    xs = inputs(1)
    with pytest.warns(RuntimeWarning, match="fused kernels are off") as caught:
        got = run("qsgd", {}, xs, monkeypatch, fused=True)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    assert "No working C++ compiler" in str(caught[0].message)
    assert not kernels.enabled(kernels.MIN_NUMEL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        again = run("qsgd", {}, xs, monkeypatch, fused=True)
    expected = run("qsgd", {}, xs, monkeypatch, fused=False, same_draws=False)
    assert_same_bits(got, expected)
    assert_same_bits(again, expected)


@pytest.mark.parametrize("world", [1, 3])
def test_ternary_vote_runs_its_kernel_on_every_plane(world, monkeypatch):
    # The vote of signSGD's and Signum's ternary codes: planes 0-3 in one call, the shorter last plane
    # in a second, on every rank; the same bits as the reference path's integer count.
    ran = []
    original = sign._trit_vote_planes.run
    monkeypatch.setattr(sign._trit_vote_planes, "run", lambda out, *args: ran.append(
        (tuple(out.shape), len(args) - 2)) or original(out, *args))
    xs = inputs(world)
    fused = run("signsgd", {}, xs, monkeypatch, fused=True)
    m = -(-SHAPE[0] * SHAPE[1] // 5)
    assert ran == [((4, m), world), ((1, SHAPE[0] * SHAPE[1] - 4 * m), world)] * world
    assert_same_bits(fused, run("signsgd", {}, xs, monkeypatch, fused=False))


def test_ternary_vote_of_many_ranks_keeps_the_reference_path(monkeypatch):
    world = kernels.UNROLL_RANKS + 1  # the kernel would unroll a sum over that many ranks
    monkeypatch.setattr(sign, "_trit_vote_planes", None)  # any use of the kernel fails
    gathered = [sign.encode_trits(x) for x in inputs(world)]
    vote = sign.vote_of_trits(gathered, SHAPE, torch.empty(SHAPE))
    counts = sum(sign.decode_trits(g, vote.numel()).long() for g in gathered)
    assert torch.equal(vote.view(-1), counts.sign().float())


@pytest.mark.parametrize("length", [None, SHAPE[0] * SHAPE[1] + 3])  # whole bytes; a last byte partly used
@pytest.mark.parametrize("world", [1, 3])
def test_efsignsgd_mean_comes_from_its_kernel(world, length, monkeypatch):
    results = record_kernel(monkeypatch, sign, "_mean_of_scaled_signs", leading=2)
    xs = inputs(world) if length is None else [torch.cat([x.view(-1), x.view(-1)[:3] - 1]) for x in inputs(world)]
    fused = run("efsignsgd", {}, xs, monkeypatch, fused=True)
    assert results == [(world, True)] * world  # on every rank, its result used
    assert_same_bits(fused, run("efsignsgd", {}, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("world", [1, 3])
def test_natural_mean_comes_from_its_kernel_on_cpus(world, monkeypatch):
    results = record_kernel(monkeypatch, quantize, "_natural_mean", leading=1)
    xs = inputs(world, seed=8)
    xs[0][5, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])  # decoded to NaN
    fused = run("natural", {}, xs, monkeypatch, fused=True)
    assert results == [(world, True)] * world
    assert_same_bits(fused, run("natural", {}, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("offset", [0, 1])  # a rank's codes at an odd offset in a fused receive buffer
def test_terngrad_mean_kernel_reads_words_where_aligned(offset, monkeypatch):
    from gradzip.bits import pack_bits
    n = SHAPE[0] * SHAPE[1] - 3  # a part-filled last word
    gen = torch.Generator().manual_seed(9)
    packed = []
    for _ in range(3):
        payload = pack_bits(torch.randint(0, 3, (n,), generator=gen, dtype=torch.uint8), 2)
        buffer = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
        buffer[offset:offset + payload.numel()] = payload
        packed.append(buffer[offset:offset + payload.numel()])
    widths = []
    kernel = quantize._terngrad_mean
    monkeypatch.setattr(quantize, "_terngrad_mean", lambda *args, per: widths.append(per) or kernel(*args, per=per))
    s = torch.tensor([0.37])
    fused = quantize._ternary_mean(packed, s, n, torch.empty(n))
    assert widths == [8 if offset % 2 == 0 else 4]
    monkeypatch.setenv("GRADZIP_FUSED", "0")  # the byte table's path
    assert torch.equal(bits_of(fused), bits_of(quantize._ternary_mean(packed, s, n, torch.empty(n))))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("params", [{}, {"levels": 7, "norm": "max"}, {"bucket_size": 510}], ids=str)
def test_qsgd_mean_comes_from_its_kernel_where_codes_tile_the_buckets(params, world, monkeypatch):
    # Whole buckets in the kernel, laid out (bucket, word, code); the last, part-filled bucket as the
    # reference decodes it.  A bucket size whose codes do not fill whole bytes keeps the table.
    results = []
    kernel = quantize._qsgd_mean
    monkeypatch.setattr(quantize, "_qsgd_mean", lambda *args, **static: results.append(static["per"])
                        or kernel(*args, **static))
    xs = [x.reshape(-1)[:-1].clone() for x in inputs(world, seed=7)]  # 65,791 elements: 128 whole buckets
    fused = run("qsgd", params, xs, monkeypatch, fused=True)
    tiled = params.get("bucket_size", 512) == 512
    assert results == ([{1: 8, 7: 4}[params.get("levels", 1)]] * world if tiled else [])  # int16 words
    assert_same_bits(fused, run("qsgd", params, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("offset", [0, 1])  # a rank's codes at an odd offset in a fused receive buffer
def test_qsgd_mean_kernel_reads_words_where_aligned(offset, monkeypatch):
    comp = make("qsgd")
    n, world = SHAPE[0] * SHAPE[1] - 5, 3
    gathered = []
    for r, x in enumerate(inputs(world, seed=10)):
        norms, codes = comp.compress(x.reshape(-1)[:n], TensorContext(key="w", shape=(n,), dtype=x.dtype, step=1, rank=r))
        buffer = torch.zeros(codes.numel() + 1, dtype=torch.uint8)
        buffer[offset:offset + codes.numel()] = codes
        gathered.append((norms, buffer[offset:offset + codes.numel()]))
    widths = []
    kernel = quantize._qsgd_mean
    monkeypatch.setattr(quantize, "_qsgd_mean", lambda *args, **static: widths.append(static["per"])
                        or kernel(*args, **static))
    ctx = TensorContext(key="w", shape=torch.Size([n]), dtype=torch.float32, world_size=world)
    fused = comp.decoded_mean(gathered, ctx).clone()
    assert widths == [8 if offset % 2 == 0 else 4]
    monkeypatch.setattr(kernels, "UNROLL_RANKS", 0)  # the byte table's path
    assert torch.equal(bits_of(fused), bits_of(comp.decoded_mean(gathered, ctx)))


def _qsgd_ranks(world, into, steps=2):
    """Every rank's aggregates and residuals over QSGD steps with residual feedback, ranks as threads."""
    from gradzip import GradzipState

    def worker(rank, transport):
        state = GradzipState("qsgd", feedback="residual", transport=transport)
        seen = []
        for x in inputs(steps, seed=20 + rank):
            g = x.clone()
            out = state.exchange([("w", g)], out=[g] if into else None)[0]
            seen.append((out.clone(), state.tensors["w"]["residual"].clone()))
        return seen

    return workers.run_threads(world, worker)


@pytest.mark.parametrize("unrolled", [16, 1])  # the mean in one kernel, or each rank decoded alone
def test_qsgd_own_decoding_leaves_the_aggregate_alone(unrolled, monkeypatch):
    # Decoding (as GPUs do, by the kernel) of this rank's own payload for its residual must not write into
    # the aggregate buffer, which an exchange into the gradients lends as the result.
    monkeypatch.setattr(devices, "decodes_by_table", lambda where: False)
    monkeypatch.setattr(kernels, "UNROLL_RANKS", unrolled)
    into, plain = _qsgd_ranks(2, into=True), _qsgd_ranks(2, into=False)
    for step in range(2):
        assert torch.equal(bits_of(into[0][step][0]), bits_of(into[1][step][0]))  # ranks agree
        for rank in range(2):
            for a, b in zip(into[rank][step], plain[rank][step]):
                assert torch.equal(bits_of(a), bits_of(b))


def test_qsgd_with_a_bucket_larger_than_the_tensor(monkeypatch):
    xs = inputs(2)
    assert_same_bits(run("qsgd", {"bucket_size": 1 << 17}, xs, monkeypatch, fused=True),
                     run("qsgd", {"bucket_size": 1 << 17}, xs, monkeypatch, fused=False))


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("params", [{"tau": 0.005}, {"tau": 1e-9, "value_dtype": "float16"}], ids=["fp32", "fp16-values"])
def test_threshold_dense_payload_and_mean_come_from_kernels(params, world, monkeypatch):
    # Threshold sending most elements: its payload where(|x| > tau, x, 0) from x alone, and the mean of
    # the ranks' dense payloads in one kernel; fp16 values round -1e-8 to -0.0, which the mean makes +0.
    values = record_kernel(monkeypatch, sparse, "_above_tau", leading=0)  # (x, tau, out)
    mean = record_kernel(monkeypatch, sparse, "_mean_of_dense", leading=1)
    xs = inputs(world, seed=12)
    xs[0][7, :5] = torch.tensor([-1e-8, float("nan"), float("inf"), -float("inf"), 0.005])
    fused = run("threshold", params, xs, monkeypatch, fused=True)
    assert values == [(3, True)] * (world if "value_dtype" not in params else 0)  # fp16 values: the mask
    assert mean == [(world, True)] * world  # on every rank, over every rank's payload, its result used
    assert_same_bits(fused, run("threshold", params, xs, monkeypatch, fused=False))


def test_threshold_with_a_rank_sending_sparsely_keeps_the_reference_sum(monkeypatch):
    xs = inputs(2, seed=13)
    xs[1] *= 1e-3  # almost nothing of rank 1 passes tau: (value, index) pairs
    mean = sparse._mean_of_dense
    monkeypatch.setattr(sparse, "_mean_of_dense", lambda *a: pytest.fail("a sparse payload went to the dense mean"))
    fused = run("threshold", {"tau": 0.005}, xs, monkeypatch, fused=True)
    monkeypatch.setattr(sparse, "_mean_of_dense", mean)
    assert_same_bits(fused, run("threshold", {"tau": 0.005}, xs, monkeypatch, fused=False))
