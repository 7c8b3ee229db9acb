"""The "cpu" backend: k-d trees (scipy) and a C++ extension for selection and sums."""

from .backend import BACKEND

__all__ = ["BACKEND"]
