"""DGCNN's dynamic graph convolution (Wang et al., 2019): EdgeConv.

Each point's k nearest neighbours are found in the *feature* space of the layer's input;
the edge features ``[x_i, x_j - x_i]`` go through a shared MLP (1x1 convolution, batch
norm, LeakyReLU 0.2) and the maximum over the k edges is the point's output.
``implementation="fullgraph"`` finds the neighbours with ``fullgraph.knn`` (exact, ties to
the smaller index; on GPUs and CPUs the matrix-product "dense" backend in feature space) and
never forms the edges: the convolution of ``[x_i, x_j - x_i]`` is ``P_i + Q_j`` with
``P = x (W_a - W_b)^T`` and ``Q = x W_b^T`` (W = [W_a, W_b]), one product per point instead
of per edge (k times fewer); the batch norm's statistics are the mean and variance of
``P_i + Q_j`` over the edges (fused with the gather under torch.compile); and since the
normalization is affine per channel and LeakyReLU increasing, the maximum over j moves
inside: ``max_j act(s (P_i + Q_j) + t) = act(s (P_i + max_j Q_j) + t)`` (``min_j`` where a
channel's scale s is negative). The same function as DGCNN's, rounded differently.
``"plain"`` runs DGCNN's own code (``-|x_i|^2 + 2 x_i.x_j - |x_j|^2`` and ``topk``, the
edges through the 1x1 convolution), the baseline ``fullgraph bench edgeconv`` measures against.
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
        if x.shape[1] < self.k:
            raise ValueError(f"x: expected at least k = {self.k} points, got shape {tuple(x.shape)}")
        if self.implementation == "plain":
            neighbours = knn_gather(x, plain_knn(x, self.k))
            centre = x[:, :, None, :].expand_as(neighbours)
            edges = torch.cat([centre, neighbours - centre], -1).permute(0, 3, 1, 2)  # [B, 2C, N, k]
            return self.mlp(edges).amax(-1).transpose(1, 2)
        _, idx = knn(x.detach(), x.detach(), self.k)  # the graph is rebuilt, not differentiated
        return self._per_point(x, idx)

    def _per_point(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The MLP over the edges of the lists idx [B, N, k], from per-point products (module docstring)."""
        conv, norm, act = self.mlp
        weight = conv.weight[:, :, 0, 0]  # [out, 2 in]: W_a acts on x_i, W_b on x_j - x_i
        centre, offset = weight.split(x.shape[-1], 1)
        p, q = (x @ torch.cat([centre - offset, offset]).T).split(weight.shape[0], -1)  # [B, N, out] each
        neighbours = knn_gather(q, idx)  # [B, N, k, out]
        if norm.training or norm.running_mean is None:
            edges = p[:, :, None, :] + neighbours
            mean = edges.mean((0, 1, 2))
            var = (edges - mean).square().mean((0, 1, 2))
            if norm.training and norm.running_mean is not None:
                self._track(norm, mean, var, edges.numel() // edges.shape[-1])
        else:
            mean, var = norm.running_mean, norm.running_var
        scale = torch.rsqrt(var + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight
        shift = -mean * scale if norm.bias is None else norm.bias - mean * scale
        extreme = torch.where(scale >= 0, neighbours.amax(2), neighbours.amin(2))
        return act(scale * (p + extreme) + shift)

    @staticmethod
    @torch.no_grad()
    def _track(norm: nn.BatchNorm2d, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        """The running statistics' update of ``norm`` in training (as torch's batch_norm makes it)."""
        norm.num_batches_tracked += 1
        factor = (1.0 / norm.num_batches_tracked).to(mean.dtype) if norm.momentum is None else norm.momentum
        norm.running_mean.lerp_(mean, factor)
        norm.running_var.lerp_(var * (count / max(count - 1, 1)), factor)


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
