"""The source documents' models."""

from .edgeconv import DGCNN, EdgeConv
from .lltm import LLTM
from .pointnet2 import PointNet2
from .projector import KNNProjector, RadiusProjector
from .unet1d import ConditionalUnet1D

__all__ = ["KNNProjector", "RadiusProjector", "LLTM", "ConditionalUnet1D", "PointNet2", "EdgeConv", "DGCNN"]
