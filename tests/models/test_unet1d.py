"""ConditionalUnet1D: the document's sizes, shapes, conditioning, errors."""

from __future__ import annotations

import pytest
import torch

import fullgraph


def _small(**overrides):
    torch.manual_seed(0)
    return fullgraph.models.ConditionalUnet1D(**{"down_dims": (16, 32, 64), "global_cond_dim": 10, **overrides})


def test_document_sizes_are_the_defaults():
    unet = fullgraph.models.ConditionalUnet1D()
    assert sum(p.numel() for p in unet.parameters()) == 79_947_266  # 79.9 M, as the issue measured
    assert (unet.action_dim, unet.horizon, unet.global_cond_dim) == (2, 16, 1028)


@pytest.mark.parametrize("timestep", [5, torch.tensor(5), torch.tensor([5, 5, 5])])
def test_shapes_and_timestep_forms(timestep):
    unet = _small().eval()
    x, cond = torch.randn(3, 16, 2), torch.randn(3, 10)
    out = unet(x, timestep, cond)
    assert out.shape == (3, 16, 2)
    torch.testing.assert_close(out, unet(x, torch.tensor([5, 5, 5]), cond))


def test_step_and_condition_change_the_prediction():
    unet = _small().eval()
    x, cond = torch.randn(2, 16, 2), torch.randn(2, 10)
    base = unet(x, 3, cond)
    assert not torch.allclose(base, unet(x, 70, cond))
    assert not torch.allclose(base, unet(x, 3, cond + 1))


def test_film_without_scale_and_gradients_flow():
    unet = _small(cond_predict_scale=False)
    out = unet(torch.randn(2, 16, 2), torch.tensor(4), torch.randn(2, 10))
    out.square().mean().backward()
    assert all(p.grad is not None for p in unet.parameters())


@pytest.mark.parametrize("sample, cond, message", [
    (torch.randn(2, 16, 3), torch.randn(2, 10), "sample: expected [B, horizon, 2]"),
    (torch.randn(2, 16, 2), torch.randn(3, 10), "global_cond: expected [2, 10]"),
])
def test_bad_input(sample, cond, message):
    with pytest.raises(ValueError) as raised:
        _small()(sample, 1, cond)
    assert message in str(raised.value)
