"""The fast paths behind `gradzip bench kernels` give the same results as the plain tensor code.

The shared matrix uses small tensors; these paths switch on for large ones (sampled top-k, sparse
random positions, numpy bit packing) or for particular layouts, so they are checked here directly.
"""
from __future__ import annotations

import math

import pytest
import torch

import gradzip
from gradzip import feedback
from gradzip.bits import byte_table, lookup_codes, pack_bits, select, unpack_bits
from gradzip.collectives import LocalTransport, run_lockstep
from gradzip.compressors import base
from gradzip.compressors.base import Exchanged, TensorContext, column_counts, compare, zeroed
from gradzip.compressors.dense import NoCompression
from gradzip.compressors.sketch import median_of_rows
from gradzip.compressors.sparse import _at_least, _at_least_abs, magnitudes, random_positions, top_k, top_k_abs


def randn(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# -- comparisons by numpy: torch's masks, bit for bit ----------------------------------------------------


SPECIAL = [1.0, float("nan"), -float("inf"), float("inf"), -0.0, 0.0, 1e-45, -1e-45, 3.4e38, 0.1, 0.1000000015]


@pytest.mark.parametrize("op", ["lt", "le", "gt", "ge", "eq"])
def test_comparisons_by_numpy_are_torchs(op, monkeypatch):
    # numpy compares where it gives torch's result (a's dtype, the number rounded to it first); the
    # rest (a NaN or out-of-range number, an int against a float, other dtypes) is left to torch.
    used = []
    monkeypatch.setattr(base, "_COMPARISONS", {k: (t, lambda *a, _n=n, **kw: used.append(1) or _n(*a, **kw))
                                               for k, (t, n) in base._COMPARISONS.items()})
    # Large enough for numpy's path (small tensors stay with torch): the special values, tiled.
    floats = torch.tensor(SPECIAL * 6000, dtype=torch.float32).view(3, -1)
    ints = torch.tensor([-5, 0, 63, 64, 65, 2**31 - 1, -2**31] * 10_000, dtype=torch.int32)
    cases = [(floats, b) for b in (0, 0.0, -0.0, 0.1, 1e-46, 2**24, 2**40, 1e39, float("nan"), torch.tensor(0.1),
                                   torch.tensor(0.1, dtype=torch.float64), torch.tensor(float("nan")),
                                   torch.tensor(1e39, dtype=torch.float64))]
    cases += [(floats.double(), 0.1), (floats, floats.flip(1).contiguous()), (floats.half(), 0.1)]
    cases += [(ints, b) for b in (64, 0, 2**40, 2.5, torch.tensor(64, dtype=torch.int32), torch.tensor(64))]
    numpy_cases = 0
    for a, b in cases:
        before = len(used)
        got = compare(op, a, b, torch.empty(a.shape, dtype=torch.bool))
        assert torch.equal(got, getattr(torch, op)(a, b)), (a.dtype, b)
        numpy_cases += len(used) > before
    assert numpy_cases >= 12  # the numbers a's dtype holds, the 0-d tensors of its kind, the same-shape tensor


@pytest.mark.parametrize("shape", [(300, 257), (0, 5), (5, 0), (1, 1), (70_000, 3)])
def test_column_counts_are_torchs_int32_sums(shape):
    mask = torch.rand(shape, generator=torch.Generator().manual_seed(2)) < 0.3
    for m in (mask, mask.t()):  # the transposed one is not contiguous: torch's own sum
        got = column_counts(m)
        assert got.dtype == torch.int32 and torch.equal(got, m.sum(dim=0, dtype=torch.int32))


# -- the count sketch's median: a sorting network, torch.median's values ----------------------------------


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17])
def test_median_of_rows_is_torch_median(rows):
    a = randn(rows, 3000, seed=rows)
    a[:, :50] = 0.0  # ties
    a[:, 50:100] = a[0, 50:100].clone()
    a[torch.arange(rows), 100 + torch.arange(rows)] = float("inf")
    a[torch.arange(rows), 200 + torch.arange(rows)] = float("-inf")
    for r in range(rows):  # a NaN in any one row, and in every row
        a[r, 300 + r] = float("nan")
    a[:, 400] = float("nan")
    want = a.median(dim=0).values
    got = median_of_rows(a.clone())
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(want[300 : 300 + rows]).all()
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


# -- top_k: sampled pre-filter, exact result -----------------------------------------------------------


@pytest.mark.parametrize("n, k", [(100_000, 1_000), (300_000, 300), (1_000_000, 10_000), (200_000, 20_000)])
def test_top_k_is_the_exact_top_k(n, k):
    a = randn(n, seed=n + k).abs()
    got = top_k(a, k)
    assert got.numel() == k and got.unique().numel() == k
    assert torch.equal(got.sort().values, torch.topk(a, k).indices.sort().values)


def test_top_k_falls_back_when_the_sample_misleads_and_keeps_nans_first():
    n, k = 200_000, 2_000
    a = torch.zeros(n)
    a[1::1000] = torch.arange(1, 201, dtype=torch.float32)  # the strided sample sees only zeros
    a[5] = float("nan")
    got = top_k(a, k)
    expected = torch.topk(a, k).indices
    assert got.numel() == k and bool(torch.isnan(a[got]).any())
    assert torch.equal(a[got].sort().values.nan_to_num(1e9), a[expected].sort().values.nan_to_num(1e9))


def test_top_k_with_ties_keeps_k_values_of_the_right_size():
    a = (torch.arange(400_000) % 7).float()  # six values, huge ties
    got = top_k(a, 70_000)
    assert got.unique().numel() == 70_000
    assert torch.equal(a[got].sort().values, torch.topk(a, 70_000).values.sort().values)


@pytest.mark.parametrize("case", ["plain", "ties", "nan", "fallback", "small"])
def test_top_k_of_negated_is_top_k_of_the_negation(case):
    # Adaptive threshold's negative side: the positions top_k(-a) finds, without -a written.
    n, k = (200_000, 2_000) if case != "small" else (1_000, 10)
    a = randn(n, seed=3) * 0.01
    if case == "ties":
        a = (a * 1000).round() / 1000
    if case == "nan":
        a[[7, 9_001]] = float("nan")
    if case == "fallback":  # the strided sample sees only zeros: the whole topk
        a = torch.zeros(n)
        a[1::1000] = -torch.arange(1, 201, dtype=torch.float32)
    got = top_k(a, k, negated=True)
    assert torch.equal(got.sort().values, top_k(-a, k).sort().values)
    assert torch.equal((-a)[got].sort().values.nan_to_num(1e9), torch.topk(-a, k).values.sort().values.nan_to_num(1e9))


@pytest.mark.parametrize("n, k", [(100_003, 1_000), (300_000, 300), (1_179_648, 11_797), (200_005, 20_000)])
def test_top_k_abs_is_the_exact_top_k_of_magnitudes(n, k):
    x = randn(n, seed=n + k)
    x[n - 1] = 50.0  # in the tail that the column groups leave out when 8 does not divide n
    got = top_k_abs(x, k)
    assert got.numel() == k and got.unique().numel() == k
    assert torch.equal(got.sort().values, torch.topk(x.abs(), k).indices.sort().values)


def test_top_k_abs_keeps_nans_and_falls_back_when_the_sample_misleads():
    n, k = 200_000, 2_000
    x = torch.zeros(n)
    x[1::1000] = -torch.arange(1, 201, dtype=torch.float32)  # the strided sample sees only zeros
    x[5] = float("nan")
    got = top_k_abs(x, k)
    expected = torch.topk(x.abs(), k).indices
    assert got.numel() == k and bool(torch.isnan(x[got]).any())
    assert torch.equal(x[got].abs().sort().values.nan_to_num(1e9), x[expected].abs().sort().values.nan_to_num(1e9))
    y = randn(n, seed=4)
    y[77_777] = float("nan")
    assert 77_777 in top_k_abs(y, k).tolist()


def test_top_k_abs_with_ties_keeps_k_values_of_the_right_size():
    x = (torch.arange(400_000) % 7).float() - 3  # magnitudes 0..3, huge ties
    got = top_k_abs(x, 70_000)
    assert got.unique().numel() == 70_000
    assert torch.equal(x[got].abs().sort().values, torch.topk(x.abs(), 70_000).values.sort().values)


@pytest.mark.parametrize("case", ["plain", "zeros", "ties", "nan", "subnormal", "all zero", "tail"])
@pytest.mark.parametrize("n", [65_536, 200_003])
def test_threshold_selection_by_columns_is_the_comparison_over_magnitudes(case, n):
    # DGC and gradient dropping select |x| >= t by the column search when few pass: the same indices
    # in the same order as the comparison over a written |x|, so that their results do not change.
    x = randn(n, seed=n) * 0.01
    if case == "zeros":
        x[::2] = 0.0
    if case == "ties":
        x = (x * 300).round() / 300
    if case == "nan":
        x[1::997] = float("nan")
    if case == "subnormal":
        x = x * 1e-40
    if case == "all zero":
        x.zero_()
    if case == "tail":
        x[n - 1] = 1.0  # in the tail the column groups leave out when 8 does not divide n
    finite = x.abs().nan_to_num(0.0)
    for threshold in (torch.topk(finite, n // 100).values.min(), finite.max() / 3, torch.tensor(0.0)):
        expected = _at_least(magnitudes(x).clone(), threshold)
        got = _at_least_abs(x, threshold, expected=n // 100)
        assert torch.equal(got, expected), (case, float(threshold))


# -- random_positions: uniform k-subsets without an O(n) permutation -----------------------------------


def test_random_positions_are_distinct_sorted_and_reproducible():
    n, k = 1_000_000, 10_000
    a = random_positions(n, k, torch.Generator().manual_seed(3))
    b = random_positions(n, k, torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.numel() == k and a.dtype == torch.int64
    assert bool((a[1:] > a[:-1]).all()) and 0 <= int(a[0]) and int(a[-1]) < n
    assert not torch.equal(a, random_positions(n, k, torch.Generator().manual_seed(4)))


def test_random_positions_are_uniform():
    # Every position is drawn with probability k / n; over T fixed seeds the counts are Binomial(T, k/n)
    # per position, so the chi-square statistic over n positions is n - 1 +- sqrt(2 (n - 1)).
    n, k, steps = 70_000, 4_000, 400
    counts = torch.zeros(n)
    for seed in range(steps):
        counts.index_add_(0, random_positions(n, k, torch.Generator().manual_seed(seed)), torch.ones(k))
    p = k / n
    chi2 = float(((counts - steps * p) ** 2 / (steps * p * (1 - p))).sum())
    assert abs(chi2 - (n - 1)) < 6 * math.sqrt(2 * (n - 1))
    # First and second halves get their share (no bias toward small indices).
    assert abs(float(counts[: n // 2].sum()) / (steps * k) - 0.5) < 0.01


def test_random_positions_pairs_are_those_of_a_uniform_subset():
    # In a uniform k-subset of n positions, each of the n - 1 neighbouring pairs is chosen whole with
    # probability k (k - 1) / (n (n - 1)): a sampler that spreads its positions out (stratified, or
    # dropping near duplicates) or clumps them gets a different count.
    n, k, steps = 1 << 16, 4096, 300
    pairs = 0
    for seed in range(steps):
        chosen = torch.zeros(n, dtype=torch.bool)
        chosen[random_positions(n, k, torch.Generator().manual_seed(seed))] = True
        pairs += int((chosen[1:] & chosen[:-1]).sum())
    expected = steps * k * (k - 1) / n
    assert abs(pairs - expected) < 6 * math.sqrt(expected), (pairs, expected)


@pytest.mark.parametrize("name, params", [("randomk", {"ratio": 0.3}), ("topk", {"ratio": 0.3}),
                                          ("randomk", {"ratio": 0.3, "value_dtype": "float16"})])
def test_sparse_residual_is_exactly_the_input_less_what_was_sent(name, params):
    # The residual keeps p bit for bit where nothing was sent, and p - sent where something was: +0 where
    # the values went uncoded (-0.0 - -0.0 is +0 too), p - fp16(p) where they were rounded.
    g = randn(300, 400, seed=7)
    g.view(-1)[::2] = -0.0
    state = gradzip.GradzipState(gradzip.make(name, **params), transport=LocalTransport())
    state.exchange([("w", g)])
    residual = state.tensors["w"]["residual"].view(-1)
    (sent_at,) = torch.nonzero(residual.view(torch.int32) != g.view(-1).view(torch.int32), as_tuple=True)
    p = g.view(-1)
    if "value_dtype" in params:
        expected = p - p.half().float()
    else:
        expected = torch.zeros_like(p)
        assert sent_at.numel() > 0.25 * p.numel()  # the -0.0 among them changed sign
    assert torch.equal(residual[sent_at].view(torch.int32), expected[sent_at].view(torch.int32))


def test_randomk_on_a_large_tensor_sends_k_shared_positions():
    comp = gradzip.make("randomk", ratio=0.01)
    x = randn(400, 500, seed=2)
    outs = []
    for rank in range(2):
        ctx = TensorContext("w", x.shape, x.dtype, step=3, rank=rank, world_size=2)
        gen = comp.exchange(x * (rank + 1), ctx)
        outs.append(next(gen))
    assert outs[0].tensor.shape == (2000,)
    assert torch.equal(outs[0].tensor * 2, outs[1].tensor)  # same positions on both ranks


# -- zeroing large buffers ------------------------------------------------------------------------------


def test_zeroed_sets_positive_zeros_where_asked_and_nowhere_else():
    big = torch.full((1 << 17,), float("nan"))
    assert zeroed(big) is big and torch.equal(big.view(torch.int32), torch.zeros(1 << 17, dtype=torch.int32))
    rows = torch.full((1 << 10, 1 << 8), -1.0)
    zeroed(rows[:, 1:])  # not contiguous: torch's own zero_
    assert bool((rows[:, 1:] == 0).all()) and bool((rows[:, 0] == -1).all())
    part = torch.full((3 << 16,), 5.0)
    zeroed(part[1 << 16 : 2 << 16])  # a contiguous slice: only its own bytes
    assert float(part.sum()) == 5.0 * (2 << 16) and bool((part[1 << 16 : 2 << 16] == 0).all())


# -- decoding packed codes by byte ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_lookup_codes_is_the_table_of_each_unpacked_code(bits):
    gen = torch.Generator().manual_seed(bits)
    values = torch.randn(2**bits, generator=gen)
    for n in (0, 1, 7, 8, 9, 1001):
        codes = torch.randint(0, 2**bits, (n,), generator=gen)
        packed = pack_bits(codes, bits)
        out, index = torch.full((n,), float("nan")), torch.empty(packed.numel(), dtype=torch.int32)
        assert lookup_codes(packed, byte_table(values, bits), n, out, index) is out
        assert torch.equal(out, values[unpack_bits(packed, bits, n).long()]), (bits, n)


# -- bit packing (numpy on the CPU) against the tensor reference ---------------------------------------


def _reference_pack(codes, bits):
    n = codes.numel()
    stream = ((codes.to(torch.int64).unsqueeze(1) >> torch.arange(bits)) & 1).reshape(-1)
    padded = torch.zeros(math.ceil(n * bits / 8) * 8, dtype=torch.uint8)
    padded[: stream.numel()] = stream.to(torch.uint8)
    return (padded.view(-1, 8).to(torch.int64) << torch.arange(8)).sum(dim=1).to(torch.uint8)


@pytest.mark.parametrize("bits", list(range(1, 17)))
def test_pack_unpack_match_the_reference_layout(bits):
    for n in (0, 1, 7, 8, 9, 1000, 65_537):
        codes = torch.randint(0, 2**bits, (n,), generator=torch.Generator().manual_seed(n + bits))
        packed = pack_bits(codes, bits)
        assert packed.dtype == torch.uint8 and torch.equal(packed, _reference_pack(codes, bits))
        back = unpack_bits(packed, bits, n)
        assert back.dtype == (torch.uint8 if bits <= 8 else torch.int64)
        assert torch.equal(back.long(), codes)
    bools = randn(1001) >= 0
    assert torch.equal(pack_bits(bools, 1), _reference_pack(bools.long(), 1))


def test_select_is_torch_where_bit_for_bit():
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3.5])
    a = torch.cat([specials, randn(1000)]).reshape(-1, 1).expand(-1, 8).contiguous()
    b = torch.cat([randn(1000, seed=1), specials.flip(0)]).reshape(-1, 1).expand(-1, 8).contiguous()
    cond = randn(*a.shape, seed=2) > 0
    for x, y in ((a, b), (a, torch.zeros(())), (torch.zeros(()), b), (a[0], b[0])):
        want = torch.where(cond, x, y)
        got = select(cond, x, y)
        assert torch.equal(want.view(torch.int32), got.view(torch.int32))


def test_broadcast_shape_is_torchs():
    from gradzip.bits import _broadcast_shape
    shapes = [(), (1,), (3,), (0,), (1, 0), (2, 1), (1, 3), (2, 3), (4, 1, 3), (0, 1), (3, 0)]
    pairs = 0
    for x in shapes:
        for y in shapes:
            try:
                expected = tuple(torch.broadcast_shapes(x, y))
            except RuntimeError:
                continue
            assert _broadcast_shape(x, y) == expected, (x, y)
            pairs += 1
    assert pairs > 60


# -- lazy Exchanged, in-place error feedback -----------------------------------------------------------


def test_sent_is_not_built_without_error_feedback():
    calls = []
    agg = torch.ones(3)
    ex = Exchanged(agg, lambda: calls.append(1) or agg * 2)
    assert calls == []
    assert torch.equal(ex.sent, agg * 2) and torch.equal(ex.sent, agg * 2) and calls == [1]  # built once
    sparse = Exchanged(torch.zeros(2, 3), sparse=(torch.tensor([1, 4]), torch.tensor([5.0, -1.0])))
    assert torch.equal(sparse.sent, torch.tensor([[0.0, 5.0, 0.0], [0.0, -1.0, 0.0]]))
    assert torch.equal(sparse.mask, sparse.sent != 0) and sparse.kept() == 2


class _CompressingIdentity(NoCompression):
    """Dense averaging that claims to compress, so error feedback keeps a residual for it."""

    def compresses(self, ctx):
        return True


@pytest.mark.parametrize("name", ["none", "fp16", "signsgd", "qsgd"])
def test_residual_feedback_when_the_method_hands_its_input_back(name):
    # NoCompression returns its input as sent: the residual update must not overwrite it in place.
    # ("none" itself keeps no residual at all, being sent densely.)
    compressor = _CompressingIdentity(feedback="residual") if name == "none" else gradzip.make(name, feedback="residual")
    state = gradzip.GradzipState(compressor)
    for step in range(3):
        g = randn(50, 40, seed=step)
        before = state.tensors.get("w", {}).get("residual")
        p = g if before is None else g + before
        (out,) = state.exchange([("w", g)])
        atol = 4 * torch.finfo(torch.float32).eps * float(p.abs().max())  # one rounding of p - sent
        torch.testing.assert_close(out + state.tensors["w"]["residual"], p, rtol=0, atol=atol)
    if name == "none":
        assert torch.equal(state.tensors["w"]["residual"], torch.zeros(50, 40))


@pytest.mark.parametrize("name, params", [("topk", {}), ("dgc", {"warmup_epochs": 0}), ("randomk", {}),
                                          ("csc", {"chunk_size": 10_000}), ("powersgd", {"dense_steps": 0})])
def test_large_tensors_conserve_error_feedback(name, params):
    state = gradzip.GradzipState(name, **params)
    for step in range(3):
        g = randn(300, 700, seed=10 + step)
        before = {k: v.clone() for k, v in state.tensors.get("w", {}).items()}
        (out,) = state.exchange([("w", g)])
        after = state.tensors["w"]
        if state.compressor.feedback == "residual":
            p = g + before.get("residual", 0)
            torch.testing.assert_close(out + after["residual"], p, rtol=0, atol=4e-7 * float(p.abs().max()))
        else:  # DGC's momentum correction: sent + kept velocity == velocity before sending
            u = 0.9 * before.get("momentum", torch.zeros_like(g)) + g
            v = before.get("velocity", 0) + u
            torch.testing.assert_close(out + after["velocity"], v, rtol=0, atol=4e-7 * float(v.abs().max()))
            assert torch.equal(after["momentum"], torch.where(out != 0, 0.0, u))


def test_csc_chunk_norms_equal_the_padded_matrix_norms():
    comp = gradzip.make("csc")
    for n, c in [(1000, 7), (5000, 256), (70_000, 8192), (70_000, 40_000), (10, 256)]:
        comp.chunk_size = c
        flat = randn(n, seed=c)
        nchunks = -(-n // c)
        want = torch.cat([flat, torch.zeros(nchunks * c - n)]).view(nchunks, c).abs().sum(dim=1)
        assert torch.equal(comp.chunk_norms(flat, nchunks), want)


def test_nonfinite_check_reads_min_and_max():
    state = gradzip.GradzipState("none")
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = randn(33, 40).to(torch.float16)
        g[17, 3] = bad
        outs = state.exchange([("ok", randn(5)), ("w", g.t())])
        assert all(torch.isnan(o).all() for o in outs)
    assert state.stats()["nonfinite_exchanges"] == 3


def test_world_of_one_fused_results_are_views_that_do_not_overlap():
    x, y = randn(10), randn(3, 4)
    ctx_x, ctx_y = TensorContext("x", x.shape, x.dtype), TensorContext("y", y.shape, y.dtype)
    comp = gradzip.make("none")
    (rx, ry), _ = run_lockstep([feedback.exchange(comp, x, ctx_x), feedback.exchange(comp, y, ctx_y)],
                               LocalTransport())
    assert torch.equal(rx.aggregate, x) and torch.equal(ry.aggregate, y)
    rx.aggregate.zero_()
    assert torch.equal(ry.aggregate, y) and not torch.equal(x, torch.zeros(10))  # inputs untouched


def test_none_is_left_to_the_integrations_dense_path_and_keeps_no_state():
    state = gradzip.GradzipState("none", feedback="residual")
    named = [("w", randn(5, 4, seed=0))]
    assert state.plain_allreduce_dtype(named) == torch.float32  # the DDP hook then uses DDP's own allreduce
    (out,) = state.exchange(named)
    assert torch.equal(out, named[0][1]) and "residual" not in state.tensors.get("w", {})
