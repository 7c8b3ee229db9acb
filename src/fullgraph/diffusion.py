"""DDPM sampling for Diffusion Policy (the Diffusion Policy series): the whole denoising loop, eager or
replayed from one CUDA graph.

    unet = fullgraph.models.ConditionalUnet1D().cuda().eval()
    actions = fullgraph.diffusion.sample(unet, global_cond)   # [B, horizon, action_dim]

With ``graphed=True`` (on CUDA) the first call per input signature captures all ``steps``
U-Net calls and fused denoise steps in one CUDA graph (``fullgraph.graphs``); later calls
copy the new starting noise, step noises and condition in and replay it: no host work per
step. The noise is drawn up front from ``generator``, so eager and graphed runs from one
seed give the same actions (to float rounding).
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import _validate
from .graphs import graphed as _graphed
from .ops.ddpm import ddpm_step, squaredcos_cap_v2

_GRAPHED_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def denoise(unet, x, noise, global_cond, alphas_cumprod, clip_sample: bool = True, step=ddpm_step):
    """The loop: x [B, H, A] from t = T - 1 down to 0, noise [T, B, H, A] per step; ``step``
    is the denoise step (the fused ``ddpm_step``, or ``ops.ddpm.reference``)."""
    timesteps = torch.arange(noise.shape[0] - 1, -1, -1, device=x.device)
    for i in range(noise.shape[0]):
        t = timesteps[i]
        x = step(unet(x, t, global_cond), x, t, alphas_cumprod, noise[i], clip_sample=clip_sample)
    return x


def _graphed_loop(unet):
    if unet not in _GRAPHED_LOOPS:
        _GRAPHED_LOOPS[unet] = _graphed(functools.partial(denoise, unet), max_graphs=4, warmup=1, clone_outputs=True)
    return _GRAPHED_LOOPS[unet]


@torch.no_grad()
def sample(unet, global_cond, *, steps: int = 100, generator: torch.Generator | None = None, graphed: bool = True,
           alphas_cumprod: torch.Tensor | None = None, clip_sample: bool = True) -> torch.Tensor:
    """Sample action sequences with ``steps`` DDPM steps.

    Args:
        unet: a denoiser ``unet(sample, timestep, global_cond)`` with ``horizon`` and
            ``action_dim`` attributes (``fullgraph.models.ConditionalUnet1D``).
        global_cond: [B, global_cond_dim] observation features; sets batch, device, dtype.
        steps: diffusion steps (the schedule's length). generator: for the noise, on
            global_cond's device. graphed: replay the whole loop from one CUDA graph (CUDA only).
        alphas_cumprod: [steps] schedule (default: squaredcos_cap_v2). clip_sample: clip x0.

    Returns:
        [B, horizon, action_dim] actions, a new tensor.
    """
    _validate.floating("global_cond", global_cond)
    _validate.rank("global_cond", global_cond, (2,), "[B, global_cond_dim]")
    steps = _validate.integer("steps", steps, 1)
    device, dtype = global_cond.device, global_cond.dtype
    if alphas_cumprod is None:
        alphas_cumprod = squaredcos_cap_v2(steps, device=device)
    if alphas_cumprod.shape != (steps,):
        raise ValueError(f"alphas_cumprod: expected [{steps}] (one per step), got {tuple(alphas_cumprod.shape)}")
    shape = (global_cond.shape[0], unet.horizon, unet.action_dim)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    noise = torch.randn((steps, *shape), generator=generator, device=device, dtype=dtype)
    if graphed and device.type == "cuda":
        return _graphed_loop(unet)(x, noise, global_cond, alphas_cumprod, clip_sample)
    return denoise(unet, x, noise, global_cond, alphas_cumprod, clip_sample)
