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


@pytest.mark.parametrize("conv", [
    torch.nn.Conv1d(6, 5, 5, padding=2), torch.nn.Conv1d(6, 6, 3, 2, 1), torch.nn.Conv1d(6, 3, 1),
    torch.nn.ConvTranspose1d(6, 6, 4, 2, 1), torch.nn.ConvTranspose1d(6, 4, 3, 1, 0),
])
@pytest.mark.parametrize("length", [1, 4, 9])
def test_matmul_convolutions_compute_the_same_function(conv, length):
    from fullgraph.models.unet1d import matmul_convolutions

    torch.manual_seed(0)
    layer = torch.nn.Sequential(conv.double())
    x = torch.randn(2, 6, length, dtype=torch.float64)
    want = layer(x)
    torch.testing.assert_close(matmul_convolutions(layer)(x), want, rtol=1e-12, atol=1e-12)


def test_matmul_unet_equals_the_unet():
    from fullgraph.models.unet1d import MatmulConv1d, MatmulConvTranspose1d, matmul_convolutions

    unet = _small().double().eval()
    x, cond = torch.randn(2, 16, 2, dtype=torch.float64), torch.randn(2, 10, dtype=torch.float64)
    want = unet(x, 7, cond)
    fast = matmul_convolutions(unet)
    assert not any(isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)) for m in fast.modules())
    assert any(isinstance(m, MatmulConvTranspose1d) for m in fast.modules())
    assert any(isinstance(m, MatmulConv1d) for m in fast.modules())
    torch.testing.assert_close(fast(x, 7, cond), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_conv_blocks_compute_the_same_network(backend, batch, monkeypatch):
    """fuse_conv_blocks, then matmul_convolutions for the rest: the same function (Triton on
    CPU tensors through its interpreter, float32; PyTorch in float64). Batch 2 takes the
    product form in the 16-step blocks (32 columns) and the fused operator in the others."""
    import copy
    import os

    from fullgraph.models.unet1d import (ConditionalResidualBlock1D, Conv1dBlock, FusedConv1dBlock, FusedResidualBlock,
                                         fuse_conv_blocks, matmul_convolutions)

    if backend == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("no Triton device here")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    dtype = torch.float64 if backend == "torch" else torch.float32
    # float32 products in full precision on both sides (cuDNN and the fused kernel take TF32 by default)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    unet = _small().to(dtype=dtype, device=device).eval()
    x = torch.randn(batch, 16, 2, dtype=dtype, device=device)
    cond = torch.randn(batch, 10, dtype=dtype, device=device)
    want = unet(x, 7, cond)
    blocks = sum(isinstance(m, Conv1dBlock) for m in unet.modules())
    residual_blocks = sum(isinstance(m, ConditionalResidualBlock1D) for m in unet.modules())
    fused = matmul_convolutions(fuse_conv_blocks(copy.deepcopy(unet), backend))
    assert not any(isinstance(m, (Conv1dBlock, ConditionalResidualBlock1D)) for m in fused.modules())
    assert sum(isinstance(m, FusedConv1dBlock) for m in fused.modules()) == blocks == 25
    assert sum(isinstance(m, FusedResidualBlock) for m in fused.modules()) == residual_blocks == 12
    padding = fused.film_encoder.padding * fused.film_encoder.weight.shape[0]  # zero columns, aligning the product
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in unet.parameters()) + padding
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(fused(x, 7, cond), want, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="fused already"):
        fuse_conv_blocks(fused)
    with pytest.raises(TypeError, match="unet: expected a ConditionalUnet1D, got Conv1dBlock"):
        fuse_conv_blocks(Conv1dBlock(4, 8, 3))


@pytest.mark.parametrize("cond_predict_scale", [True, False])
def test_the_fused_network_has_the_same_gradients_and_traces_whole(cond_predict_scale):
    """float64 through the PyTorch reference backend: input gradients equal the plain
    network's; under torch.compile(fullgraph=True) the fused network is one graph."""
    import copy

    from fullgraph.models.unet1d import fuse_conv_blocks, matmul_convolutions

    unet = _small(cond_predict_scale=cond_predict_scale).double().eval()
    fused = matmul_convolutions(fuse_conv_blocks(copy.deepcopy(unet), "torch"))
    x = torch.randn(2, 16, 2, dtype=torch.float64, requires_grad=True)
    cond = torch.randn(2, 10, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(unet(x, 7, cond).square().sum(), (x, cond))
    got = torch.autograd.grad(fused(x, 7, cond).square().sum(), (x, cond))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, 7, cond), fused(x, 7, cond))


@pytest.mark.parametrize("fused", [False, True])
def test_conditions_computed_once_for_all_steps_give_the_same_predictions(fused):
    """``condition(timesteps, cond)`` [S, B, W]: its rows in place of each step's own
    computation (step embedding; once fused, every block's FiLM) give the same prediction."""
    import copy

    from fullgraph.models.unet1d import fuse_conv_blocks

    unet = _small().double().eval()
    if fused:
        unet = fuse_conv_blocks(copy.deepcopy(unet), "torch")
    x, cond = torch.randn(2, 16, 2, dtype=torch.float64), torch.randn(2, 10, dtype=torch.float64)
    timesteps = torch.tensor([9, 4, 0])
    rows = unet.condition(timesteps, cond)
    assert rows.shape == (3, 2, unet.condition_width)
    assert unet.condition_width == (sum(unet.film_encoder.sizes) if fused else 256 + 10)
    for t, row in zip(timesteps.tolist(), rows):
        torch.testing.assert_close(unet(x, 7, cond, condition=row), unet(x, t, cond), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"condition: expected \[B, condition_width\] = \[2, "):
        unet(x, 7, cond, condition=rows[0, :1])
    with pytest.raises(ValueError, match=r"timesteps: expected \[S\], got \(\)"):
        unet.condition(torch.tensor(3), cond)


def test_a_bf16_network_takes_and_returns_the_sample_dtype():
    unet = _small().eval()
    x, cond = torch.randn(2, 16, 2), torch.randn(2, 10)
    want = unet(x, 7, cond)
    got = unet.to(torch.bfloat16)(x, 7, cond)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0.1, atol=0.1)
