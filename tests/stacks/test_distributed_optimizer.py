"""gradzip.DistributedOptimizer (Horovod style, no DDP) in a user script with StepLR, fp16 autocast and
GradScaler (unscale_, clip_grad_norm_, step, update), zero_grad(set_to_none=True/False) and a
checkpoint of optimizer (gradzip's state included), scaler and scheduler resumed with fresh objects.
"""
import pytest

from .methods import METHODS, compresses, deterministic


@pytest.mark.parametrize("method", METHODS)
def test_trains_identically_on_both_ranks(optimizer_plan, method):
    result = optimizer_plan.result(f"checkpoint/{method}")
    result.assert_ranks_identical()
    result.assert_learned()
    result.assert_gradzip_exchanged()
    scales = [rep["scale"] for rep in result.reports]
    assert scales[0] == scales[1], f"GradScaler's scale differs between ranks: {scales}"
    if compresses(method, loss_scaled=True):  # the script trains under GradScaler
        result.assert_compressed()


@pytest.mark.parametrize("method", METHODS)
def test_zero_grad_keeping_the_tensors(optimizer_plan, method):
    result = optimizer_plan.result(f"keep_grads/{method}")
    result.assert_ranks_identical()
    result.assert_learned()
    if deterministic(method):  # zeroed gradients instead of None: the very same training
        result.assert_same_params(optimizer_plan.result(f"checkpoint/{method}"))


@pytest.mark.parametrize("method", METHODS)
def test_resumed_from_state_dict(optimizer_plan, method):
    resumed = optimizer_plan.result(f"resumed/{method}")
    resumed.assert_ranks_identical()
    assert all(rep["losses"] for rep in resumed.reports), "the resumed run trained no step"
    if deterministic(method):
        resumed.assert_same_params(optimizer_plan.result(f"checkpoint/{method}"))


def test_launches_exit_cleanly(optimizer_plan):
    optimizer_plan.assert_exit_codes()
