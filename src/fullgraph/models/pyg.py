"""PyG's DGCNN and PointNet++ classification examples as models (``torch_geometric`` needed):
the layers and pool functions of ``torch_geometric.nn``, so that ``fullgraph.compat.pyg.install()``
puts them on fullgraph's operators. Inputs are flat clouds pos [N, 3] with a sorted batch
vector [N] and the batch size as an int (PyG's global pooling would read it back).

``norm`` is the edge MLPs' normalization: PyG's examples use batch norm, which checks that a
batch holds more than one edge - a check on a data-dependent count that
``torch.compile(fullgraph=True)`` cannot trace; with ``norm=None`` (or "layer_norm") the
models compile as one graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DGCNN(torch.nn.Module):
    """Two DynamicEdgeConv layers (kNN in each layer's feature space), a linear layer on both
    layers' features, global max pool and an MLP head: PyG's ``dgcnn_classification.py``."""

    def __init__(self, out_channels: int = 40, k: int = 20, aggr: str = "max", norm: str | None = "batch_norm"):
        super().__init__()
        from torch_geometric.nn import MLP, DynamicEdgeConv

        self.conv1 = DynamicEdgeConv(MLP([2 * 3, 64, 64, 64], norm=norm), k, aggr)
        self.conv2 = DynamicEdgeConv(MLP([2 * 64, 128], norm=norm), k, aggr)
        self.lin1 = torch.nn.Linear(128 + 64, 1024)
        self.mlp = MLP([1024, 512, 256, out_channels], dropout=0.5, norm=None)

    def forward(self, pos: torch.Tensor, batch: torch.Tensor, batch_size: int) -> torch.Tensor:
        from torch_geometric.nn import global_max_pool

        x1 = self.conv1(pos, batch)
        x2 = self.conv2(x1, batch)
        out = global_max_pool(self.lin1(torch.cat([x1, x2], dim=1)), batch, size=batch_size)
        return F.log_softmax(self.mlp(out), dim=1)


class _SetAbstraction(torch.nn.Module):
    def __init__(self, ratio: float, r: float, nn: torch.nn.Module):
        super().__init__()
        from torch_geometric.nn import PointNetConv

        self.ratio, self.r = ratio, r
        self.conv = PointNetConv(nn, add_self_loops=False)

    def forward(self, x, pos, batch):
        from torch_geometric.nn import fps, radius

        idx = fps(pos, batch, ratio=self.ratio)
        row, col = radius(pos, pos[idx], self.r, batch, batch[idx], max_num_neighbors=64)
        x = self.conv((x, None if x is None else x[idx]), (pos, pos[idx]), torch.stack([col, row], dim=0))
        return x, pos[idx], batch[idx]


class PointNet2(torch.nn.Module):
    """Two set-abstraction levels (fps, radius, PointNetConv), a global one and an MLP head:
    PyG's ``pointnet2_classification.py``."""

    def __init__(self, out_channels: int = 10, norm: str | None = "batch_norm"):
        super().__init__()
        from torch_geometric.nn import MLP

        self.sa1 = _SetAbstraction(0.5, 0.2, MLP([3, 64, 64, 128], norm=norm))
        self.sa2 = _SetAbstraction(0.25, 0.4, MLP([128 + 3, 128, 128, 256], norm=norm))
        self.nn3 = MLP([256 + 3, 256, 512, 1024], norm=norm)
        self.mlp = MLP([1024, 512, 256, out_channels], dropout=0.5, norm=None)

    def forward(self, pos: torch.Tensor, batch: torch.Tensor, batch_size: int) -> torch.Tensor:
        from torch_geometric.nn import global_max_pool

        x, pos, batch = self.sa1(None, pos, batch)
        x, pos, batch = self.sa2(x, pos, batch)
        x = global_max_pool(self.nn3(torch.cat([x, pos], dim=1)), batch, size=batch_size)
        return self.mlp(x).log_softmax(dim=-1)
