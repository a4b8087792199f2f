"""A user's Horovod-style script: no DDP; gradzip.DistributedOptimizer averages the gradients.

    torchrun --nproc-per-node 2 horovod_style.py --plan plan.json --out DIR [--device cuda]

Each run of the plan trains a fresh character-level GPT with gradzip ``method`` and ``params``: SGD with
momentum (without, for DGC, which applies momentum itself) wrapped in gradzip.DistributedOptimizer, a
StepLR schedule, fp16 autocast with torch.amp.GradScaler (unscale_, gradient clipping, step, update) and
``zero_grad(set_to_none=set_to_none)``.  With ``save`` it writes model, optimizer (gradzip's state
included), scaler and scheduler to ``save``/rank<r>.pt after epoch 0; with ``resume`` it loads them
(``torch.load(..., weights_only=True)``) and trains epoch 1 only.
"""
import torch
import torch.distributed as dist

import gradzip
import scenarios
from chargpt import EPOCHS, data, evaluate, loss_of, new_model, restore, save_checkpoint, sharded_loader


def train(method, params, device, set_to_none=True, save=None, resume=None, **_):
    rank = dist.get_rank()
    train_set, held_out, info = data(dist.get_world_size(), device)
    model = new_model(info)  # the same initial weights on every rank: nothing broadcasts them
    checkpoint = torch.load(f"{resume}/rank{rank}.pt", weights_only=True) if resume else None
    if checkpoint:
        restore(checkpoint, model=model)
    model.to(device)
    momentum = 0.0 if gradzip.make(method).applies_momentum else 0.9
    opt = gradzip.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.3, momentum=momentum),
                                       model.named_parameters(), method, **params)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    scaler = torch.amp.GradScaler(device.type)
    first_epoch = restore(checkpoint, optimizer=opt, scheduler=sched, scaler=scaler) if checkpoint else 0

    sampler, loader = sharded_loader(train_set)
    losses, eval_before = [], evaluate(model, held_out)
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        opt.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=set_to_none)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = loss_of(model, x, y)
            scaler.scale(loss).backward()  # p.grad: the average over the workers
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            losses.append(loss.item())
        if save and epoch == 0:
            save_checkpoint(f"{save}/rank{rank}.pt", epoch, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    return model, {"losses": losses, "eval_before": eval_before, "eval_after": evaluate(model, held_out),
                   "stats": opt.stats(), "scale": scaler.get_scale(), "lr": sched.get_last_lr()}


def main():
    scenarios.main(__doc__, train)


if __name__ == "__main__":
    main()
