"""A nanoGPT-style user script: rank 0 alone writes one checkpoint file, and only when its own
validation loss improved (the other ranks never learn whether it saved).

    torchrun --nproc-per-node N rank0_checkpoint.py --out DIR --methods topk,powersgd --steps 12
        [--save-at 6] [--resume DIR]

At every evaluation (every ``EVAL_EVERY`` steps, a schedule every rank knows) every rank calls
``state.state_dict(all_ranks=True)``, a collective; rank 0 puts the result into its checkpoint when it
decides to save.  ``--save-at S`` ends the run after step S (its checkpoint is the last one written);
``--resume DIR`` loads DIR's checkpoint on every rank, on whatever number of ranks this launch has,
and trains on to ``--steps``.  Each rank writes ``<method>.rank<r>.json``: its final parameters, its
losses, and the error feedback owed, as saved and as resumed (the mean over ranks of each residual).
"""
import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip
from chargpt import SEQ_LEN, loss_of, new_model
from gradzip.harness.data import load_dataset

EVAL_EVERY, BATCH = 2, 8
PARAMS = {"topk": {"ratio": 0.05}, "powersgd": {"rank": 2, "dense_steps": 2}}


def batch_of(dataset, rank: int, step: int):
    """Rank ``rank``'s batch at ``step``: the same windows whatever the number of ranks."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    idx = torch.randint(0, len(dataset) - 64, (BATCH,), generator=g)
    xs, ys = zip(*(dataset[int(i)] for i in idx))
    return torch.stack(xs), torch.stack(ys)


def owed(state_tensors: list) -> dict:
    """The mean over ranks of each error-feedback tensor, from every rank's saved ``tensors``."""
    mean = {}
    for key, slot in state_tensors[0].items():
        for name in slot:
            values = [t[key][name].double() for t in state_tensors]
            mean[f"{key}/{name}"] = (sum(values) / len(values)).flatten().tolist()
    return mean


def owed_now(state) -> dict:
    """The mean over the running ranks of this state's error-feedback tensors (an allreduce)."""
    mean = {}
    for key in sorted(state.tensors):
        for name, value in sorted(state.tensors[key].items()):
            total = value.double().clone()
            dist.all_reduce(total)
            mean[f"{key}/{name}"] = (total / dist.get_world_size()).flatten().tolist()
    return mean


def train(method, args, dataset, info, rank):
    ckpt_path = os.path.join(args.out, f"{method}.ckpt.pt")
    model = new_model(info)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    start, resumed = 0, None
    if args.resume:
        checkpoint = torch.load(os.path.join(args.resume, f"{method}.ckpt.pt"), weights_only=True)
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["optimizer"])
        start = checkpoint["step"]
    ddp = DDP(model)
    resume = os.path.join(args.resume, f"{method}.ckpt.pt") if args.resume else None
    state = gradzip.register(ddp, method, resume=resume, **PARAMS[method])
    if resume:
        resumed = owed_now(state)
    best, losses, saved = float("inf"), [], None
    for step in range(start, args.steps):
        x, y = batch_of(dataset, rank, step)
        opt.zero_grad()
        loss = loss_of(ddp, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if (step + 1) % EVAL_EVERY == 0:
            gz = state.state_dict(all_ranks=True)  # every rank: a collective
            if rank == 0:
                with torch.no_grad():
                    val = loss_of(model, *batch_of(dataset, 999, step)).item()  # rank 0's own decision
                if val < best or saved is None:
                    best = val
                    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "gradzip": gz,
                                "step": step + 1}, ckpt_path)
                    saved = owed([part["tensors"] for part in gz["all_ranks"]])
        if args.save_at and step + 1 == args.save_at:
            break
    stats = state.stats()
    state.close()
    report = {"rank": rank, "world_size": dist.get_world_size(), "losses": losses, "exchanges": stats["exchanges"],
              "params": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
              "owed_saved": saved, "owed_resumed": resumed}
    with open(os.path.join(args.out, f"{method}.rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default="topk,powersgd")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.makedirs(args.out, exist_ok=True)
    dataset, info = load_dataset("chars", seq_len=SEQ_LEN)
    for method in args.methods.split(","):
        train(method, args, dataset, info, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
