"""A user's HF Trainer script: a tiny GPT-2 built from ``GPT2Config`` (nothing downloaded), trained on a
character-level tokenisation of this repository's README by an unmodified ``transformers.Trainer`` on
CPU processes (gloo), with gradzip on Trainer's DDP model through
``gradzip.integrations.transformers.register(trainer, method, **params)``.

    torchrun --nproc-per-node 2 hf_trainer.py --plan PLAN.json --out DIR

Each run of the plan (see scenarios.py) gives ``method``, ``params`` and Trainer's ``output_dir``; with
``resume`` (true, or a checkpoint folder) it calls ``trainer.train(resume_from_checkpoint=resume)``,
``missing_ok`` goes to ``register``.  A run whose ``train()`` raises ``FileNotFoundError`` reports the
message under ``raised``.  Each rank writes its final parameters and a report to DIR/<name>/rank<r>.{pt,json}.
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import gradzip
import scenarios

TEXT = Path(__file__).resolve().parents[3] / "README.md"
SEQ_LEN, SAMPLES = 32, 80  # 80 windows: 5 optimizer steps an epoch at 2 ranks x 4 x 2 micro-batches
MAX_STEPS, SAVE_STEPS = 8, 3  # checkpoints at steps 3 (mid-epoch), 6 and 8


def arguments(output_dir) -> TrainingArguments:
    return TrainingArguments(output_dir=str(output_dir), max_steps=MAX_STEPS, save_steps=SAVE_STEPS,
                             per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=3e-3,
                             logging_steps=1, report_to=[], use_cpu=True, ddp_backend="gloo", seed=0,
                             data_seed=0, dataloader_num_workers=0, disable_tqdm=True)


def dataset():
    text = TEXT.read_text()
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text[: SEQ_LEN * SAMPLES]])
    windows = ids.view(SAMPLES, SEQ_LEN)
    return [{"input_ids": w, "labels": w} for w in windows], len(vocab)


def train(name, method, params, output_dir, resume=None, missing_ok=False, **_):
    train_set, vocab_size = dataset()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab_size, n_positions=SEQ_LEN, n_embd=32, n_layer=2,
                                       n_head=4, bos_token_id=0, eos_token_id=0))
    trainer = Trainer(model=model, args=arguments(output_dir), train_dataset=train_set)
    callback = gradzip.integrations.transformers.register(trainer, method, missing_ok=missing_ok, **params)
    micro_batches = []
    model.register_forward_hook(lambda *_: micro_batches.append(1))
    report = {"raised": None}
    try:
        trainer.train(resume_from_checkpoint=resume)
    except FileNotFoundError as exc:  # the run the test expects to be refused
        report["raised"] = str(exc)
    state = callback.state
    report.update({"global_step": trainer.state.global_step, "micro_batches": len(micro_batches),
                   "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                   "stats": state.stats(), "steps": state.state_dict()["steps"],
                   "buckets": [b["exchanges"] for b in state.bucket_stats()]})
    return model, report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    arguments(args.out).device  # Trainer's arguments join the process group (gloo), as in any Trainer script
    scenarios.run_plan(args.plan, args.out, train)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
