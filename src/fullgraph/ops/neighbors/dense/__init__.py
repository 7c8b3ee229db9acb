"""The "dense" backend: feature-space kNN from tensor-core products, certified exact."""

from .backend import BACKEND

__all__ = ["BACKEND"]
