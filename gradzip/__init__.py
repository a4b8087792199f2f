"""gradzip: gradient compression for data-parallel PyTorch training.

    state = gradzip.register(ddp_model, "powersgd", rank=2)        # DDP communication hook
    opt = gradzip.DistributedOptimizer(opt, model.named_parameters(), "topk", ratio=0.01)
"""
from .compressors import compressors, make, parameters_of
from .hook import register
from .optimizer import DistributedOptimizer
from .state import GradzipState

__version__ = "0.1.0"
__all__ = ["compressors", "make", "parameters_of", "register", "DistributedOptimizer", "GradzipState"]
