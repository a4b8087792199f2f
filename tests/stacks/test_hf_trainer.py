"""gradzip under an unmodified HF ``transformers.Trainer``, 2 processes under torchrun (gloo, CPU):
``gradzip.integrations.transformers.register(trainer, method, ...)`` on a tiny GPT-2 with gradient
accumulation 2 (scripts/hf_trainer.py).

One launch trains Top-k (residual feedback) and PowerSGD for 8 optimizer steps, checkpointing at steps
3, 6 and 8.  The test then copies checkpoint-3, and a second launch (new processes) resumes from it:
Top-k with ``resume_from_checkpoint=True`` (the copy is the only checkpoint in its output_dir), PowerSGD
with the copy's path.  Controls: the copy without gradzip's files must be refused, and accepted with
``missing_ok=True`` it must give other final parameters than the uninterrupted run.
"""
import shutil

import pytest
import torch

from .launch import Plan
from .methods import params

pytest.importorskip("transformers")

METHODS = {"topk": {"ratio": 0.01}, "powersgd": params("powersgd")}
STEPS, MICRO_BATCHES, CHECKPOINTS, RESUMED_AT = 8, 16, (3, 6, 8), 3


def whole_run(folder, method):
    return {"name": f"whole/{method}", "method": method, "params": METHODS[method],
            "output_dir": str(folder / f"out_{method}"), "deadline": 120}


def copy_checkpoint(source, target, with_gradzip=True):
    ignore = None if with_gradzip else shutil.ignore_patterns("gradzip_rank*")
    shutil.copytree(source, target, ignore=ignore)
    return str(target)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_trainer")
    whole = Plan("hf_trainer.py", [whole_run(folder, m) for m in METHODS], folder / "whole").execute()
    step3 = {m: folder / f"out_{m}" / f"checkpoint-{RESUMED_AT}" for m in METHODS}
    for m in METHODS:
        assert step3[m].is_dir(), f"whole/{m} wrote no checkpoint-{RESUMED_AT}:\n{whole.launches[-1].describe()}"
    copy_checkpoint(step3["topk"], folder / "resumed_topk" / f"checkpoint-{RESUMED_AT}")
    elsewhere = copy_checkpoint(step3["powersgd"], folder / "elsewhere" / "powersgd-step3")
    stripped = copy_checkpoint(step3["topk"], folder / "stripped" / f"checkpoint-{RESUMED_AT}", with_gradzip=False)
    runs = [{"name": "resumed/topk", "method": "topk", "params": METHODS["topk"], "resume": True,
             "output_dir": str(folder / "resumed_topk")},
            {"name": "resumed/powersgd", "method": "powersgd", "params": METHODS["powersgd"], "resume": elsewhere,
             "output_dir": str(folder / "resumed_powersgd")},
            {"name": "missing/topk", "method": "topk", "params": METHODS["topk"], "resume": stripped,
             "output_dir": str(folder / "missing")},
            {"name": "missing_ok/topk", "method": "topk", "params": METHODS["topk"], "resume": stripped,
             "missing_ok": True, "output_dir": str(folder / "missing_ok")}]
    resumed = Plan("hf_trainer.py", [{**run, "deadline": 120} for run in runs], folder / "resumed").execute()
    return folder, whole, resumed


@pytest.mark.parametrize("method", METHODS)
def test_trainer_compresses_once_per_optimizer_step(plans, method):
    _, whole, _ = plans
    whole.assert_exit_codes()
    result = whole.result(f"whole/{method}")
    result.assert_ranks_identical()
    result.assert_gradzip_exchanged()
    result.assert_compressed()
    for rank, report in enumerate(result.reports):
        assert (report["global_step"], report["micro_batches"]) == (STEPS, MICRO_BATCHES), report
        # Accumulation 2: DDP's hook runs on the second micro-batch only, once per bucket (one here).
        assert report["buckets"] == [STEPS] and report["stats"]["exchanges"] == STEPS, (rank, report["buckets"])
        assert set(report["steps"].values()) == {STEPS}, (rank, report["steps"])


@pytest.mark.parametrize("method", METHODS)
def test_every_checkpoint_holds_each_ranks_gradzip_state(plans, method):
    folder, _, _ = plans
    for step in CHECKPOINTS:
        checkpoint = folder / f"out_{method}" / f"checkpoint-{step}"
        assert sorted(p.name for p in checkpoint.glob("gradzip_rank*")) == ["gradzip_rank0.pt", "gradzip_rank1.pt"]
        for rank in range(2):
            saved = torch.load(checkpoint / f"gradzip_rank{rank}.pt", weights_only=True)
            assert (saved["rank"], saved["compressor"], set(saved["steps"].values())) == (rank, method, {step})
            assert saved["totals"]["exchanges"] == step


@pytest.mark.parametrize("method", METHODS)
def test_resumed_trainer_equals_uninterrupted_bit_for_bit(plans, method):
    _, whole, resumed = plans
    resumed.assert_exit_codes()
    result = resumed.result(f"resumed/{method}")
    result.assert_ranks_identical()
    result.assert_same_params(whole.result(f"whole/{method}"))
    for report in result.reports:  # the counters went on from the checkpoint's
        assert report["stats"]["exchanges"] == STEPS and set(report["steps"].values()) == {STEPS}
        assert report["micro_batches"] == MICRO_BATCHES - 2 * RESUMED_AT


def test_resume_without_gradzip_state_is_refused(plans):
    folder, _, resumed = plans
    result = resumed.result("missing/topk")
    for report in result.reports:
        assert report["raised"] == (
            f"resuming from {folder / 'stripped' / 'checkpoint-3'}, which holds no gradzip state for rank(s) "
            "[0, 1] (gradzip_rank<r>.pt: saved without gradzip, or not copied); a fresh state would not continue "
            "the checkpointed run, so gradzip stops here (register(trainer, ..., missing_ok=True) goes on without it)")
        assert report["micro_batches"] == 0 and report["stats"]["exchanges"] == 0


def test_resume_with_missing_ok_starts_fresh_and_differs(plans):
    _, whole, resumed = plans
    result = resumed.result("missing_ok/topk")
    result.assert_ranks_identical()
    for report in result.reports:
        assert report["raised"] is None and report["global_step"] == STEPS
        assert set(report["steps"].values()) == {STEPS - RESUMED_AT}  # counted from zero: a fresh state
    with pytest.raises(AssertionError, match="elements differ"):  # gradzip's state is what made them equal
        result.assert_same_params(whole.result("whole/topk"))


def one_process_trainer(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    model = GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": torch.zeros(4, dtype=torch.long)}] * 2)


def test_trainer_without_ddp_and_a_second_register_are_one_line_errors(tmp_path):
    import gradzip

    trainer = one_process_trainer(tmp_path)
    callback = gradzip.integrations.transformers.register(trainer, "topk", ratio=0.01)
    with pytest.raises(ValueError, match="one register"):
        gradzip.integrations.transformers.register(trainer, "topk")
    with pytest.raises(ValueError, match="needs the model Trainer wraps in DistributedDataParallel, but "
                                         "trainer.model_wrapped is a GPT2LMHeadModel") as err:
        trainer.train()
    assert "\n" not in str(err.value) and callback.state is None
    assert trainer.state.global_step == 0
