"""Adapters for training frameworks beyond plain DDP (the DDP hook and the optimizer wrapper are
``gradzip.register``, ``gradzip.ddp_comm_hook`` and ``gradzip.DistributedOptimizer``)."""
from . import accelerate

__all__ = ["accelerate"]
