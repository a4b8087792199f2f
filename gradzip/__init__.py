"""gradzip: gradient compression for data-parallel PyTorch training."""
from .compressors import compressors, make, parameters_of
from .state import GradzipState

__version__ = "0.1.0"
__all__ = ["compressors", "make", "parameters_of", "GradzipState"]
