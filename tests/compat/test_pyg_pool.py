# Ported from PyG test/nn/pool/test_pool.py (MIT License, Copyright (c) 2023 PyG Team) at
# commit 5c6461b2305ad068a6d61165b3c55852a11aaa41: inputs, expected values and assertions unchanged; the pool functions come from
# PyG itself with fullgraph's operators installed (conftest.py), or from fullgraph.compat.pyg.
from typing import Optional

import torch
from torch import Tensor

from fullgraph.compat.pyg import radius_graph
from compat.peer_testing import onlyFullTest, withPackage


@onlyFullTest
@withPackage('pyg_lib')
def test_radius_graph_jit():
    class Net(torch.nn.Module):
        def forward(self, x: Tensor, batch: Optional[Tensor] = None) -> Tensor:
            return radius_graph(x, r=2.5, batch=batch, loop=False)

    x = torch.tensor([[-1, -1], [-1, 1], [1, -1], [1, 1]], dtype=torch.float)
    batch = torch.tensor([0, 0, 0, 0])

    model = Net()
    jit = torch.jit.script(model)
    assert model(x, batch).size() == jit(x, batch).size()
