"""The PyTorch DDP tutorial's basic example (torchrun version), plus gradzip's line.

    torchrun --nproc-per-node 2 ddp_tutorial.py --method powersgd --param rank=2 --out DIR

ToyModel, SGD, a few steps on random data, ``dist.destroy_process_group()``, return: nothing else
(``--compile``: the DDP model is ``torch.compile``d, before or after ``gradzip.register``).
For the test, each rank saves its initial and final parameters, losses and gradzip's stats to
DIR/rank<r>.pt before tearing down.
"""
import argparse
import ast

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(args):
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    print(f"Start running basic DDP example on rank {rank}.")
    device = torch.device("cuda", rank % torch.cuda.device_count()) if args.device == "cuda" else torch.device("cpu")

    # create model and move it to the device
    model = ToyModel().to(device)
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile == "before-register":
        ddp_model = torch.compile(ddp_model)
    state = gradzip.register(ddp_model, args.method, **args.params)
    if args.compile == "after-register":
        ddp_model = torch.compile(ddp_model)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    losses = []
    for _ in range(args.steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, device=device))
        labels = torch.randn(20, 5, device=device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    final = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch.save({"initial": initial, "final": final, "losses": losses, "stats": state.stats()},
               f"{args.out}/rank{rank}.pt")
    dist.destroy_process_group()
    print(f"Finished running basic DDP example on rank {rank}.")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="none")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", choices=["no", "before-register", "after-register"], default="no",
                        help="torch.compile the DDP model, before or after gradzip.register")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.params = {k: ast.literal_eval(v) for k, v in (p.split("=", 1) for p in args.param)}
    return args


if __name__ == "__main__":
    demo_basic(parse_args())
