"""A user's Lightning script: the character-level GPT as a LightningModule, trained by a Trainer with
DDPStrategy on 2 processes and gradzip's DDP communication hook (Top-k 1%).

    torchrun --nproc-per-node 2 lightning_gpt.py --out DIR [--register strategy|on_fit_start]
                                                 [--device cuda --devices N]

``--register strategy`` hands the hook to Lightning:
``DDPStrategy(ddp_comm_state=gradzip.GradzipState("topk", ratio=0.01), ddp_comm_hook=gradzip.ddp_comm_hook)``.
``--register on_fit_start`` passes a plain DDPStrategy and registers the same hook on the DDP model in
the LightningModule's ``on_fit_start`` (Lightning 2.6 registers DDPStrategy's hook on CUDA only).
Lightning finds the ranks in torchrun's environment.  Each rank writes its final parameters, losses and
gradzip's stats to DIR/lightning/rank<r>.{pt,json}.
"""
import argparse

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader

import gradzip
import scenarios
from chargpt import BATCH, EPOCHS, data, evaluate, loss_of, new_model


class CharGPT(L.LightningModule):
    def __init__(self, info, comm_state=None):
        super().__init__()
        self.model = new_model(info)
        self.comm_state = comm_state  # to register in on_fit_start
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = loss_of(self.model, *batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)

    def on_fit_start(self):
        if self.comm_state is not None:
            self.trainer.strategy.model.register_comm_hook(self.comm_state, gradzip.ddp_comm_hook)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--register", choices=("strategy", "on_fit_start"), default="strategy")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()

    comm_state = gradzip.GradzipState("topk", ratio=0.01)
    if args.register == "strategy":
        strategy = DDPStrategy(ddp_comm_state=comm_state, ddp_comm_hook=gradzip.ddp_comm_hook)
        module_state = None
    else:
        strategy, module_state = DDPStrategy(), comm_state
    train_set, held_out, info = data(args.devices, "cpu")
    module = CharGPT(info, module_state)
    eval_before = evaluate(module.model, held_out)
    trainer = L.Trainer(accelerator="gpu" if args.device == "cuda" else "cpu", devices=args.devices, num_nodes=1,
                        strategy=strategy, max_epochs=EPOCHS, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(train_set, batch_size=BATCH, shuffle=True))
    scenarios.write_result(f"{args.out}/lightning", trainer.global_rank, module.model, {
        "losses": module.losses, "eval_before": eval_before,
        "eval_after": evaluate(module.model.cpu(), held_out), "stats": comm_state.stats()})


if __name__ == "__main__":
    main()
