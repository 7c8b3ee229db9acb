"""The LLTM recurrent cell (PyTorch's LLTM extension tutorial) as C++/CUDA operators that torch.compile traces."""

from .api import BACKENDS, decompositions, lltm, lltm_backward, lltm_forward
from .build import ExtensionBuildError, library

__all__ = ["lltm", "lltm_forward", "lltm_backward", "ExtensionBuildError", "BACKENDS", "decompositions", "library"]
