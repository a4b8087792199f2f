"""The user's model and data module, shared by the scripts here: a small character-level GPT on the
harness's ``chars`` dataset (``gradzip.harness``), sized to train in a few CPU seconds."""
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from gradzip.harness.data import load_dataset
from gradzip.harness.models import build_model

SEQ_LEN, WIDTH, BATCH, EPOCHS, STEPS_PER_EPOCH = 32, 32, 8, 2, 3


def data(world_size: int, device, batch: int = BATCH):
    """``(train_set, held_out, info)``: STEPS_PER_EPOCH batches of ``batch`` per worker and epoch, and a
    held-out batch (x, y) on ``device`` to evaluate on."""
    dataset, info = load_dataset("chars", seq_len=SEQ_LEN)
    train_set = Subset(dataset, range(batch * world_size * STEPS_PER_EPOCH))
    held_out = tuple(t.to(device) for t in dataset[len(dataset) - 32:])
    return train_set, held_out, info


def sharded_loader(train_set, batch: int = BATCH):
    """``(sampler, loader)``: this worker's shuffled share of ``train_set`` (``sampler.set_epoch`` each epoch)."""
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    return sampler, DataLoader(train_set, batch_size=batch, sampler=sampler)


def new_model(info):
    torch.manual_seed(0)  # the same initial weights on every rank
    return build_model("gpt", info, layers=1, width=WIDTH, heads=4)


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def save_checkpoint(path, epoch: int, **objects) -> None:
    """``torch.save`` every object's ``state_dict()`` (model, optimizer, gradzip state, ...) and the epoch."""
    torch.save({"epoch": epoch, **{name: obj.state_dict() for name, obj in objects.items()}}, path)


def restore(checkpoint: dict, **objects) -> int:
    """Load each object's state from a checkpoint (``torch.load(path, weights_only=True)``); returns the
    epoch to continue with."""
    for name, obj in objects.items():
        obj.load_state_dict(checkpoint[name])
    return checkpoint["epoch"] + 1


@torch.no_grad()
def evaluate(model, held_out) -> float:
    training = model.training
    model.eval()
    loss = loss_of(model, *held_out).item()
    model.train(training)
    return loss
