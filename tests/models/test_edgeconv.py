"""EdgeConv / DGCNN: fullgraph's exact kNN gives DGCNN's graph; one compiled graph; trains."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_compiles_once_and_trains
from fullgraph.models import DGCNN, EdgeConv


def test_edgeconv_equals_dgcnns_code_without_near_ties():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 120, 16, generator=generator, dtype=torch.float64)
    torch.manual_seed(0)
    ours = EdgeConv(16, 32, k=8).double().eval()
    plain = EdgeConv(16, 32, k=8, implementation="plain").double().eval()
    plain.load_state_dict(ours.state_dict())
    torch.testing.assert_close(ours(x), plain(x))


def test_gradients_reach_the_features():
    x = torch.randn(1, 30, 5, dtype=torch.float64, requires_grad=True)
    conv = EdgeConv(5, 4, k=6).double().eval()
    assert torch.autograd.gradcheck(conv, (x,))


@pytest.mark.slow
def test_dgcnn_compiles_in_one_graph_and_trains():
    generator = torch.Generator().manual_seed(2)
    xyz = torch.rand(2, 256, 3, generator=generator)
    target = torch.randn(2, 256, 8, generator=generator)
    torch.manual_seed(0)
    model = DGCNN(out_channels=8, k=10)
    assert_compiles_once_and_trains(model, (xyz,), lambda out: (out - target).square().mean(), lr=1e-2)
