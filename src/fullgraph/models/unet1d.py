"""Diffusion Policy's 1-D conditional U-Net (the Diffusion Policy series's network), in plain PyTorch.

The denoiser predicts the noise in an action sequence (B, horizon, action_dim) given the
diffusion step and a global condition (the encoded observations). Residual blocks of
Conv1d -> GroupNorm -> Mish, each conditioned by FiLM (a per-channel scale and bias computed
from the step embedding and the condition), a down path, two middle blocks and an up path
with skip connections. Defaults are the sizes of the tutorial's series.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.conv_block import conv_groupnorm_mish, epilogue


class SinusoidalStepEmbedding(nn.Module):
    """[B] diffusion steps -> [B, dim] sin/cos features at geometric frequencies."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, steps: torch.Tensor) -> torch.Tensor:
        half = self.dim // 2
        frequencies = torch.exp(torch.arange(half, device=steps.device) * (-math.log(10000) / (half - 1)))
        angles = steps.float()[:, None] * frequencies[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Conv1dBlock(nn.Sequential):
    """Conv1d (same padding) -> GroupNorm -> Mish on [B, C, T]."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, groups: int = 8):
        super().__init__(nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
                         nn.GroupNorm(groups, out_channels), nn.Mish())


class ConditionalResidualBlock1D(nn.Module):
    """Two Conv1dBlocks with FiLM between them (scale and bias from the condition, or a bias
    only) and a 1x1 convolution on the skip path when the channel count changes."""

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int = 3, groups: int = 8,
                 cond_predict_scale: bool = True):
        super().__init__()
        self.out_channels, self.cond_predict_scale = out_channels, cond_predict_scale
        self.blocks = nn.ModuleList([Conv1dBlock(in_channels, out_channels, kernel_size, groups),
                                     Conv1dBlock(out_channels, out_channels, kernel_size, groups)])
        self.cond_encoder = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, out_channels * (2 if cond_predict_scale else 1)))
        self.residual_conv = nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        out = self.blocks[0](x)
        film = self.cond_encoder(cond)[:, :, None]
        if self.cond_predict_scale:
            scale, bias = film[:, : self.out_channels], film[:, self.out_channels:]
            out = scale * out + bias
        else:
            out = out + film
        return self.blocks[1](out) + self.residual_conv(x)


class ConditionalUnet1D(nn.Module):
    """``unet(sample [B, horizon, action_dim], timestep, global_cond [B, global_cond_dim])
    -> predicted noise [B, horizon, action_dim]``; timestep an int, a 0-d or a [B] tensor.
    Inputs are cast to the network's dtype (e.g. after ``.to(torch.bfloat16)``) and the
    prediction is returned in the sample's dtype.
    The horizon must be divisible by 2 ** (len(down_dims) - 1)."""

    def __init__(self, action_dim: int = 2, global_cond_dim: int = 1028, step_embed_dim: int = 256,
                 down_dims: tuple[int, ...] = (256, 512, 1024), kernel_size: int = 5, groups: int = 8,
                 cond_predict_scale: bool = True, horizon: int = 16):
        super().__init__()
        self.action_dim, self.global_cond_dim, self.horizon = action_dim, global_cond_dim, horizon
        self.step_embedding = SinusoidalStepEmbedding(step_embed_dim)
        self.step_encoder = nn.Sequential(nn.Linear(step_embed_dim, step_embed_dim * 4), nn.Mish(),
                                          nn.Linear(step_embed_dim * 4, step_embed_dim))
        cond_dim = step_embed_dim + global_cond_dim
        dims = [action_dim, *down_dims]
        pairs = list(zip(dims[:-1], dims[1:]))

        def block(i, o):
            return ConditionalResidualBlock1D(i, o, cond_dim, kernel_size, groups, cond_predict_scale)

        self.down = nn.ModuleList(
            nn.ModuleList([block(i, o), block(o, o), nn.Conv1d(o, o, 3, 2, 1) if k < len(pairs) - 1 else nn.Identity()])
            for k, (i, o) in enumerate(pairs))
        self.mid = nn.ModuleList([block(dims[-1], dims[-1]), block(dims[-1], dims[-1])])
        self.up = nn.ModuleList(
            nn.ModuleList([block(o * 2, i), block(i, i), nn.ConvTranspose1d(i, i, 4, 2, 1)])
            for i, o in reversed(pairs[1:]))
        self.final = nn.Sequential(Conv1dBlock(down_dims[0], down_dims[0], kernel_size, groups),
                                   nn.Conv1d(down_dims[0], action_dim, 1))
        # Set by fuse_conv_blocks: every residual block's FiLM from one product; the blocks then
        # take their FiLM instead of the condition.
        self.film_encoder: FiLMEncoder | None = None

    @property
    def condition_width(self) -> int:
        """W of a ``condition`` row: the FiLM of all residual blocks once fused, else the
        step embedding joined to the global condition."""
        if self.film_encoder is not None:
            return sum(self.film_encoder.sizes)
        return self.step_encoder[-1].out_features + self.global_cond_dim

    def condition(self, timesteps: torch.Tensor, global_cond: torch.Tensor) -> torch.Tensor:
        """What the network computes from the diffusion step and the global condition alone,
        for all ``timesteps`` [S] at once: [S, B, W] (``condition_width``) for global_cond
        [B, global_cond_dim]; row s serves ``forward(..., condition=rows[s])``. A sampling
        loop computes it once for all its steps (one product for every step's FiLM)."""
        if timesteps.dim() != 1:
            raise ValueError(f"timesteps: expected [S], got {tuple(timesteps.shape)}")
        self._check_cond(global_cond, global_cond.shape[0])
        count, batch = timesteps.shape[0], global_cond.shape[0]
        steps = timesteps.to(global_cond.device)[:, None].expand(count, batch).reshape(-1)
        rows = self._encode(steps, global_cond.expand(count, *global_cond.shape).reshape(count * batch, -1))
        return rows.reshape(count, batch, -1)

    def _encode(self, steps: torch.Tensor, global_cond: torch.Tensor) -> torch.Tensor:
        """[N] steps and [N, global_cond_dim] -> [N, condition_width]."""
        dtype = self.step_encoder[0].weight.dtype  # inputs are cast to the network's dtype
        cond = torch.cat([self.step_encoder(self.step_embedding(steps).to(dtype)), global_cond.to(dtype)], dim=-1)
        return cond if self.film_encoder is None else self.film_encoder(cond)

    def _check_cond(self, global_cond: torch.Tensor, batch: int) -> None:
        if global_cond.shape != (batch, self.global_cond_dim):
            raise ValueError(f"global_cond: expected [{batch}, {self.global_cond_dim}], "
                             f"got {tuple(global_cond.shape)}")

    def forward(self, sample: torch.Tensor, timestep, global_cond: torch.Tensor,
                condition: torch.Tensor | None = None) -> torch.Tensor:
        """``condition``: this step's row of ``self.condition(...)`` [B, condition_width], in
        place of computing it from ``timestep`` and ``global_cond``."""
        if sample.dim() != 3 or sample.shape[-1] != self.action_dim:
            raise ValueError(f"sample: expected [B, horizon, {self.action_dim}], got {tuple(sample.shape)}")
        batch = sample.shape[0]
        self._check_cond(global_cond, batch)
        if condition is None:
            steps = torch.as_tensor(timestep, device=sample.device)
            condition = self._encode(steps.reshape(-1).expand(batch), global_cond)
        elif condition.shape != (batch, self.condition_width):
            raise ValueError(f"condition: expected [B, condition_width] = [{batch}, {self.condition_width}], "
                             f"got {tuple(condition.shape)}")
        dtype = self.step_encoder[0].weight.dtype
        condition = condition.to(dtype)
        x = sample.transpose(1, 2).to(dtype)  # [B, action_dim, horizon]
        residual_blocks = 2 * len(self.down) + len(self.mid) + 2 * len(self.up)
        conditions = iter([condition] * residual_blocks if self.film_encoder is None
                          else condition.split(self.film_encoder.sizes, dim=1))
        skips = []
        for first, second, downsample in self.down:
            x = first(x, next(conditions))
            x = second(x, next(conditions))
            skips.append(x)
            x = downsample(x)
        for block in self.mid:
            x = block(x, next(conditions))
        for first, second, upsample in self.up:
            x = first(torch.cat([x, skips.pop()], dim=1), next(conditions))
            x = upsample(second(x, next(conditions)))
        return self.final(x).transpose(1, 2).to(sample.dtype)


class MatmulConv1d(nn.Module):
    """A Conv1d as unfold + one matrix product: at batch 1 over a few time steps, cuDNN
    spends most of its time converting layouts; a product streams the weights once."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        if conv.groups != 1 or conv.dilation != (1,) or not isinstance(conv.padding, tuple):
            raise ValueError(f"conv: expected groups=1, dilation=1 and numeric padding, got {conv}")
        self.kernel, self.stride, self.padding = conv.kernel_size[0], conv.stride[0], conv.padding[0]
        self.weight = nn.Parameter(conv.weight.detach().flatten(1).clone())  # [out, in * kernel]
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return matmul_conv1d(x, self.weight, self.bias, self.kernel, self.stride, self.padding)


def matmul_conv1d(x, weight, bias, kernel: int, stride: int = 1, padding: int = 0) -> torch.Tensor:
    """Conv1d of x [B, in, T] by weight [out, in * kernel] (flattened) as unfold + one product."""
    windows = F.pad(x, (padding, padding)).unfold(2, kernel, stride)  # [B, in, T', kernel]
    return F.linear(windows.transpose(1, 2).flatten(2), weight, bias).transpose(1, 2)


class MatmulConvTranspose1d(nn.Module):
    """A ConvTranspose1d as one matrix product into per-input-step columns, then their
    overlapping sum (``fold``)."""

    def __init__(self, conv: nn.ConvTranspose1d):
        super().__init__()
        if conv.groups != 1 or conv.dilation != (1,) or conv.output_padding != (0,):
            raise ValueError(f"conv: expected groups=1, dilation=1 and no output padding, got {conv}")
        self.kernel, self.stride, self.padding = conv.kernel_size[0], conv.stride[0], conv.padding[0]
        self.out_channels = conv.out_channels
        self.weight = nn.Parameter(conv.weight.detach().flatten(1).t().contiguous())  # [out * kernel, in]
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = (x.shape[2] - 1) * self.stride - 2 * self.padding + self.kernel
        columns = torch.matmul(self.weight, x)  # [B, out * kernel, T]
        y = F.fold(columns, (1, length), (1, self.kernel), padding=(0, self.padding), stride=(1, self.stride))
        y = y.squeeze(2)
        return y if self.bias is None else y + self.bias[:, None]


def matmul_convolutions(module: nn.Module) -> nn.Module:
    """Replace (in place) every Conv1d and ConvTranspose1d in ``module`` by its matrix-product
    form: the same function, several times faster at Diffusion Policy's batch-1 sizes."""
    for name, child in module.named_children():
        if isinstance(child, nn.Conv1d):
            setattr(module, name, MatmulConv1d(child))
        elif isinstance(child, nn.ConvTranspose1d):
            setattr(module, name, MatmulConvTranspose1d(child))
        else:
            matmul_convolutions(child)
    return module


class FusedConv1dBlock(nn.Module):
    """A Conv1dBlock (Conv1d -> GroupNorm -> Mish) as one operator,
    ``fullgraph.conv_groupnorm_mish``, with the block's parameters; ``scale``, ``shift``
    [B, C_out] and ``residual`` [B, C_out, T] (or [B, C_res, T] through a 1x1 convolution's
    ``residual_weight`` [C_out, C_res], ``residual_bias``) are its optional epilogue. Beyond
    ``FUSED_MAX_COLUMNS`` (B * T) the same function as a product (``matmul_conv1d``),
    GroupNorm and Mish, which torch.compile fuses better there: one block with FiLM, bf16, H100:
    batch 1 (4-16 columns) fused 3.3-8.7 us
    against the compiled product's 6.5-14.1; batch 8, 1024 channels, T = 4 (32 columns) 30.1 against 13.0."""

    FUSED_MAX_COLUMNS = 16

    def __init__(self, block: Conv1dBlock, backend: str = "auto"):
        super().__init__()
        conv, norm = block[0], block[1]
        self.weight = nn.Parameter(conv.weight.detach().clone())
        self.bias = nn.Parameter(conv.bias.detach().clone())
        self.gamma = nn.Parameter(norm.weight.detach().clone())
        self.beta = nn.Parameter(norm.bias.detach().clone())
        self.groups, self.eps, self.backend = norm.num_groups, norm.eps, backend

    def forward(self, x: torch.Tensor, scale=None, shift=None, residual=None, residual_weight=None,
                residual_bias=None) -> torch.Tensor:
        if x.shape[0] * x.shape[2] > self.FUSED_MAX_COLUMNS:
            kernel = self.weight.shape[-1]
            y = matmul_conv1d(x, self.weight.flatten(1), self.bias, kernel, padding=kernel // 2)
            return epilogue(F.mish(F.group_norm(y, self.groups, self.gamma, self.beta, self.eps)), scale, shift,
                            residual, residual_weight, residual_bias)
        return conv_groupnorm_mish(x, self.weight, self.bias, self.gamma, self.beta, self.groups, eps=self.eps,
                                   scale=scale, shift=shift, residual=residual, residual_weight=residual_weight,
                                   residual_bias=residual_bias, backend=self.backend)


class FiLMEncoder(nn.Module):
    """Every residual block's FiLM from the condition in one product: Mish once, then the
    blocks' Linear layers stacked: per block [B, (2) C_out] (``sizes``), in the blocks' call
    order. The product's inner size is padded with zeros to a multiple of
    ``ALIGN`` (cond_dim 1284 at the seed size): cuBLAS then takes a GEMM kernel for the 37 MB
    of weights at batch 1, 16.5 us a step in the graphed U-Net instead of its GEMV's 36 (H100)."""

    ALIGN = 64

    def __init__(self, encoders: list[nn.Sequential]):
        super().__init__()
        linears = [encoder[1] for encoder in encoders]
        self.sizes = [linear.out_features for linear in linears]
        weight = torch.cat([linear.weight.detach() for linear in linears])
        self.padding = -weight.shape[1] % self.ALIGN
        self.weight = nn.Parameter(F.pad(weight, (0, self.padding)))
        self.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]))

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        """[N, cond_dim] -> [N, sum(sizes)], the blocks' FiLM side by side."""
        return F.linear(F.pad(F.mish(cond), (0, self.padding)), self.weight, self.bias)


class FusedResidualBlock(nn.Module):
    """A ConditionalResidualBlock1D as two fused blocks: FiLM in the first one's epilogue, the
    skip path (its 1x1 convolution, where the channel count changes) in the second's. Takes
    ``(x, film)``, its FiLM from a FiLMEncoder."""

    def __init__(self, block: ConditionalResidualBlock1D, backend: str = "auto"):
        super().__init__()
        self.out_channels, self.cond_predict_scale = block.out_channels, block.cond_predict_scale
        self.first, self.second = (FusedConv1dBlock(b, backend) for b in block.blocks)
        conv = None if isinstance(block.residual_conv, nn.Identity) else block.residual_conv  # a 1x1 Conv1d
        self.residual_weight = None if conv is None else nn.Parameter(conv.weight.detach()[:, :, 0].clone())
        self.residual_bias = None if conv is None or conv.bias is None else nn.Parameter(conv.bias.detach().clone())

    def forward(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        if self.cond_predict_scale:
            out = self.first(x, scale=film[:, : self.out_channels], shift=film[:, self.out_channels:])
        else:
            out = self.first(x, shift=film)
        return self.second(out, residual=x, residual_weight=self.residual_weight, residual_bias=self.residual_bias)


def fuse_conv_blocks(unet: ConditionalUnet1D, backend: str = "auto") -> ConditionalUnet1D:
    """Rewrite (in place) a ConditionalUnet1D for speed, the same function: its residual
    blocks as FusedResidualBlocks on ``backend`` ("triton": the fused kernels), the final
    Conv1dBlock as a FusedConv1dBlock, and the blocks' FiLM encoders as one FiLMEncoder.
    Apply it before ``matmul_convolutions``, which then converts the remaining convolutions."""
    if not isinstance(unet, ConditionalUnet1D):
        raise TypeError(f"unet: expected a ConditionalUnet1D, got {type(unet).__name__}")
    if unet.film_encoder is not None:
        raise ValueError("unet: its blocks are fused already")
    encoders = [m.cond_encoder for m in unet.modules() if isinstance(m, ConditionalResidualBlock1D)]

    def replace(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, ConditionalResidualBlock1D):
                setattr(module, name, FusedResidualBlock(child, backend))
            elif isinstance(child, Conv1dBlock):
                setattr(module, name, FusedConv1dBlock(child, backend))
            else:
                replace(child)

    replace(unet)
    unet.film_encoder = FiLMEncoder(encoders)
    return unet
