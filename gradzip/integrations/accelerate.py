"""HF Accelerate: ``gradzip.integrations.accelerate.checkpoint(accelerator, state)``.

``accelerator.register_for_checkpointing(state)`` is not enough: Accelerate writes registered objects
from the main process alone, so every rank would resume with rank 0's residuals (and gradzip refuses to
load them).  Save and load hooks run on every process, so each rank keeps its own file beside
Accelerate's: ``gradzip_rank<r>.pt``.

Under HF Transformers' ``Trainer`` this does nothing: Trainer writes its ``checkpoint-N/`` folders itself
and never calls ``accelerator.save_state`` or ``load_state``, so these hooks never run.  Use
``gradzip.integrations.transformers.register(trainer, method, ...)`` there.
"""
from __future__ import annotations

import os

import torch

from ..state import GradzipState

__all__ = ["checkpoint"]


def _path(directory, rank: int) -> str:
    return os.path.join(directory, f"gradzip_rank{rank}.pt")


def checkpoint(accelerator, state: GradzipState):
    """Make ``accelerator.save_state`` / ``load_state`` carry each rank's gradzip state; returns the two
    hook handles (``.remove()`` undoes it)."""
    if not isinstance(state, GradzipState):
        raise TypeError(f"checkpoint() needs a gradzip.GradzipState, got {type(state).__name__}")

    def save(models, weights, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        torch.save(state.state_dict(), _path(output_dir, state.rank))

    def load(models, input_dir):
        state.load_state_dict(torch.load(_path(input_dir, state.rank), weights_only=True))

    return accelerator.register_save_state_pre_hook(save), accelerator.register_load_state_pre_hook(load)
