"""Sampling point clouds: farthest point sampling and voxel grids."""

from .api import fps, voxel_grid

__all__ = ["fps", "voxel_grid"]
