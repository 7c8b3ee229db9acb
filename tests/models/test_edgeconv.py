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


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("momentum", [0.1, None])
def test_per_point_products_equal_the_edges_mlp_in_training(momentum, device):
    """Batch statistics, their running averages, channels of negative scale (a minimum
    instead of a maximum) and every gradient: the same as the MLP over the edges."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 90, 12, generator=generator, dtype=torch.float64).to(device)
    ours = EdgeConv(12, 16, k=7).double().to(device)
    plain = EdgeConv(12, 16, k=7, implementation="plain").double().to(device)
    norm = ours.mlp[1]
    norm.momentum = momentum
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=generator, dtype=torch.float64))  # about half negative
        norm.bias.copy_(torch.randn(16, generator=generator, dtype=torch.float64))
    plain.load_state_dict(ours.state_dict())
    plain.mlp[1].momentum = momentum
    assert (norm.weight < 0).any()
    for step in range(2):
        x_ours, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ours, out_plain = ours(x_ours), plain(x_plain)
        torch.testing.assert_close(out_ours, out_plain)
        weights = torch.randn(out_ours.shape, generator=generator, dtype=torch.float64).to(device)
        (out_ours * weights).sum().backward()
        (out_plain * weights).sum().backward()
        torch.testing.assert_close(x_ours.grad, x_plain.grad)
        for a, b in zip(ours.parameters(), plain.parameters()):
            torch.testing.assert_close(a.grad, b.grad)
        for name, buffer in ours.mlp[1].named_buffers():
            torch.testing.assert_close(buffer, dict(plain.mlp[1].named_buffers())[name], msg=name)
    ours.eval(), plain.eval()
    torch.testing.assert_close(ours(x), plain(x))


def test_too_few_points_for_k():
    with pytest.raises(ValueError, match=r"x: expected at least k = 8 points, got shape \(1, 5, 3\)"):
        EdgeConv(3, 4, k=8)(torch.rand(1, 5, 3))
