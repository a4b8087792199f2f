"""The sign methods train at plain SGD's learning rate (a user's report: Signum ended at chance).

Digits (scikit-learn, 8x8) with the harness MLP, plain SGD at lr 0.05 without momentum, 2 workers as
threads, 300 steps of 32 samples per worker.  Measured (test accuracy): dense 0.900, signsgd 0.900,
signum 0.889, efsignsgd 0.906, onebit 0.906; the paper's Signum (scaled=False, zeros="plus") 0.097.
"""
from __future__ import annotations

import functools
import threading

import pytest
import torch
from torch import nn

from gradzip import GradzipState
from gradzip.harness.data import load_dataset
from gradzip.harness.models import build_model
from tests.workers import run_threads

pytest.importorskip("sklearn")

LR, STEPS, BATCH, WORLD = 0.05, 300, 32, 2
_INIT = threading.Lock()  # the workers share the global RNG that seeds the initial weights


@functools.lru_cache(maxsize=1)
def _digits():
    train, info = load_dataset("digits")
    test, _ = load_dataset("digits", train=False)
    return train.tensors, test.tensors, info


def digits_accuracy(name: str, lr: float = LR, **params) -> float:
    """Train the digits MLP with ``name`` at ``lr`` on WORLD simulated workers; returns the test accuracy."""
    (x, y), (x_test, y_test), info = _digits()

    def worker(rank, transport):
        torch.set_num_threads(1)
        with _INIT:
            torch.manual_seed(0)
            model = build_model("mlp", info)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        state = GradzipState(name, transport=transport, **params)
        shard = torch.arange(rank, len(x), WORLD)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(STEPS):
            batch = shard[torch.randint(len(shard), (BATCH,), generator=gen)]
            model.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            named = [(key, p.grad) for key, p in model.named_parameters()]
            for p, aggregate in zip(model.parameters(), state.exchange(named)):
                p.grad = aggregate
            opt.step()
        with torch.no_grad():
            return torch.cat([p.reshape(-1) for p in model.parameters()]), (model(x_test).argmax(1) == y_test)

    results = run_threads(WORLD, worker, timeout=120)
    assert all(torch.equal(results[0][0], r[0]) for r in results[1:])  # every rank holds the same model
    return results[0][1].float().mean().item()


def test_every_sign_method_trains_at_plain_sgd_learning_rate():
    accuracy = {name: digits_accuracy(name) for name in ("none", "signsgd", "signum", "efsignsgd", "onebit")}
    assert accuracy["none"] >= 0.85, accuracy
    assert all(a >= 0.75 for a in accuracy.values()), accuracy


def test_the_papers_unscaled_signum_does_not_train_at_that_learning_rate():
    # The unscaled update moves every coordinate by lr = 0.05 per step: far too far for this MLP.
    assert digits_accuracy("signum", scaled=False, zeros="plus") < 0.3


# The learning-rate table of docs/methods.md: python3 -m tests.test_sign_training
SWEEP_LRS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 5e-2, 0.1, 0.3)
SWEEP = {"dense (`none`)": ("none", {}), "`signsgd` (scaled)": ("signsgd", {}), "`signum` (scaled)": ("signum", {}),
         "`efsignsgd`": ("efsignsgd", {}), "`onebit`": ("onebit", {}),
         "`signsgd`, `scaled=False`": ("signsgd", {"scaled": False}),
         "`signum`, `scaled=False`": ("signum", {"scaled": False}),
         "`signum`, `scaled=False, zeros=\"plus\"` (paper)": ("signum", {"scaled": False, "zeros": "plus"})}

if __name__ == "__main__":
    print("| lr | " + " | ".join(f"{lr:g}" for lr in SWEEP_LRS) + " |")
    for label, (name, params) in SWEEP.items():
        print(f"| {label} | " + " | ".join(f"{digits_accuracy(name, lr, **params):.2f}" for lr in SWEEP_LRS) + " |")
