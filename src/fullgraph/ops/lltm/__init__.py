"""The LLTM recurrent cell (PyTorch's LLTM extension tutorial) as C++/CUDA operators that torch.compile traces."""

from .api import BACKENDS, lltm, register
from .build import ExtensionBuildError

__all__ = ["lltm", "register", "ExtensionBuildError", "BACKENDS"]
