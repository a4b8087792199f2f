"""Real multi-process runs over gloo: both integrations, every compressor, 2 and 4 ranks (4 under the
optimizer wrapper in the slow tier)."""
from __future__ import annotations

import pytest
import torch

import gradzip
from tests import workers
from tests.distributed import run_workers

STEPS = 6
DETERMINISTIC = ["none", "topk", "dgc", "csc", "powersgd"]


# Four ranks under the optimizer wrapper too in the slow tier: four processes on 2 cores take 27 s.
@pytest.fixture(scope="module", params=[("ddp", 2), ("optimizer", 2), ("ddp", 4),
                                        pytest.param(("optimizer", 4), marks=pytest.mark.slow)],
                ids=lambda p: f"{p[0]}-{p[1]}ranks")
def trained(request):
    integration, world = request.param
    return integration, world, run_workers(workers.train_every_method, world, integration, STEPS, True)


@pytest.mark.parametrize("name", gradzip.compressors())
def test_every_rank_holds_identical_parameters(trained, name):
    _, world, results = trained
    params = [r[name][0] for r in results]
    assert all(torch.isfinite(p).all() for p in params)
    for rank in range(1, world):
        assert torch.equal(params[0], params[rank]), f"rank {rank} diverged from rank 0"
    start = torch.cat([p.detach().reshape(-1) for p in workers.small_model().parameters()])
    assert not torch.equal(params[0], start), "training did not change the parameters"


@pytest.mark.parametrize("name", gradzip.compressors())
def test_wire_bytes_are_counted(trained, name):
    _, world, results = trained
    stats = [r[name][1] for r in results]
    assert all(s["exchanges"] > 0 and s["wire_bytes"] >= s["payload_bytes"] > 0 for s in stats)
    if name == "none":
        assert stats[0]["ratio"] == pytest.approx(1.0, rel=0.01)
    if name in ("fp16", "bf16"):
        assert stats[0]["ratio"] == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize("name", [n for n in DETERMINISTIC if n in gradzip.compressors()])
def test_deterministic_methods_match_single_process_simulation(trained, name):
    _, world, results = trained
    simulated = workers.simulate_training(world, name, STEPS)
    for rank in range(world):
        real, sim = results[rank][name][0], simulated[rank][0]
        # allgather methods sum in rank order in both: exact; allreduce order inside gloo may differ.
        torch.testing.assert_close(real, sim, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world", [2, 4])
def test_odd_inputs_and_uneven_payloads_do_not_hang(world):
    results = run_workers(workers.exchange_odd_inputs, world, 3)
    for name in gradzip.compressors():
        for step in range(3):
            per_rank = [r[name][0][step] for r in results]
            for rank in range(1, world):
                for a, b in zip(per_rank[0], per_rank[rank]):
                    assert torch.equal(a, b), f"{name}: ranks disagree at step {step}"
            shapes = [g.shape for _, g in workers.odd_inputs(0)]
            assert [t.shape for t in per_rank[0]] == shapes


def test_nonfinite_on_one_rank_poisons_every_rank_and_changes_no_state():
    world = 2
    results = run_workers(workers.exchange_nonfinite, world)
    for name in gradzip.compressors():
        for rank in range(world):
            first, poisoned, unchanged, after = results[rank][name]
            nonempty = [t for t in poisoned if t.numel()]
            assert all(torch.isnan(t).all() for t in nonempty), f"{name}: rank {rank} got finite values"
            assert unchanged, f"{name}: state changed on a non-finite step"
            assert all(torch.isfinite(t).all() for t in after)


def test_ddp_hook_leaves_the_default_group_to_the_script():
    results = run_workers(workers.ddp_uses_world_group_untouched, 2)
    assert results[0][0] == results[1][0]
    assert results[0][1]["exchanges"] > 0
