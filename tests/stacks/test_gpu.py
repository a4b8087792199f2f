"""The GPU tier: the same user scripts on CUDA with NCCL, 2 workers where there are 2 GPUs, and NCCL at
world size 1.  Skipped without CUDA."""
import pytest
import torch
import torch.distributed as dist

from .conftest import GPT_FEATURES, gpt_runs
from .launch import Plan, load_result, torchrun
from .methods import METHODS
from .test_ddp_tutorial import check_tutorial_run, launch_tutorial
from .test_gpt_features import check_gpt_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                                   reason="needs CUDA and NCCL")]


def workers() -> int:
    """2 workers with 2 GPUs or more; NCCL cannot put two ranks on one GPU."""
    return 2 if torch.cuda.device_count() >= 2 else 1


@pytest.mark.parametrize("nproc", [1, 2], ids=["world_size_1", "world_size_2"])
@pytest.mark.parametrize("method", METHODS)
def test_tutorial_script_nccl(method, nproc, tmp_path):
    if nproc > torch.cuda.device_count():
        pytest.skip(f"{nproc} NCCL workers need {nproc} GPUs")
    launch = launch_tutorial(method, tmp_path, "--device", "cuda", nproc=nproc)
    check_tutorial_run(method, tmp_path, launch, nproc=nproc)


@pytest.fixture(scope="module")
def gpt_cuda_plan(chars, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt_cuda")
    return Plan("gpt_ddp.py", gpt_runs(GPT_FEATURES, METHODS), folder, args=("--device", "cuda"), nproc=workers(),
                timeout=480).execute()


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("feature", GPT_FEATURES)
def test_gpt_feature_cuda(gpt_cuda_plan, feature, method):
    check_gpt_run(gpt_cuda_plan.result(f"{feature}/{method}"), method, world_size=workers(), loss_scaled=feature == "fp16")


def test_gpt_cuda_launches_exit_cleanly(gpt_cuda_plan):
    gpt_cuda_plan.assert_exit_codes()


def test_lightning_strategy_comm_hook_on_cuda(chars, tmp_path):
    pytest.importorskip("lightning")
    n = workers()
    launch = torchrun("lightning_gpt.py", "--out", tmp_path, "--register", "strategy", "--device", "cuda",
                      "--devices", n, nproc=n, timeout=300, log=tmp_path / "launch.log")
    assert launch.ok, launch.describe()
    result = load_result(tmp_path, "lightning", nproc=n)
    result.assert_ranks_identical()
    result.assert_learned()
    result.assert_gradzip_exchanged(world_size=n)
    result.assert_compressed()
