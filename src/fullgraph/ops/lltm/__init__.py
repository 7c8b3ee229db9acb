"""The LLTM recurrent cell (seed 001) as C++/CUDA operators that torch.compile traces."""

from .api import BACKENDS, lltm, register
from .build import ExtensionBuildError

__all__ = ["lltm", "register", "ExtensionBuildError", "BACKENDS"]
