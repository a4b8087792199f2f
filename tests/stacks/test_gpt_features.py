"""A character-level GPT trained by a user script with DDP + gradzip and one training-script feature
per run (AdamW, bf16/fp16 autocast, GradScaler, no_sync accumulation, torch.compile, unused and frozen
parameters, static graph, bucket views, uneven inputs under Join): every method in every feature
(GRADZIP_SLOW=1; the default run: every method plain, one of each way of exchanging in the others).

Each run must complete, end with bit-identical parameters on both ranks, lower the held-out loss, and
go through gradzip (its stats count exchanges over 2 workers; compressing methods send fewer bytes).
"""
import pytest

from .conftest import GPT_FEATURES, GROUPED
from .methods import EACH_WAY, METHODS, compresses


@pytest.mark.parametrize("feature, method", [
    pytest.param(feature, method, id=f"{feature}-{method}",
                 marks=() if feature == GPT_FEATURES[0] or method in EACH_WAY else pytest.mark.slow)
    for feature in GPT_FEATURES for method in METHODS])
def test_feature(gpt_plan, feature, method):
    check_gpt_run(gpt_plan.result(f"{feature}/{method}"), method, loss_scaled=feature == "fp16")


@pytest.mark.parametrize("method", GROUPED)
def test_vectors_grouped(gpt_plan, method):
    """``group_vectors_below``: the biases and LayerNorm weights of each DDP bucket go as one tensor."""
    result = gpt_plan.result(f"grouped/{method}")
    check_gpt_run(result, method)
    for rep, params in zip(result.reports, result.params):
        groups = [key for key in rep["exchanged"] if key.startswith("vectors[")]
        assert groups and len(rep["exchanged"]) < len(params), rep["exchanged"]


def check_gpt_run(result, method, world_size=2, loss_scaled=False):
    result.assert_ranks_identical()
    result.assert_learned()
    result.assert_gradzip_exchanged(world_size)
    if compresses(method, loss_scaled):
        result.assert_compressed()


def test_launches_exit_cleanly(gpt_plan):
    gpt_plan.assert_exit_codes()
