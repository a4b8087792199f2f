"""Convergence through the DDP hook on a real dataset (scikit-learn's digits), 2 gloo ranks."""
from __future__ import annotations

import pytest

from tests import workers
from tests.distributed import run_workers

EPOCHS = 20


@pytest.fixture(scope="module")
def dense_accuracy():
    results = run_workers(workers.train_digits, 2, "none", {}, EPOCHS, 0.9)
    assert results[0][0] == results[1][0]
    assert results[0][0] > 0.93, "the dense baseline itself did not learn"
    return results[0][0]


@pytest.mark.parametrize(
    "name,params,optimizer_momentum",
    [
        # DGC applies momentum itself (momentum correction), so the optimizer runs without.
        ("dgc", {"ratio": 0.01, "momentum": 0.9}, 0.0),
        ("powersgd", {"rank": 2}, 0.9),
    ],
)
def test_compressed_training_reaches_dense_accuracy(dense_accuracy, name, params, optimizer_momentum):
    results = run_workers(workers.train_digits, 2, name, params, EPOCHS, optimizer_momentum)
    accuracy, stats = results[0]
    assert results[1][0] == accuracy
    assert stats["ratio"] > 2.0, f"{name} barely compressed: ratio {stats['ratio']:.2f}"
    assert accuracy >= dense_accuracy - 0.01, f"{name}: {accuracy:.4f} vs dense {dense_accuracy:.4f}"
