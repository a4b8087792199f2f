"""Integrations: how training code hands its gradients to a :class:`~gradzip.state.GradzipState`.

- :mod:`.ddp`: DistributedDataParallel communication hook, ``register(ddp_model, method, **params)`` or
  ``ddp_model.register_comm_hook(GradzipState(...), ddp_comm_hook)``.
- :mod:`.optimizer`: ``DistributedOptimizer``, a Horovod-style optimizer wrapper for code without DDP.
- :mod:`.diloco`: ``DiLoCo``, local training with a compressed outer exchange every ``sync_every`` steps.
- :mod:`.accelerate`: HF Accelerate, per-rank gradzip state in ``save_state`` / ``load_state``.
- :mod:`.transformers`: HF Transformers ``Trainer``, ``register(trainer, method, **params)``: gradzip on
  Trainer's DDP model, per-rank state in each ``checkpoint-N/``.  Imported on first use
  (``gradzip.integrations.transformers``), so ``import gradzip`` never imports transformers.

:mod:`.momentum_guard` is shared by the DDP hook and the optimizer wrapper: an optimizer that applies
momentum to parameters whose compressor already does raises.  The top-level names are re-exported as
``gradzip.register``, ``gradzip.ddp_comm_hook``, ``gradzip.DistributedOptimizer`` and ``gradzip.DiLoCo``.
"""
import importlib

from . import accelerate
from .ddp import ddp_comm_hook, register
from .diloco import DiLoCo
from .optimizer import DistributedOptimizer

__all__ = ["register", "ddp_comm_hook", "DistributedOptimizer", "DiLoCo", "accelerate"]  # transformers: on demand


def __getattr__(name):
    if name == "transformers":  # needs HF Transformers, which gradzip does not: loaded when asked for
        return importlib.import_module(".transformers", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
