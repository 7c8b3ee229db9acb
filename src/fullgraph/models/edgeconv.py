"""DGCNN's dynamic graph convolution (Wang et al., 2019): EdgeConv.

Each point's k nearest neighbours are found in the *feature* space of the layer's input;
the edge features ``[x_i, x_j - x_i]`` go through a shared MLP (1x1 convolution, batch
norm, LeakyReLU 0.2) and the maximum over the k edges is the point's output.
``implementation="fullgraph"`` finds the neighbours with ``fullgraph.knn`` (exact, ties to
the smaller index; on CPUs the matrix-product "dense" backend from D = 12 on) and gathers
with ``knn_gather``; ``"plain"`` with DGCNN's own code (``-|x_i|^2 + 2 x_i.x_j - |x_j|^2``
and ``topk``), the baseline ``fullgraph bench edgeconv`` measures against.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _validate
from .switchable import IMPLEMENTATIONS, Switchable
from ..ops.neighbors import knn, knn_gather



def plain_knn(x: torch.Tensor, k: int) -> torch.Tensor:
    """[B, N, k] neighbour indices as DGCNN computes them (x [B, N, C]; the point itself included)."""
    inner = -2 * torch.matmul(x, x.transpose(1, 2))
    squared = (x * x).sum(-1, keepdim=True)
    return (-squared - inner - squared.transpose(1, 2)).topk(k, dim=-1).indices


class EdgeConv(nn.Module):
    """x [B, N, in_channels] -> [B, N, out_channels]: max over the k nearest (in feature space)
    of MLP([x_i, x_j - x_i])."""

    def __init__(self, in_channels: int, out_channels: int, k: int = 20, implementation: str = "fullgraph"):
        super().__init__()
        self.k = _validate.integer("k", k, minimum=1)
        self.implementation = _validate.choice("implementation", implementation, IMPLEMENTATIONS)
        self.mlp = nn.Sequential(nn.Conv2d(2 * in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels),
                                 nn.LeakyReLU(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.implementation == "plain":
            idx = plain_knn(x, self.k)
        else:
            _, idx = knn(x.detach(), x.detach(), self.k)  # the graph is rebuilt, not differentiated
        neighbours = knn_gather(x, idx)
        centre = x[:, :, None, :].expand_as(neighbours)
        edges = torch.cat([centre, neighbours - centre], -1).permute(0, 3, 1, 2)  # [B, 2C, N, k]
        return self.mlp(edges).amax(-1).transpose(1, 2)


class DGCNN(Switchable):
    """A DGCNN-style stack: EdgeConv 3 -> 64 -> 64 -> 64 (k nearest in each layer's input
    space), then a per-point linear layer on the concatenated features: xyz [B, N, 3] ->
    [B, N, out_channels]."""

    def __init__(self, out_channels: int = 64, k: int = 20, implementation: str = "fullgraph"):
        super().__init__()
        self.convs = nn.ModuleList([EdgeConv(3, 64, k, implementation), EdgeConv(64, 64, k, implementation),
                                    EdgeConv(64, 64, k, implementation)])
        self.head = nn.Linear(3 * 64, out_channels)

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        features, x = [], xyz
        for conv in self.convs:
            x = conv(x)
            features.append(x)
        return self.head(torch.cat(features, -1))
