# Ported from PyG test/nn/unpool/test_knn_interpolate.py (MIT License, Copyright (c) 2023 PyG Team) at
# commit 5c6461b2305ad068a6d61165b3c55852a11aaa41: inputs, expected values and assertions unchanged; the pool functions come from
# PyG itself with fullgraph's operators installed (conftest.py), or from fullgraph.compat.pyg.
import torch

from fullgraph.compat.pyg import knn_interpolate
from compat.peer_testing import withPackage


@withPackage('pyg_lib')
def test_knn_interpolate():
    x = torch.tensor([[1.0], [10.0], [100.0], [-1.0], [-10.0], [-100.0]])
    pos_x = torch.tensor([
        [-1.0, 0.0],
        [0.0, 0.0],
        [1.0, 0.0],
        [-2.0, 0.0],
        [0.0, 0.0],
        [2.0, 0.0],
    ])
    pos_y = torch.tensor([
        [-1.0, -1.0],
        [1.0, 1.0],
        [-2.0, -2.0],
        [2.0, 2.0],
    ])
    batch_x = torch.tensor([0, 0, 0, 1, 1, 1])
    batch_y = torch.tensor([0, 0, 1, 1])

    y = knn_interpolate(x, pos_x, pos_y, batch_x, batch_y, k=2)
    assert y.tolist() == [[4.0], [70.0], [-4.0], [-70.0]]
