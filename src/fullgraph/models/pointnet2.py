"""PointNet++ SSG classification (Qi et al., 2017): three set-abstraction levels.

A set abstraction samples centroids by farthest-point sampling, groups the points within a
radius of each (the first ``nsample`` by index, padded with the first found, as the
original), subtracts the centroid, runs a shared MLP (1x1 convolutions, batch norm, ReLU)
and takes the maximum over each group. ``implementation="fullgraph"`` samples and groups
with ``fullgraph.fps`` / ``ball_query`` / ``knn_gather`` (operators: one compiled graph, no
host read); ``"plain"`` with the plain-PyTorch code users write (the FPS loop, a dense
distance matrix, sort), the baseline ``fullgraph bench pointnet2`` measures against.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import _validate
from .switchable import IMPLEMENTATIONS, Switchable
from ..ops.neighbors import ball_query, knn_gather
from ..ops.sampling import fps


def plain_fps(xyz: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count] indices: the usual PyTorch loop (first sample: index 0)."""
    batch, size, _ = xyz.shape
    idx = torch.zeros(batch, count, dtype=torch.long, device=xyz.device)
    distance = torch.full((batch, size), float("inf"), device=xyz.device)
    farthest = torch.zeros(batch, dtype=torch.long, device=xyz.device)
    rows = torch.arange(batch, device=xyz.device)
    for i in range(count):
        idx[:, i] = farthest
        centroid = xyz[rows, farthest][:, None, :]
        distance = torch.minimum(distance, ((xyz - centroid) ** 2).sum(-1))
        farthest = distance.argmax(-1)
    return idx


def plain_ball_query(radius: float, nsample: int, xyz: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """[B, S, nsample]: the first nsample points within the radius, padded with the first."""
    batch, size, _ = xyz.shape
    squared = torch.cdist(centres, xyz) ** 2
    idx = torch.arange(size, device=xyz.device).expand(batch, centres.shape[1], size).clone()
    idx[squared > radius**2] = size
    idx = idx.sort(dim=-1).values[:, :, :nsample]
    first = idx[:, :, :1].expand_as(idx)
    return torch.where(idx == size, first, idx)


def _gather(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """values [B, N, C] at idx [B, ...] -> [B, ..., C]."""
    flat = idx.reshape(idx.shape[0], -1)
    return torch.gather(values, 1, flat[..., None].expand(-1, -1, values.shape[-1])).reshape(*idx.shape, -1)


class SetAbstraction(nn.Module):
    """Sample ``npoint`` centroids, group ``nsample`` points within ``radius``, shared MLP, max.
    ``npoint=None``: one group of every point (the last level)."""

    def __init__(self, npoint: int | None, radius: float, nsample: int, in_channels: int, widths,
                 implementation: str = "fullgraph"):
        super().__init__()
        self.npoint, self.radius, self.nsample = npoint, radius, nsample
        self.implementation = _validate.choice("implementation", implementation, IMPLEMENTATIONS)
        self.plain_sampler = plain_fps  # the plain implementation's FPS (see PointNet2.sample_outside_the_graph)
        layers, width = [], in_channels + 3
        for out in widths:
            layers += [nn.Conv2d(width, out, 1), nn.BatchNorm2d(out), nn.ReLU()]
            width = out
        self.mlp = nn.Sequential(*layers)

    def _group(self, xyz: torch.Tensor):
        """(centroids [B, S, 3], group indices [B, S, nsample])."""
        if self.implementation == "plain":
            centres = _gather(xyz, self.plain_sampler(xyz, self.npoint))
            return centres, plain_ball_query(self.radius, self.nsample, xyz, centres)
        centres = knn_gather(xyz, fps(xyz, n_samples=self.npoint, random_start=False)[..., None])[:, :, 0]
        _, idx, _ = ball_query(centres, xyz, K=self.nsample, radius=self.radius, return_nn=False)
        return centres, torch.where(idx >= 0, idx, idx[:, :, :1])  # the centroid itself is always found

    def forward(self, xyz: torch.Tensor, features: torch.Tensor | None):
        """xyz [B, N, 3], features [B, N, C] or None -> ([B, S, 3], [B, S, widths[-1]])."""
        if self.npoint is None:
            centres = xyz.new_zeros(xyz.shape[0], 1, 3)
            grouped = xyz[:, None] if features is None else torch.cat([xyz, features], -1)[:, None]
        else:
            centres, idx = self._group(xyz)
            local = _gather(xyz, idx) - centres[:, :, None, :]
            grouped = local if features is None else torch.cat([local, _gather(features, idx)], -1)
        out = self.mlp(grouped.permute(0, 3, 1, 2))  # [B, C, S, K]
        return centres, out.amax(-1).transpose(1, 2)


class PointNet2(Switchable):
    """PointNet++ SSG classifier: xyz [B, N, 3] -> logits [B, num_classes]."""

    def __init__(self, num_classes: int = 40, implementation: str = "fullgraph"):
        super().__init__()
        self.levels = nn.ModuleList([
            SetAbstraction(512, 0.2, 32, 0, (64, 64, 128), implementation),
            SetAbstraction(128, 0.4, 64, 128, (128, 128, 256), implementation),
            SetAbstraction(None, 0.0, 0, 256, (256, 512, 1024), implementation),
        ])
        self.head = nn.Sequential(
            nn.Linear(1024, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Dropout(0.4),
            nn.Linear(512, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Dropout(0.4), nn.Linear(256, num_classes))

    def sample_outside_the_graph(self) -> PointNet2:
        """Leave the plain implementation's FPS loop out of torch.compile's graph, as a user
        must: compiled, its Python loop unrolls (512 + 128 steps), which on the development
        CPU compiled for 275 s and then failed in the C++ compiler. Returns the model."""
        outside = torch.compiler.disable(plain_fps)
        for level in self.levels:
            level.plain_sampler = outside
        return self

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        features = None
        for level in self.levels:
            xyz, features = level(xyz, features)
        return self.head(features[:, 0])
