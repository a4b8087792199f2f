"""A user's Accelerate script: the character-level GPT trained with HF Accelerate on 2 processes, gradzip
registered on the DDP model that ``accelerator.prepare`` returns, gradient accumulation under
``accelerator.accumulate`` and checkpoints by ``accelerator.save_state``/``load_state``, which carry
gradzip's state (``gradzip.integrations.accelerate.checkpoint(accelerator, state)``: one file per rank).

    torchrun --nproc-per-node 2 accelerate_gpt.py --out DIR --method topk [--save CKPT | --resume CKPT]
        [--dynamo-backend eager|inductor]

With ``--save`` it saves the state after epoch 0 and trains on; with ``--resume`` it loads that state
and trains epoch 1 only.  Each rank writes its final parameters, losses and gradzip's stats to
DIR/accelerate/rank<r>.{pt,json}.
"""
import argparse
import ast

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

import gradzip
import scenarios
from chargpt import BATCH, EPOCHS, data, evaluate, loss_of, new_model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--method", default="topk")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dynamo-backend", default="no",
                        help="Accelerate's dynamo_backend: prepare then returns torch.compile of the DDP model")
    args = parser.parse_args()
    params = {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in args.param)}

    accelerator = Accelerator(cpu=args.device == "cpu", gradient_accumulation_steps=2,
                              dynamo_backend=args.dynamo_backend)
    train_set, held_out, info = data(accelerator.num_processes, accelerator.device)
    model = new_model(info)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(train_set, batch_size=BATCH // 2)  # two micro-batches per optimizer step
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = gradzip.register(model, args.method, **params)
    gradzip.integrations.accelerate.checkpoint(accelerator, state)  # each rank's own residuals

    first_epoch = 0
    if args.resume:
        accelerator.load_state(args.resume)
        first_epoch = 1
    losses, eval_before = [], evaluate(model, held_out)
    for epoch in range(first_epoch, EPOCHS):
        state.set_epoch(epoch)
        for x, y in loader:
            with accelerator.accumulate(model):
                loss = loss_of(model, x, y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
            losses.append(loss.item())
        if args.save and epoch == 0:
            accelerator.save_state(args.save)
    scenarios.write_result(f"{args.out}/accelerate", accelerator.process_index, accelerator.unwrap_model(model), {
        "losses": losses, "eval_before": eval_before, "eval_after": evaluate(model, held_out),
        "stats": state.stats()})
    accelerator.end_training()


if __name__ == "__main__":
    main()
