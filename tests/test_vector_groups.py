"""GradzipState(group_vectors_below=...): small vectors exchanged together as one tensor.

A group must behave exactly as one tensor holding the vectors one after another: the same aggregates,
the same state under the group's key, bit for bit, for every method, with and without ``out``.
"""
from __future__ import annotations

import pytest
import torch

from gradzip import GradzipState
from gradzip.compressors import compressors, make

#: Parameters that make every method compress these small tensors from the first step.
PARAMS = {"dgc": {"min_numel": 0, "warmup_epochs": 0}, "powersgd": {"dense_steps": 0}}
METHODS = [m for m in compressors() if not make(m, **PARAMS.get(m, {})).measures_time]


def named_grads(step: int) -> list[tuple[str, torch.Tensor]]:
    """Matrices between vectors of two dtypes: a 0-d, an empty, a non-contiguous and a large one."""
    g = torch.Generator().manual_seed(step)

    def r(*shape, dtype=torch.float32):
        return (torch.randn(shape, generator=g) * 0.1).to(dtype)

    return [("w", r(6, 5)), ("b", r(7)), ("scalar", r()), ("empty", r(0)), ("h1", r(5, dtype=torch.float16)),
            ("strided", r(18)[::2]), ("m", r(3, 4)), ("h2", r(3, dtype=torch.float16)), ("c", r(9)),
            ("large", r(40))]


def concatenated(state: GradzipState, named):
    """What the grouped exchange should be: the same exchange with each group as one tensor."""
    return [(key, named[m[0]][1] if len(m) == 1 else torch.cat([named[i][1].reshape(-1) for i in m]))
            for key, m in state.exchanged_keys(named)]


@pytest.mark.parametrize("into", [None, "inputs", "other"], ids=["returned", "into_inputs", "into_other"])
@pytest.mark.parametrize("method", METHODS)
def test_a_group_is_exchanged_as_its_concatenation(method, into):
    params = PARAMS.get(method, {})
    grouped = GradzipState(make(method, **params), seed=3, group_vectors_below=40)
    reference = GradzipState(make(method, **params), seed=3)
    for step in range(4):
        named = named_grads(step)
        if step == 2:  # a skipped step: NaN everywhere, no state changed
            named[5][1][1] = float("nan")
        plan = grouped.exchanged_keys(named)
        assert [m for _, m in plan] == [[0], [1, 2, 3, 5, 8], [4, 7], [6], [9]]  # "large" has 40 elements
        expected = reference.exchange(concatenated(grouped, named))
        inputs = [(k, g.clone()) for k, g in named]
        out = {None: None, "inputs": [g for _, g in inputs], "other": [torch.full_like(g, 5.0) for _, g in inputs]}[into]
        got = grouped.exchange(inputs, out=out)
        for (key, members), want in zip(plan, expected):
            for i, piece in zip(members, want.reshape(-1).split([named[i][1].numel() for i in members])):
                assert got[i].shape == named[i][1].shape and got[i].dtype == named[i][1].dtype
                assert torch.equal(got[i].reshape(-1).nan_to_num(7.0), piece.nan_to_num(7.0)), (
                    f"step {step}: {named[i][0]} of group {key!r}")
                if got[i].numel():
                    assert bool(got[i].isnan().all()) == (step == 2), f"step {step}: {named[i][0]}"
                if into:
                    assert got[i] is out[i]
        a, b = grouped.state_dict(), reference.state_dict()
        assert a["steps"] == b["steps"]
        assert a["tensors"].keys() == b["tensors"].keys()
        for key, slot in b["tensors"].items():
            assert slot.keys() == a["tensors"][key].keys()
            for n, v in slot.items():
                assert torch.equal(a["tensors"][key][n], v), f"step {step}: state {n!r} of {key!r}"


def test_a_vector_grouped_anew_leaves_no_state_of_its_old_group():
    state = GradzipState("topk", ratio=0.3, group_vectors_below=100)
    vectors = [(name, torch.randn(10)) for name in "abc"]
    state.exchange(vectors)
    (old, _), = state.exchanged_keys(vectors)
    assert set(state.tensors) == {old} and set(state.steps) == {old}
    state.exchange(vectors[:2] + [("d", torch.randn(10))])  # as after DDP rebuilt its buckets
    (new, _), = state.exchanged_keys(vectors[:2])
    assert new != old
    assert old not in state.tensors and old not in state.steps and old not in state._buffers
    assert new not in state.tensors  # [a, b, d] was exchanged; [a, b] alone never was
    state.exchange(vectors[:2])
    assert set(state.steps) == {new} and set(state.tensors) == {new}


def test_a_skipped_step_keeps_the_old_group():
    state = GradzipState("topk", ratio=0.3, group_vectors_below=100)
    vectors = [(name, torch.randn(10)) for name in "abc"]
    state.exchange(vectors)
    saved = state.state_dict()
    bad = [(k, g.clone()) for k, g in vectors[:2]]
    bad[0][1][3] = float("nan")
    assert state.exchange(bad)[1].isnan().all()
    after = state.state_dict()
    assert after["steps"] == saved["steps"] and after["tensors"].keys() == saved["tensors"].keys()
    state.exchange(vectors[:2])
    assert set(state.steps) == {state.exchanged_keys(vectors[:2])[0][0]}


def test_vectors_going_alone_and_back_start_their_group_afresh():
    state = GradzipState("topk", ratio=0.3, group_vectors_below=100)
    pair = [("a", torch.randn(10)), ("b", torch.randn(10))]
    (group, _), = state.exchanged_keys(pair)
    state.exchange(pair)
    assert set(state.tensors) == {group}
    state.exchange(pair[:1])
    state.exchange(pair[1:])
    assert set(state.tensors) == set(state.steps) == {"a", "b"}  # the group's residual is gone, not kept aside
    state.exchange(pair)
    assert set(state.tensors) == set(state.steps) == {group}
    fresh = GradzipState("topk", ratio=0.3, group_vectors_below=100)
    fresh.steps[group] = state.steps[group] - 1  # the same step, hence the same draws, with no residual
    fresh.exchange(pair)
    assert torch.equal(fresh.tensors[group]["residual"], state.tensors[group]["residual"])


def test_a_new_group_keeps_its_bucket_on_one_step_count():
    """After DDP rebuilds its buckets, a new group starts at its bucket's step: auto schedules its trials
    by step, bucket by bucket."""
    state = GradzipState("topk", ratio=0.3, group_vectors_below=100)
    w, a, b, c = ("w", torch.randn(4, 4)), ("a", torch.randn(5)), ("b", torch.randn(5)), ("c", torch.randn(5))
    state.exchange([w, a, b, c])
    state.exchange([w, a, b, c])
    state.exchange([w, a, b])
    (_, _), (group, _) = state.exchanged_keys([w, a, b])
    assert state.steps == {"w": 3, group: 3}
    dense = GradzipState("powersgd", group_vectors_below=100)  # the plain path: a step counted, not exchanged
    dense.exchange([w, a, b, c])
    dense.record_dense([w, a, b])
    assert dense.steps == {"w": 2, group: 2}


def test_one_vector_alone_and_large_vectors_keep_their_own_keys():
    state = GradzipState("topk", ratio=0.5, group_vectors_below=16)
    named = [("w", torch.randn(4, 4)), ("b", torch.randn(4)), ("big", torch.randn(16))]
    assert state.exchanged_keys(named) == [("w", [0]), ("b", [1]), ("big", [2])]
    state.exchange(named)
    assert set(state.tensors) == {"w", "b", "big"}
    assert GradzipState("topk").exchanged_keys(named[1:] + [("c", torch.randn(3))]) == [("b", [0]), ("big", [1]), ("c", [2])]


def test_dense_steps_count_and_check_the_group():
    """A plain allreduce the integration runs itself (PowerSGD's dense vectors) counts the group's step;
    a group holding a residual is never sent plainly."""
    state = GradzipState("fp16", feedback="residual", group_vectors_below=100)
    named = [("a", torch.randn(5)), ("b", torch.randn(6))]
    (key, _), = state.exchanged_keys(named)
    assert state.plain_allreduce_dtype(named) is None  # fp16 with error feedback keeps a residual
    dense = GradzipState("powersgd", group_vectors_below=100)  # it sends vectors densely
    assert dense.plain_allreduce_dtype(named) == torch.float32
    dense.record_dense(named)
    assert dense.steps == {key: 1}
    state.exchange(named)
    assert "residual" in state.tensors[key] and state.plain_allreduce_dtype(named) is None
    dense.tensors[key] = {"residual": torch.ones(11)}  # as if an earlier step had compressed the group
    assert dense.plain_allreduce_dtype(named) is None


@pytest.mark.parametrize("bad", [-1, 2.5, True, "64"])
def test_group_vectors_below_must_be_a_count(bad):
    with pytest.raises(ValueError, match="group_vectors_below must be an integer >= 0"):
        GradzipState("topk", group_vectors_below=bad)
