"""A user's training script: a small character-level GPT trained with DDP and gradzip.

    torchrun --nproc-per-node 2 gpt_ddp.py --plan plan.json --out DIR [--device cuda]

Each run of the plan trains a fresh model, DDP wrapper and gradzip state with gradzip ``method`` and
``params``, and one ``feature`` of typical training scripts on top of the plain loop (AdamW; SGD for
a method that applies momentum itself, DGC, as gradzip asks):

    plain        the loop as it is
    bf16         torch.autocast(dtype=torch.bfloat16)
    fp16         fp16 autocast and torch.amp.GradScaler
    accumulate   two micro-batches per step, the first under ddp_model.no_sync()
    compile      torch.compile(ddp_model)
    unused       an auxiliary head that forward never uses; DDP(find_unused_parameters=True)
    frozen       the position embedding frozen (requires_grad=False)
    static       DDP(static_graph=True)
    bucket_view  DDP(gradient_as_bucket_view=True)
    join         uneven inputs: rank r gets r more batches per epoch, under Join
    fused        the plain loop, with gradzip's fused kernels on every tensor of at least 1024 elements
                 (their defaults are 2^20 and 2^24, far above this model's tensors)
    unfused      the plain loop, with the fused kernels off (GRADZIP_FUSED=0)
    ahead        the plain loop on the bucket route, its kernels compiled ahead (in a child process, the
                 first exchange of each waiting for it) on every bucket
    eager        the plain loop on the bucket route, with the fused kernels off
    checkpoint   the plain loop; after epoch 0 it saves model, optimizer and gradzip state to
                 ``save``/rank<r>.pt; given ``resume`` instead, it loads them and trains epoch 1 only
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
import scenarios
from chargpt import EPOCHS, WIDTH, data, evaluate, loss_of, new_model, restore, save_checkpoint, sharded_loader


class WithAuxHead(nn.Module):
    """The GPT plus an auxiliary head that this phase of training does not use."""

    def __init__(self, gpt, width, vocab):
        super().__init__()
        self.gpt, self.aux_head = gpt, nn.Linear(width, vocab)

    def forward(self, x):
        return self.gpt(x)


def train(method, params, feature, device, save=None, resume=None, **_):
    if feature in ("fused", "unfused"):
        with scenarios.kernels_from(1024, on=feature == "fused") as launches:
            model, report = train(method, params, "plain", device)
        return model, {**report, "kernel_launches": launches}
    if feature in ("ahead", "eager"):
        params = {**params, "bucketed": True}
        if feature == "eager":
            with scenarios.kernels_from(1, on=False):
                return train(method, params, "plain", device)
        with scenarios.kernels_ahead() as runs:
            model, report = train(method, params, "plain", device)
        return model, {**report, "ahead_runs": runs}
    rank = dist.get_rank()
    train_set, held_out, info = data(dist.get_world_size(), device)
    model = new_model(info)
    if feature == "unused":
        model = WithAuxHead(model, WIDTH, info.num_classes)
    if feature == "frozen":
        model.pos.weight.requires_grad_(False)
    checkpoint = torch.load(f"{resume}/rank{rank}.pt", weights_only=True) if resume else None
    if checkpoint:
        restore(checkpoint, model=model)
    model.to(device)

    options = {"unused": {"find_unused_parameters": True}, "static": {"static_graph": True},
               "bucket_view": {"gradient_as_bucket_view": True}}.get(feature, {})
    if feature != "compile":  # several buckets even for this small model (compile wants the default ones)
        options["bucket_cap_mb"] = 0.02
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **options)
    state = gradzip.register(ddp_model, method, **params)
    net = torch.compile(ddp_model) if feature == "compile" else ddp_model

    trainable = [p for p in ddp_model.parameters() if p.requires_grad]
    if gradzip.make(method).applies_momentum:  # DGC applies the momentum itself
        opt = torch.optim.SGD(trainable, lr=0.2)
    else:
        opt = torch.optim.AdamW(trainable, lr=3e-3)
    scaler = torch.amp.GradScaler(device.type, enabled=feature == "fp16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(feature)
    first_epoch = restore(checkpoint, optimizer=opt, gradzip=state) if checkpoint else 0

    sampler, loader = sharded_loader(train_set)
    losses, eval_before = [], evaluate(model, held_out)
    for epoch in range(first_epoch, EPOCHS):
        sampler.set_epoch(epoch)
        state.set_epoch(epoch)
        batches = list(loader)
        if feature == "join":
            batches += batches[:rank]
        with Join([ddp_model]) if feature == "join" else contextlib.nullcontext():
            for x, y in batches:
                x, y = x.to(device), y.to(device)
                opt.zero_grad()
                if feature == "accumulate":
                    (x0, x1), (y0, y1) = x.chunk(2), y.chunk(2)
                    with ddp_model.no_sync():
                        (loss_of(net, x0, y0) / 2).backward()
                    loss = loss_of(net, x1, y1) / 2
                    loss.backward()
                else:
                    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                        loss = loss_of(net, x, y)
                    scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                losses.append(loss.item())
        if save and epoch == 0:
            save_checkpoint(f"{save}/rank{rank}.pt", epoch, model=model, optimizer=opt, gradzip=state)
    return model, {"losses": losses, "eval_before": eval_before, "eval_after": evaluate(model, held_out),
                   "stats": state.stats(), "exchanged": sorted(state.steps)}


def main():
    scenarios.main(__doc__, train)


if __name__ == "__main__":
    main()
