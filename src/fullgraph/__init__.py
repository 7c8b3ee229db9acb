"""fullgraph: fast custom and external kernels as first-class citizens of torch.compile.

Importing the package registers its operators under ``torch.ops.fullgraph``.
"""

from . import diffusion, extern, graphs, memory, models, numpy
from .explain import explain
from .ops.conv_block import conv_groupnorm_mish
from .ops.ddpm import ddim_step, ddpm_step
from .ops.kmeans import KMeans, KMeansResult, kmeans, kmeans_assign
from .ops.lltm import lltm
from .ops.mlp import narrow_mlp
from .ops.neighbors import (
    ball_query, knn, knn_aggregate, knn_edges, knn_gather, knn_graph, knn_reduce, radius, radius_aggregate,
    radius_edges, radius_graph,
)
from .ops.sampling import fps, voxel_grid

__version__ = "0.1.0"

from ._first_call import defer_dynamo_import as _defer_dynamo_import  # noqa: E402

_defer_dynamo_import("fullgraph")


def __getattr__(name: str):
    """``fullgraph.distributed`` on first use (it imports torch.distributed)."""
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "diffusion", "distributed", "explain", "extern", "graphs", "memory", "models", "numpy", "ddpm_step", "ddim_step",
    "conv_groupnorm_mish",
    "knn", "knn_aggregate",
    "knn_gather", "knn_reduce", "radius", "radius_aggregate", "knn_edges", "knn_graph", "radius_edges", "radius_graph", "fps",
    "ball_query", "voxel_grid",
    "kmeans", "kmeans_assign", "KMeans", "KMeansResult", "lltm", "narrow_mlp", "__version__",
]
