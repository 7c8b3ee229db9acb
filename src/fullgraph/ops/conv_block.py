"""Diffusion Policy's Conv1d -> GroupNorm -> Mish block as one operator:
``fullgraph.conv_groupnorm_mish`` (``torch.ops.fullgraph.conv_groupnorm_mish``).

The "triton" backend runs two kernels. (1) The convolution ("same" padding, odd kernel) as a
matrix product over (input channel, tap) pairs plus the bias, a program per batch item, tile
of output channels and tile of time steps: it writes the float32 result and, per channel
and time tile, the mean and the sum of squared deviations. (2) A program per batch item and
group combines those (Chan's parallel formula: no cancellation), normalizes, applies the
affine and Mish, and writes the input dtype. At Diffusion Policy's sizes (batch 1, 16 time
steps, up to 1024 channels) the weights are read once and the intermediate stays in L2.
The "torch" backend is ``F.conv1d``, ``F.group_norm``, ``F.mish``: the reference.

The backward is written with PyTorch operations (the convolution's through
``aten.convolution_backward``), recomputing the convolution: no fused backward kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _triton, _validate, backends
from .._triton import tl, triton

# Time steps per tile of the convolution kernel, and time tiles read at a time by the
# normalization kernel.
BLOCK_T = 64
TILE_CHUNK = 64

if triton is not None:

    @triton.jit
    def _conv_kernel(x, w, bias, y, tile_mean, tile_m2, c_in, c_out, length, tiles, taps_total,
                     KERNEL: tl.constexpr, PAD: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """y[b, c, t] = bias[c] + sum_{i, j} w[c, i, j] x[b, i, t + j - PAD] (float32), and per
        (b, c, time tile) the mean and squared deviations of y over the tile."""
        b = tl.program_id(0).to(tl.int64)
        channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        tile = tl.program_id(2)
        steps = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_C, BLOCK_T), tl.float32)
        for first in range(0, taps_total, BLOCK_K):
            rows = first + tl.arange(0, BLOCK_K)  # (input channel, tap) pairs, channel-major
            weights = tl.load(w + channels[:, None] * taps_total + rows[None, :],
                              mask=(channels[:, None] < c_out) & (rows[None, :] < taps_total), other=0.0)
            source = steps[None, :] + (rows % KERNEL)[:, None] - PAD
            inside = (rows[:, None] < taps_total) & (source >= 0) & (source < length)
            window = tl.load(x + (b * c_in + rows // KERNEL)[:, None] * length + source, mask=inside, other=0.0)
            if UPCAST:
                weights, window = weights.to(tl.float32), window.to(tl.float32)
            acc += tl.dot(weights, window, input_precision=PRECISION)
        acc += tl.load(bias + channels, mask=channels < c_out, other=0.0).to(tl.float32)[:, None]
        live = (channels[:, None] < c_out) & (steps[None, :] < length)
        tl.store(y + (b * c_out + channels)[:, None] * length + steps[None, :], acc, mask=live)
        count = tl.minimum(length - tile * BLOCK_T, BLOCK_T).to(tl.float32)
        mean = tl.sum(tl.where(live, acc, 0.0), 1) / count
        deviation = tl.where(live, acc - mean[:, None], 0.0)
        at = (b * c_out + channels) * tiles + tile
        tl.store(tile_mean + at, mean, mask=channels < c_out)
        tl.store(tile_m2 + at, tl.sum(deviation * deviation, 1), mask=channels < c_out)

    @triton.jit
    def _tile_counts(tile_ids, length, tiles, BLOCK_T: tl.constexpr):
        return tl.where(tile_ids < tiles, tl.minimum(length - tile_ids * BLOCK_T, BLOCK_T), 0).to(tl.float32)

    @triton.jit
    def _norm_mish_kernel(y, tile_mean, tile_m2, gamma, beta, out, c_out, length, tiles, per_group, eps,
                          BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK: tl.constexpr):
        """out[b, c, t] = mish(gamma[c] (y - mean) / sqrt(var + eps) + beta[c]) over group g."""
        b = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        channels = group * per_group + tl.arange(0, BLOCK_G)
        in_group = tl.arange(0, BLOCK_G) < per_group
        rows = (b * c_out + channels) * tiles
        total = (per_group * length).to(tl.float32)
        weighted = tl.zeros((BLOCK_G, CHUNK), tl.float32)
        for first in range(0, tiles, CHUNK):
            ids = first + tl.arange(0, CHUNK)
            ok = in_group[:, None] & (ids < tiles)[None, :]
            means = tl.load(tile_mean + rows[:, None] + ids[None, :], mask=ok, other=0.0)
            weighted += means * _tile_counts(ids, length, tiles, BLOCK_T)[None, :]
        mean = tl.sum(tl.sum(weighted, 1), 0) / total
        spread = tl.zeros((BLOCK_G, CHUNK), tl.float32)
        for first in range(0, tiles, CHUNK):
            ids = first + tl.arange(0, CHUNK)
            ok = in_group[:, None] & (ids < tiles)[None, :]
            means = tl.load(tile_mean + rows[:, None] + ids[None, :], mask=ok, other=0.0)
            m2 = tl.load(tile_m2 + rows[:, None] + ids[None, :], mask=ok, other=0.0)
            gap = tl.where(ok, means - mean, 0.0)
            spread += m2 + _tile_counts(ids, length, tiles, BLOCK_T)[None, :] * gap * gap
        inverse = 1.0 / tl.sqrt(tl.sum(tl.sum(spread, 1), 0) / total + eps)
        scale = tl.load(gamma + channels, mask=in_group, other=0.0).to(tl.float32) * inverse
        shift = tl.load(beta + channels, mask=in_group, other=0.0).to(tl.float32) - mean * scale
        for first in range(0, length, BLOCK_T):
            steps = first + tl.arange(0, BLOCK_T)
            live = in_group[:, None] & (steps < length)[None, :]
            at = (b * c_out + channels)[:, None] * length + steps[None, :]
            z = tl.load(y + at, mask=live, other=0.0) * scale[:, None] + shift[:, None]
            # mish(z) = z tanh(softplus(z)); with n = e^z, tanh(log(1 + n)) = n (n + 2) / (n (n + 2) + 2),
            # free of cancellation for z far below 0, and 1 from z = 20 on (PyTorch's threshold).
            n = tl.exp(tl.minimum(z, 20.0))
            squashed = tl.where(z >= 20.0, 1.0, n * (n + 2.0) / (n * (n + 2.0) + 2.0))
            tl.store(out + at, (z * squashed).to(out.dtype.element_ty), mask=live)


def reference(x, weight, bias, gamma, beta, groups: int, eps: float):
    """The block in PyTorch: Conv1d ("same" padding), GroupNorm, Mish."""
    return F.mish(F.group_norm(F.conv1d(x, weight, bias, padding=weight.shape[-1] // 2), groups, gamma, beta, eps))


def _triton_block(x, weight, bias, gamma, beta, groups: int, eps: float):
    batch, c_in, length = x.shape
    c_out, _, kernel = weight.shape
    out = torch.empty((batch, c_out, length), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    tiles = triton.cdiv(length, BLOCK_T)
    y = torch.empty((batch, c_out, length), dtype=torch.float32, device=x.device)
    tile_mean = torch.empty((batch, c_out, tiles), dtype=torch.float32, device=x.device)
    tile_m2 = torch.empty_like(tile_mean)
    block_c = 32 if c_out >= 32 else 16
    precision = "tf32" if x.dtype == torch.float32 and torch.backends.cudnn.allow_tf32 and x.is_cuda else "ieee"
    _conv_kernel[(batch, triton.cdiv(c_out, block_c), tiles)](
        x, weight.reshape(c_out, c_in * kernel), bias, y, tile_mean, tile_m2, c_in, c_out, length, tiles,
        c_in * kernel, KERNEL=kernel, PAD=kernel // 2, BLOCK_C=block_c, BLOCK_T=BLOCK_T, BLOCK_K=32,
        # Triton 3.6's interpreter (CPU tests) returns garbage from a bfloat16 tl.dot: products in float32 there.
        PRECISION=precision, UPCAST=_triton.INTERPRETED and x.dtype == torch.bfloat16, num_warps=4)
    per_group = c_out // groups
    _norm_mish_kernel[(batch, groups)](
        y, tile_mean, tile_m2, gamma, beta, out, c_out, length, tiles, per_group, float(eps),
        BLOCK_G=triton.next_power_of_2(per_group), BLOCK_T=BLOCK_T, CHUNK=min(TILE_CHUNK, triton.next_power_of_2(tiles)),
        num_warps=4)
    return out


BACKENDS = backends.family(
    "conv_groupnorm_mish",
    backends.Backend("triton", ops=("conv_groupnorm_mish",), devices=_triton.devices(), auto_devices=(),
                     dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                     available=_triton.available, implementation=_triton_block,
                     note='computes in float32 (use backend="torch" for float64)'),
    backends.Backend("torch", ops=("conv_groupnorm_mish",), devices=(backends.ANY_DEVICE,),
                     auto_devices=(backends.ANY_DEVICE,), implementation=reference),
)


def _check(x, weight, bias, gamma, beta, groups, eps) -> None:
    for name, value in (("x", x), ("weight", weight), ("bias", bias), ("gamma", gamma), ("beta", beta)):
        _validate.floating(name, value)
        if name != "x":
            _validate.same_dtype_and_device(name, value, "x", x)
    _validate.rank("x", x, (3,), "[B, C_in, T]")
    if x.shape[2] < 1:
        raise ValueError(f"x: expected at least one time step, got shape {list(x.shape)}")
    _validate.rank("weight", weight, (3,), "[C_out, C_in, kernel]")
    c_out, c_in, kernel = weight.shape
    if c_in != x.shape[1]:
        raise ValueError(f"weight: expected [C_out, C_in = {x.shape[1]}, kernel] for x {list(x.shape)}, got "
                         f"{list(weight.shape)}")
    if kernel % 2 == 0:
        raise ValueError(f"weight: expected an odd kernel size (same padding), got {kernel}")
    for name, value in (("bias", bias), ("gamma", gamma), ("beta", beta)):
        if tuple(value.shape) != (c_out,):
            raise ValueError(f"{name}: expected [C_out] = [{c_out}], got {list(value.shape)}")
    groups = _validate.integer("groups", groups, minimum=1)
    if c_out % groups:
        raise ValueError(f"groups: expected a divisor of C_out = {c_out}, got {groups}")
    _validate.real("eps", eps, minimum=0.0, strict=True)


@torch.library.custom_op("fullgraph::conv_groupnorm_mish", mutates_args=())
def conv_groupnorm_mish_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gamma: torch.Tensor,
                           beta: torch.Tensor, groups: int, eps: float, backend: str) -> torch.Tensor:
    _check(x, weight, bias, gamma, beta, groups, eps)
    run = BACKENDS.resolve(backend, "conv_groupnorm_mish", x.device, x.dtype, argument="x").implementation
    return run(x.contiguous(), weight.contiguous(), bias.contiguous(), gamma.contiguous(), beta.contiguous(),
               groups, eps)


@conv_groupnorm_mish_op.register_fake
def _(x, weight, bias, gamma, beta, groups, eps, backend):
    return x.new_empty((x.shape[0], weight.shape[0], x.shape[2]))


def _setup(ctx, inputs, output):
    x, weight, bias, gamma, beta, groups, eps, _ = inputs
    ctx.groups, ctx.eps = groups, eps
    ctx.save_for_backward(x, weight, bias, gamma, beta)


def _backward(ctx, grad):
    """The block's gradients from its forward recomputed in PyTorch (float32, or float64)."""
    x, weight, bias, gamma, beta = ctx.saved_tensors
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xc, wc, gc = x.to(compute), weight.to(compute), gamma.to(compute)
    pad = weight.shape[-1] // 2
    y = F.conv1d(xc, wc, bias.to(compute), padding=pad)
    batch, channels, length = y.shape
    grouped = y.reshape(batch, ctx.groups, -1)
    mean = grouped.mean(-1, keepdim=True)
    inverse = torch.rsqrt(grouped.var(-1, unbiased=False, keepdim=True) + ctx.eps)
    normalized = ((grouped - mean) * inverse).reshape_as(y)
    z = normalized * gc[:, None] + beta.to(compute)[:, None]
    squashed = torch.tanh(F.softplus(z))
    d_z = grad.to(compute) * (squashed + z * torch.sigmoid(z) * (1 - squashed * squashed))
    d_gamma, d_beta = (d_z * normalized).sum((0, 2)), d_z.sum((0, 2))
    d_norm = (d_z * gc[:, None]).reshape(batch, ctx.groups, -1)
    flat = normalized.reshape(batch, ctx.groups, -1)
    d_y = inverse * (d_norm - d_norm.mean(-1, keepdim=True) - flat * (d_norm * flat).mean(-1, keepdim=True))
    d_x, d_weight, d_bias = torch.ops.aten.convolution_backward(
        d_y.reshape_as(y), xc, wc, [channels], [1], [pad], [1], False, [0], 1, list(ctx.needs_input_grad[:3]))
    grads = (d_x, d_weight, d_bias, d_gamma, d_beta)
    return (*(g.to(x.dtype) if g is not None and need else None
              for g, need in zip(grads, ctx.needs_input_grad[:5])), None, None, None)


conv_groupnorm_mish_op.register_autograd(_backward, setup_context=_setup)


def conv_groupnorm_mish(x, weight, bias, gamma, beta, groups: int, *, eps: float = 1e-5, backend: str = "auto"):
    """Conv1d ("same" padding) -> GroupNorm(groups) -> Mish in one operator.

    Args:
        x: [B, C_in, T] floating. weight: [C_out, C_in, kernel] (odd kernel), bias: [C_out],
            gamma, beta: [C_out] (GroupNorm's affine); one dtype and device.
        groups: GroupNorm's groups, a divisor of C_out. eps: GroupNorm's epsilon, > 0.
        backend: "torch" (F.conv1d, F.group_norm, F.mish), "triton" (two fused kernels,
            float32 arithmetic, CUDA; see the module docstring) or "auto" ("torch" until the
            fused kernels are measured faster on a GPU).

    Returns:
        [B, C_out, T] in x's dtype; differentiable in x, weight, bias, gamma and beta.

    Example:
        >>> import torch, fullgraph
        >>> x, w = torch.randn(2, 4, 16), torch.randn(8, 4, 5)
        >>> ones, zeros = torch.ones(8), torch.zeros(8)
        >>> fullgraph.conv_groupnorm_mish(x, w, zeros, ones, zeros, groups=2).shape
        torch.Size([2, 8, 16])
    """
    _check(x, weight, bias, gamma, beta, groups, eps)
    backend = BACKENDS.resolve(backend, "conv_groupnorm_mish", x.device, x.dtype, argument="x").name
    return torch.ops.fullgraph.conv_groupnorm_mish(x, weight, bias, gamma, beta, groups, eps, backend)
