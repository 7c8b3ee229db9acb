"""The "triton" backend: exact kNN and radius search on a grid of cells (any D, CUDA)."""

from .backend import BACKEND

__all__ = ["BACKEND"]
