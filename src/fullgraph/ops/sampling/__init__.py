"""Sampling point clouds: farthest point sampling and voxel grids."""

from .api import decompositions, fps, library, voxel_grid

__all__ = ["fps", "voxel_grid", "decompositions", "library"]
