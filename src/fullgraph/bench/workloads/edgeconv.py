"""DGCNN's dynamic graph convolution: a three-layer EdgeConv stack (kNN in each layer's
feature space, edge MLP on [x_i, x_j - x_i], max over neighbours), DGCNN's own kNN code
against fullgraph.knn, eager, compiled and with CUDA graphs (torch.compile's, and the whole
train step in one graph); forward and an Adam train step."""

from __future__ import annotations

from ...models import DGCNN
from .base import Workload, register
from .pointnet2 import model_cases

register(Workload(
    name="edgeconv",
    description="DGCNN-style EdgeConv stack (3 -> 64 -> 64 -> 64, k nearest in feature space), per-point output",
    sizes={"seed": {"batch": 8, "points": 4096, "k": 20}, "small": {"batch": 2, "points": 1024, "k": 20},
           "tiny": {"batch": 2, "points": 256, "k": 10}},
    build=lambda params, device: model_cases(DGCNN(out_channels=16, k=params["k"]), params, device, "regression",
                                             whole_step=("plain", "fullgraph")),
    notes=["plain: DGCNN's kNN (-|x_i|^2 + 2 x_i.x_j - |x_j|^2, topk); fullgraph: fullgraph.knn (exact, ties to the "
           "smaller index) and knn_gather"],
    baseline="plain eager",
))
