"""DGCNN's dynamic graph convolution (Wang et al., 2019): EdgeConv.

Each point's k nearest neighbours are found in the *feature* space of the layer's input;
the edge features ``[x_i, x_j - x_i]`` go through a shared MLP (1x1 convolution, batch
norm, LeakyReLU 0.2) and the maximum over the k edges is the point's output.
``implementation="fullgraph"`` finds the neighbours with ``fullgraph.knn`` (exact, ties to
the smaller index; on GPUs and CPUs the matrix-product "dense" backend in feature space) and
never forms the edges: the convolution of ``[x_i, x_j - x_i]`` is ``P_i + Q_j`` with
``P = x (W_a - W_b)^T`` and ``Q = x W_b^T`` (W = [W_a, W_b]), one product per point instead
of per edge (k times fewer); the batch norm's statistics, the mean and variance of
``P_i + Q_j`` over the edges, come from per-point sums (``_per_point``); and since the
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
from ..ops.neighbors import knn, knn_gather, knn_reduce


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
        """The MLP over the edges of the lists idx [B, N, k], from per-point products (module
        docstring). The batch norm's statistics in per-point sums: with n = B N k edges, c_j the
        lists holding point j, mu_P the mean of P and mu_Q the c-weighted mean of Q, P' = P - mu_P,
        Q' = Q - mu_Q and S_i = sum_j Q'_j over i's list, the edges' mean is mu_P + mu_Q and
        n var = k sum_i P'_i^2 + 2 sum_i P'_i S_i + sum_j c_j Q'_j^2. One pass over the lists
        (``knn_reduce``) gives S and the extremes of Q'; nothing of size n is stored."""
        conv, norm, act = self.mlp
        batch, points, _ = x.shape
        weight = conv.weight[:, :, 0, 0]  # [out, 2 in]: W_a acts on x_i, W_b on x_j - x_i
        centre, offset = weight.split(x.shape[-1], 1)
        p, q = (x @ torch.cat([centre - offset, offset]).T).split(weight.shape[0], -1)  # [B, N, out] each
        if norm.training or norm.running_mean is None:
            flat = (idx + torch.arange(batch, device=idx.device)[:, None, None] * points).reshape(-1)
            holding = torch.zeros(batch * points, dtype=x.dtype, device=x.device).index_add(
                0, flat, torch.ones(flat.shape, dtype=x.dtype, device=x.device)).view(batch, points, 1)  # exact
            edges = idx.numel()
            mean_p = p.mean((0, 1))
            mean_q = (holding * q).sum((0, 1)) / edges
            p, q = p - mean_p, q - mean_q
            top, bottom, total = knn_reduce(q, idx)  # [B, N, out]: one pass over the lists
            var = (self.k * p.square().sum((0, 1)) + 2 * (p * total).sum((0, 1))
                   + (holding * q.square()).sum((0, 1))) / edges
            mean, centred = mean_p + mean_q, 0
            if norm.training and norm.running_mean is not None:
                self._track(norm, mean, var, edges)
        else:
            mean, var = norm.running_mean, norm.running_var
            (top, bottom, _), centred = knn_reduce(q, idx), mean
        scale = torch.rsqrt(var + norm.eps)
        if norm.weight is not None:
            scale = scale * norm.weight
        shift = 0 if norm.bias is None else norm.bias
        extreme = torch.where(scale >= 0, top, bottom)
        return act(scale * (p + extreme - centred) + shift)

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
