"""Point-cloud neighbour search and neighbour-weighted feature aggregation."""

from .api import knn, knn_aggregate, knn_gather, radius, radius_aggregate

__all__ = ["knn", "knn_aggregate", "knn_gather", "radius", "radius_aggregate"]
