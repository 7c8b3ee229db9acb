"""The source documents' models."""

from .projector import KNNProjector, RadiusProjector

__all__ = ["KNNProjector", "RadiusProjector"]
