"""HF Transformers ``Trainer``: gradzip on the DDP model Trainer builds, its state in every ``checkpoint-N/``.

    trainer = Trainer(model=model, args=args, train_dataset=train_set)
    callback = gradzip.integrations.transformers.register(trainer, "topk", ratio=0.01)
    trainer.train()                      # or trainer.train(resume_from_checkpoint=True), or a path
    print(callback.state.stats())

Why a function of the trainer rather than a callback passed in ``callbacks=[...]``: Trainer hands its
callbacks the unwrapped model, never the ``DistributedDataParallel`` one, and builds that only inside
``train()``, just before ``on_train_begin``.  Its documented handle on it is ``trainer.model_wrapped``
(reached through ``torch.compile``'s wrapper when ``torch_compile=True``), and only a callback that holds
the trainer can read it.  Likewise no callback is told which checkpoint ``train(resume_from_checkpoint=...)``
resumes from, so :func:`register` wraps this one trainer's ``train`` to note it (``True`` resolves to the
last ``checkpoint-N`` in ``args.output_dir``, as Trainer does).  The Trainer class is not changed.

What it saves: ``gradzip_rank<r>.pt`` in each ``checkpoint-N/`` Trainer writes, one file per rank written by
that rank (residuals, momenta and bases differ between ranks), beside Trainer's own ``rng_state_<r>.pth``.
A resume loads each rank's file before the first step, so for deterministic methods the resumed run
equals the uninterrupted one bit for bit.  A resume from a checkpoint without those files raises: a
fresh state would drop the residuals (the gradient not yet sent) and restart PowerSGD's bases, a
different run from the one checkpointed.  ``missing_ok=True`` accepts that (e.g. turning gradzip on for
a run checkpointed without it): gradzip's state is then not restored (fresh in a new process), with a
warning.

Not supported: FSDP, DeepSpeed and single-process runs (there is no DDP model; :func:`register` raises
when training starts) and ``hyperparameter_search`` (its checkpoints go to per-trial folders).
"""
from __future__ import annotations

import functools
import inspect
import logging
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from .ddp import register as _register_ddp, uncompiled

__all__ = ["register", "GradzipCallback"]

logger = logging.getLogger(__name__)


def state_file(checkpoint_dir, rank: int) -> str:
    """Where rank ``rank``'s gradzip state lives in a Trainer checkpoint folder."""
    return os.path.join(checkpoint_dir, f"gradzip_rank{rank}.pt")


class GradzipCallback(TrainerCallback):
    """Registers gradzip on ``trainer.model_wrapped`` at ``on_train_begin``, saves each rank's state at
    ``on_save`` and loads it when ``train()`` resumes.  Made by :func:`register`.

    ``state``: the :class:`~gradzip.GradzipState`, None until training starts.
    """

    def __init__(self, trainer, compressor, missing_ok: bool = False, **params):
        self.trainer, self.compressor, self.params, self.missing_ok = trainer, compressor, params, missing_ok
        self.state = None
        self.resume_from = None  # the checkpoint folder the running train() call resumes from
        self._ddp = None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_hyper_param_search:
            raise ValueError("gradzip's Trainer integration does not support hyperparameter_search "
                             "(its checkpoints go to per-trial folders); train one configuration at a time")
        ddp = _ddp_model(self.trainer)
        if ddp is not self._ddp:  # a first train(), or a model Trainer wrapped anew (model_init, auto_find_batch_size)
            if self.state is not None:
                self.state.close()
            self.state, self._ddp = _register_ddp(ddp, self.compressor, **self.params), ddp
        if self.resume_from is not None:
            self._load(self.resume_from)

    def on_save(self, args, state, control, **kwargs):
        # Every rank gets on_save, after Trainer's save, and between two optimizer steps: no exchange is
        # in flight.  Rank 0 may not have made the folder yet when another rank gets here.
        if self.state is None:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = state_file(folder, self.state.rank)
        torch.save(self.state.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)  # never a half-written file under the final name

    def _load(self, folder: str) -> None:
        rank = self.state.rank
        found = os.path.isfile(state_file(folder, rank))
        # Every rank decides alike: one rank raising while the others train on would hang them.
        everyone = [found]
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, found)
        missing = [r for r, ok in enumerate(everyone) if not ok]
        if not missing:
            self.state.load_state_dict(torch.load(state_file(folder, rank), weights_only=True))
            return
        what = (f"resuming from {folder}, which holds no gradzip state for rank(s) {missing} "
                "(gradzip_rank<r>.pt: saved without gradzip, or not copied)")
        if not self.missing_ok:
            raise FileNotFoundError(f"{what}; a fresh state would not continue the checkpointed run, so "
                                    "gradzip stops here (register(trainer, ..., missing_ok=True) goes on without it)")
        if rank == 0:
            logger.warning("%s; missing_ok=True: gradzip goes on without it (a fresh state in a new process)", what)


def _ddp_model(trainer) -> DistributedDataParallel:
    model = uncompiled(trainer.model_wrapped)
    if not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"gradzip's Trainer integration needs the model Trainer wraps in DistributedDataParallel, but "
            f"trainer.model_wrapped is a {type(trainer.model_wrapped).__name__}: Trainer uses DDP when it runs "
            "on several processes (torchrun --nproc-per-node N) without FSDP or DeepSpeed, which gradzip does "
            "not support")
    return model


def _checkpoint_dir(trainer, resume_from_checkpoint):
    """The folder ``train(resume_from_checkpoint=...)`` loads, resolved as Trainer resolves it; None for none."""
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        return get_last_checkpoint(trainer.args.output_dir)  # None: Trainer raises its own error
    return os.fspath(resume_from_checkpoint)


def register(trainer, compressor="none", *, missing_ok: bool = False, **params) -> GradzipCallback:
    """Compress ``trainer``'s DDP gradient exchange with ``compressor`` (parameters as for
    ``gradzip.register``: ``ratio=0.01``, ``rank=2``, ``seed``, ``group``, ...) and keep gradzip's state in
    its checkpoints.  Call it once, before ``trainer.train()``; returns the callback (``callback.state``).

    ``missing_ok``: resuming from a checkpoint without gradzip's files goes on without them (a fresh
    state in a new process), with a warning, instead of raising ``FileNotFoundError``.
    """
    if any(isinstance(cb, GradzipCallback) for cb in trainer.callback_handler.callbacks):
        raise ValueError("gradzip is already registered on this trainer (one register() per trainer)")
    callback = GradzipCallback(trainer, compressor, missing_ok=missing_ok, **params)
    trainer.add_callback(callback)
    train = trainer.train
    signature = inspect.signature(train)

    @functools.wraps(train)
    def train_noting_resume(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        callback.resume_from = _checkpoint_dir(trainer, bound.arguments.get("resume_from_checkpoint"))
        try:
            return train(*args, **kwargs)
        finally:
            callback.resume_from = None

    trainer.train = train_noting_resume
    return callback
