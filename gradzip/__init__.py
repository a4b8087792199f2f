"""gradzip: gradient compression for data-parallel PyTorch training.

    state = gradzip.register(ddp_model, "powersgd", rank=2)        # DDP communication hook
    opt = gradzip.DistributedOptimizer(opt, model.named_parameters(), "topk", ratio=0.01)
    ddp_model.register_comm_hook(gradzip.GradzipState("topk", ratio=0.01), gradzip.ddp_comm_hook)
    gradzip.advise(model, sample_batch, bandwidth="1gbit", workers=64)  # which method pays, projected
"""
from .compressors import compressors, make, parameters_of
from .state import GradzipState
from . import integrations
from .integrations import DiLoCo, DistributedOptimizer, ddp_comm_hook, register
# The function, not its module: ``gradzip.advise(...)``; the module's other names import from gradzip.advise.
from .advise import advise

__version__ = "0.1.0"
__all__ = ["compressors", "make", "parameters_of", "register", "ddp_comm_hook", "DistributedOptimizer", "GradzipState",
           "DiLoCo", "advise"]
