"""The point-cloud projector models of the source document (PhysicsNeMo's projector tutorial).

An MLP learns features on the reference cloud, a neighbour aggregation carries them to
the query points, and a second MLP maps them out. ``aggregation="fullgraph"`` uses the
fullgraph operators (the neighbour aggregation and ``narrow_mlp`` for the MLPs);
``aggregation="document"`` the tutorial's own plain-PyTorch code (dense M x N distances,
layer-by-layer MLPs), kept as the baseline the benchmarks compare against. Both hold the
same parameters.
"""

from __future__ import annotations

import torch

from .. import _validate
from ..ops.mlp import narrow_mlp
from ..ops.neighbors import knn_aggregate, radius_aggregate


class MLP(torch.nn.Module):
    """Three linear layers with ReLU between: [N, input_dim] -> [N, output_dim]."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(input_dim, hidden_dim)
        self.fc2 = torch.nn.Linear(hidden_dim, hidden_dim)
        self.fc3 = torch.nn.Linear(hidden_dim, output_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same layers through ``fullgraph.narrow_mlp`` (one kernel a pass on CUDA)."""
        layers = (self.fc1, self.fc2, self.fc3)
        return narrow_mlp(x, [layer.weight for layer in layers], [layer.bias for layer in layers])


def document_knn_aggregation(p1, p2, p2_features, k: int, sigma: float):
    """The tutorial's kNN aggregation: dense [M, N] norms, topk, softmax, weighted sum."""
    dists = torch.norm(p1[:, None, :] - p2[None, :, :], dim=-1)
    topk_dists, topk_idx = torch.topk(dists, k=k, dim=1, largest=False)
    weights = torch.softmax(-topk_dists / sigma, dim=1)
    return torch.sum(weights.unsqueeze(-1) * p2_features[topk_idx], dim=1)


def document_radius_aggregation(p1, p2, p2_features, radius: float, sigma: float):
    """The tutorial's radius aggregation: softmax over all N, masked, renormalized."""
    dists = torch.norm(p1[:, None, :] - p2[None, :, :], dim=-1)
    weights = torch.softmax(-dists / sigma, dim=-1)
    weights = torch.where(dists <= radius, weights, torch.zeros_like(weights))
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-8)
    return torch.sum(weights.unsqueeze(-1) * p2_features.unsqueeze(0), dim=1)


class _Projector(torch.nn.Module):
    def __init__(self, input_dim, hidden_dim, output_dim, sigma, aggregation, backend):
        super().__init__()
        _validate.choice("aggregation", aggregation, ("fullgraph", "document"))
        self.proj = MLP(input_dim, hidden_dim, hidden_dim)
        self.proj_out = MLP(hidden_dim, hidden_dim, output_dim)
        self.sigma = _validate.real("sigma", sigma, minimum=0.0, strict=True)
        self.aggregation = aggregation
        self.backend = backend

    def forward(self, p1: torch.Tensor, p2: torch.Tensor) -> torch.Tensor:
        """p1: [M, input_dim] queries, p2: [N, input_dim] references -> [M, output_dim].
        The tutorial's formulation runs its MLPs layer by layer, fullgraph's through
        ``fullgraph.narrow_mlp``."""
        if self.aggregation == "document":
            return self.proj_out(self.aggregate(p1, p2, self.proj(p2)))
        return self.proj_out.fused(self.aggregate(p1, p2, self.proj.fused(p2)))


class KNNProjector(_Projector):
    """The tutorial's ``kNN_Projector``: features of the k nearest, softmax-weighted."""

    def __init__(self, k: int = 7, input_dim: int = 3, hidden_dim: int = 25, output_dim: int = 1,
                 sigma: float = 0.1, aggregation: str = "fullgraph", backend: str = "auto"):
        super().__init__(input_dim, hidden_dim, output_dim, sigma, aggregation, backend)
        self.k = _validate.integer("k", k, minimum=1)

    def aggregate(self, p1, p2, features):
        if self.aggregation == "document":
            return document_knn_aggregation(p1, p2, features, self.k, self.sigma)
        return knn_aggregate(p1, p2, features, self.k, sigma=self.sigma, backend=self.backend)


class RadiusProjector(_Projector):
    """The tutorial's radius-bounded projector: all references within ``radius``."""

    def __init__(self, radius: float = 0.1, input_dim: int = 3, hidden_dim: int = 25, output_dim: int = 1,
                 sigma: float = 0.1, aggregation: str = "fullgraph", backend: str = "auto"):
        super().__init__(input_dim, hidden_dim, output_dim, sigma, aggregation, backend)
        self.radius = _validate.real("radius", radius, minimum=0.0, strict=False)

    def aggregate(self, p1, p2, features):
        if self.aggregation == "document":
            return document_radius_aggregation(p1, p2, features, self.radius, self.sigma)
        return radius_aggregate(p1, p2, features, self.radius, sigma=self.sigma, backend=self.backend)
