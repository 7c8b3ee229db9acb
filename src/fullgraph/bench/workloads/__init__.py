"""The benchmark workloads, one module each; importing them fills ``WORKLOADS``.

A workload registers under its CLI name with its sizes; ``build(size, device)`` returns one
``Case`` per variant. A new workload is one module here plus its import below.
"""

from . import (  # noqa: F401
    diffusion_policy, edgeconv, extern_pool, fps, graph_builders, kmeans, kmeans_fit, knn_sharded, knn_sweep, lltm, neighbor_ops,
    pointnet2, projectors, pyg_models,
)
from .base import BASELINE, WORKLOADS, Case, Workload, register, seed_point_clouds

__all__ = ["BASELINE", "WORKLOADS", "Case", "Workload", "register", "seed_point_clouds"]
