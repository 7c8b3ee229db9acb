"""The source documents' models."""

from .lltm import LLTM
from .projector import KNNProjector, RadiusProjector

__all__ = ["KNNProjector", "RadiusProjector", "LLTM"]
