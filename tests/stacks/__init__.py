"""Conformance tier: users' training scripts run for real, 2 workers under torchrun (gloo).

``scripts/`` holds the scripts, written as a user would (plain PyTorch, Lightning or Accelerate plus
gradzip's lines); ``chargpt.py`` is their shared model/data module and ``scenarios.py`` the test
plumbing that lets one launch train many runs.  The tests launch them with
``python -m torch.distributed.run`` (``launch.py``) and check exit codes, bit-identical parameters
across ranks, falling loss, and resumed == uninterrupted:

    test_ddp_tutorial.py           the DDP tutorial script, one launch per kind of method (slow: each, 50 times)
    test_gpt_features.py           GPT script: every method x AdamW, bf16, fp16 + GradScaler, no_sync
                                   accumulation, torch.compile, unused/frozen parameters, static graph,
                                   gradient_as_bucket_view, uneven inputs under Join
    test_resume.py                 checkpoint, then resume in a new process pair
    test_frameworks.py             Lightning Trainer (DDPStrategy + gradzip.ddp_comm_hook), Accelerate
    test_distributed_optimizer.py  gradzip.DistributedOptimizer with StepLR, GradScaler, state_dict
    test_gpu.py                    the same scripts on CUDA with NCCL (skipped without CUDA)

``python3 -m pytest -q tests/stacks`` takes 2.5 to 8 minutes on 2 cores, depending on the machine (plus up
to a minute the first time, while torch.compile fills its cache); ``GRADZIP_SLOW=1`` adds the tutorial's
launch for every method and the 50-launch abort count.
"""
