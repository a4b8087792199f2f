"""gradzip inside training frameworks, 2 processes under torchrun: a Lightning Trainer with gradzip's DDP
communication hook, and an HF Accelerate script that registers gradzip on the prepared DDP model and
checkpoints its state with ``accelerator.save_state``/``load_state``.
"""
import inspect

import pytest

from .launch import load_result, torchrun


def run(script, out, *args, **kwargs):
    launch = torchrun(script, "--out", out, *args, log=out / "launch.log", timeout=300, **kwargs)
    assert launch.ok, launch.describe()
    return launch


def check_topk_run(result):
    result.assert_ranks_identical()
    result.assert_learned()
    result.assert_gradzip_exchanged()
    result.assert_compressed()


def lightning_registers_comm_hooks_on_cpu() -> bool:
    from lightning.pytorch.strategies import DDPStrategy

    return 'root_device.type == "cuda"' not in inspect.getsource(DDPStrategy._register_ddp_hooks)


@pytest.mark.parametrize("register", ["strategy", "on_fit_start"])
def test_lightning_trainer_with_gradzip_comm_hook(register, chars, tmp_path):
    pytest.importorskip("lightning")
    if register == "strategy" and not lightning_registers_comm_hooks_on_cpu():
        pytest.skip("Lightning's DDPStrategy registers ddp_comm_hook only when the root device is CUDA "
                    "(DDPStrategy._register_ddp_hooks); on CPU the hook would be ignored (the GPU tier runs it)")
    run("lightning_gpt.py", tmp_path, "--register", register)
    check_topk_run(load_result(tmp_path, "lightning"))


@pytest.fixture(scope="module")
def accelerate_runs(chars, tmp_path_factory):
    """Top-k through Accelerate: an uninterrupted run that saves its state after epoch 0, then a new
    process pair that loads it and trains the last epoch."""
    pytest.importorskip("accelerate")
    folder = tmp_path_factory.mktemp("accelerate")
    (folder / "whole").mkdir()
    (folder / "resumed").mkdir()
    run("accelerate_gpt.py", folder / "whole", "--method", "topk", "--save", folder / "ckpt")
    run("accelerate_gpt.py", folder / "resumed", "--method", "topk", "--resume", folder / "ckpt")
    return load_result(folder / "whole", "accelerate"), load_result(folder / "resumed", "accelerate")


def test_accelerate_with_accumulation(accelerate_runs):
    whole, resumed = accelerate_runs
    check_topk_run(whole)
    resumed.assert_ranks_identical()


def test_accelerate_resumed_state_equals_uninterrupted(accelerate_runs):
    whole, resumed = accelerate_runs
    resumed.assert_same_params(whole)


def test_accelerate_with_a_dynamo_backend(chars, tmp_path):
    """``Accelerator(dynamo_backend=...)``: ``prepare`` returns ``torch.compile`` of the DDP model, which
    ``gradzip.register`` takes as it is (the eager backend: Dynamo's graphs split at DDP's buckets, no
    compiler run)."""
    pytest.importorskip("accelerate")
    (tmp_path / "whole").mkdir()
    run("accelerate_gpt.py", tmp_path / "whole", "--method", "topk", "--dynamo-backend", "eager")
    check_topk_run(load_result(tmp_path / "whole", "accelerate"))
