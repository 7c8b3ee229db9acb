"""Point-cloud neighbour search, neighbour-weighted feature aggregation, and the
torch_cluster / PyTorch3D vocabulary built on them."""

from .api import knn, knn_aggregate, knn_gather, radius, radius_aggregate
from . import flat  # noqa: F401  (registers the batch-vector operators)
from .ball_query import ball_query
from .cluster import knn_edges, knn_graph, radius_edges, radius_graph
from .reduce import knn_reduce

__all__ = ["ball_query", "knn", "knn_aggregate", "knn_edges", "knn_gather", "knn_graph", "knn_reduce", "radius", "radius_aggregate",
           "radius_edges", "radius_graph"]
