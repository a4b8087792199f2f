"""Checkpoint and resume in a new process pair: the GPT script saves model, optimizer and gradzip state
(``state.state_dict()``) with ``torch.save`` after its first epoch and trains on; a second torchrun launch
loads them with ``torch.load(..., weights_only=True)`` and trains the last epoch.  The resumed run's
final parameters must equal the uninterrupted run's bit for bit for every deterministic method
(``gradzip.make(name).deterministic``); every method's resumed run must complete.
"""
import pytest

from .methods import METHODS, deterministic


@pytest.mark.parametrize("method", METHODS)
def test_resumed_run_completes(gpt_plan, resume_plan, method):
    gpt_plan.result(f"checkpoint/{method}").assert_ranks_identical()
    resumed = resume_plan.result(f"resumed/{method}")
    resumed.assert_ranks_identical()
    resumed.assert_gradzip_exchanged()
    assert all(rep["losses"] for rep in resumed.reports), "the resumed run trained no step"


@pytest.mark.parametrize("method", [m for m in METHODS if deterministic(m)])
def test_resumed_run_equals_uninterrupted(gpt_plan, resume_plan, method):
    uninterrupted = gpt_plan.result(f"checkpoint/{method}")
    resumed = resume_plan.result(f"resumed/{method}")
    resumed.assert_same_params(uninterrupted)


def test_launches_exit_cleanly(resume_plan):
    resume_plan.assert_exit_codes()
