"""fullgraph: fast custom and external kernels as first-class citizens of torch.compile.

Importing the package registers its operators under ``torch.ops.fullgraph``.
"""

from . import models
from .ops.neighbors import knn, knn_aggregate, radius, radius_aggregate

__version__ = "0.1.0"

__all__ = ["models", "knn", "knn_aggregate", "radius", "radius_aggregate", "__version__"]
