"""PointNet++ SSG: fullgraph's sampling and grouping equal the plain-PyTorch ones, one graph."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_compiles_once_and_trains
from fullgraph.models import PointNet2
from fullgraph.models.pointnet2 import SetAbstraction


def test_set_abstraction_equals_the_plain_pytorch_one():
    generator = torch.Generator().manual_seed(0)
    xyz = torch.rand(3, 400, 3, generator=generator)
    features = torch.randn(3, 400, 5, generator=generator)
    torch.manual_seed(0)
    ours = SetAbstraction(64, 0.25, 16, 5, (16, 32), "fullgraph").eval()
    plain = SetAbstraction(64, 0.25, 16, 5, (16, 32), "plain").eval()
    plain.load_state_dict(ours.state_dict())
    for got, want in zip(ours(xyz, features), plain(xyz, features)):
        torch.testing.assert_close(got, want)


@pytest.mark.slow
def test_compiles_in_one_graph_and_trains():
    generator = torch.Generator().manual_seed(1)
    xyz = torch.rand(4, 600, 3, generator=generator)
    labels = torch.randint(0, 5, (4,), generator=generator)
    torch.manual_seed(0)
    model = PointNet2(num_classes=5)
    assert_compiles_once_and_trains(model, (xyz,), lambda out: torch.nn.functional.cross_entropy(out, labels))
    model.eval()
    plain = PointNet2(num_classes=5, implementation="plain").eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(xyz), plain(xyz))


@pytest.mark.slow
def test_the_plain_model_compiles_with_its_sampling_left_outside():
    """Compiling the plain FPS loop unrolls it (minutes, then a C++ compiler failure on a CPU):
    sample_outside_the_graph keeps it eager, and the compiled plain model equals the eager one."""
    xyz = torch.rand(2, 600, 3, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    plain = PointNet2(num_classes=5, implementation="plain").eval()
    want = plain(xyz)
    compiled = torch.compile(plain.sample_outside_the_graph())
    with torch.no_grad():
        torch.testing.assert_close(compiled(xyz), want)
