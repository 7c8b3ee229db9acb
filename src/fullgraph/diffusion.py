"""DDPM and DDIM sampling for Diffusion Policy (the Diffusion Policy series): the whole denoising
loop, eager or replayed from one CUDA graph.

    unet = fullgraph.models.ConditionalUnet1D().cuda().eval()
    actions = fullgraph.diffusion.sample(unet, global_cond)   # [B, horizon, action_dim]

With ``graphed=True`` (on CUDA) the first call per input signature captures all ``steps``
U-Net calls and fused denoise steps in one CUDA graph (``fullgraph.graphs``); later calls
copy the new starting noise, step noises and condition in and replay it: no host work per
step. The noise is drawn up front from ``generator``, so eager and graphed runs from one
seed give the same actions (to float rounding). A network with a ``condition(timesteps,
global_cond)`` method (``ConditionalUnet1D``) has what depends on the step and the condition
alone (the step embedding; once fused, every block's FiLM) computed once for all steps, and
each call takes its row (``condition=``).
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import _validate
from .graphs import graphed as _graphed
from .ops.ddpm import ddim_step, ddim_timesteps, ddpm_step, squaredcos_cap_v2

_GRAPHED_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _denoiser(unet, timesteps, global_cond, condition_once: bool):
    """``predict(i, x)``: the network at step i of ``timesteps`` [S]; with ``condition_once``,
    the rows of ``unet.condition`` computed here once where the network has that method."""
    if not (condition_once and hasattr(unet, "condition")):
        return lambda i, x: unet(x, timesteps[i], global_cond)
    conditions = unet.condition(timesteps, global_cond)
    return lambda i, x: unet(x, timesteps[i], global_cond, condition=conditions[i])


def denoise(unet, x, noise, global_cond, alphas_cumprod, clip_sample: bool = True, step=ddpm_step,
            condition_once: bool = True):
    """The loop: x [B, H, A] from t = T - 1 down to 0, noise [T, B, H, A] per step; ``step``
    is the denoise step (the fused ``ddpm_step``, or ``ops.ddpm.reference``);
    ``condition_once=False`` calls the network as ``unet(x, t, global_cond)`` at every step."""
    timesteps = torch.arange(noise.shape[0] - 1, -1, -1, device=x.device)
    predict = _denoiser(unet, timesteps, global_cond, condition_once)
    for i in range(noise.shape[0]):
        x = step(predict(i, x), x, timesteps[i], alphas_cumprod, noise[i], clip_sample=clip_sample)
    return x


def denoise_ddim(unet, x, global_cond, alphas_cumprod, timesteps, clip_sample: bool = True,
                 condition_once: bool = True):
    """The deterministic DDIM loop (eta = 0): x [B, H, A] through the descending
    ``timesteps`` [S] int64 on the device (``ops.ddpm.ddim_timesteps``), the last step to
    the final alpha; ``condition_once`` as in ``denoise``."""
    previous = torch.cat([timesteps[1:], timesteps.new_full((1,), -1)])
    predict = _denoiser(unet, timesteps, global_cond, condition_once)
    for i in range(timesteps.shape[0]):
        x = ddim_step(predict(i, x), x, timesteps[i], previous[i], alphas_cumprod, clip_sample=clip_sample)
    return x


LOOPS = {"ddpm": denoise, "ddim": denoise_ddim}


class DDIMSampler(torch.nn.Module):
    """The deterministic DDIM loop (``denoise_ddim``) as a module, for export: x [B, horizon,
    action_dim] starting noise and global_cond [B, global_cond_dim] -> the actions, ``steps``
    steps through ``train_steps`` (squaredcos_cap_v2's schedule); the schedule and timesteps
    are buffers."""

    def __init__(self, unet: torch.nn.Module, steps: int = 10, train_steps: int = 100, clip_sample: bool = True):
        super().__init__()
        self.unet, self.clip_sample = unet, clip_sample
        self.register_buffer("alphas_cumprod", squaredcos_cap_v2(train_steps))
        self.register_buffer("timesteps", ddim_timesteps(train_steps, steps))

    def forward(self, x: torch.Tensor, global_cond: torch.Tensor) -> torch.Tensor:
        return denoise_ddim(self.unet, x, global_cond, self.alphas_cumprod, self.timesteps, self.clip_sample)


def decompositions() -> dict:
    """{operator: its PyTorch form} for the denoise steps, for
    ``ExportedProgram.run_decompositions``: a program without fullgraph's operators, whose
    AOTInductor package runs in a process without Python (docs/deploy.md)."""
    from .ops import ddpm

    return {torch.ops.fullgraph.ddpm_step.default: lambda *args: ddpm.reference(*args[:-1]),
            torch.ops.fullgraph.ddim_step.default: lambda *args: ddpm.ddim_reference(*args[:-1])}


def _graphed_loop(unet, scheduler: str):
    loops = _GRAPHED_LOOPS.setdefault(unet, {})
    if scheduler not in loops:
        loops[scheduler] = _graphed(functools.partial(LOOPS[scheduler], unet), max_graphs=4, warmup=1,
                                    clone_outputs=True)
    return loops[scheduler]


@torch.no_grad()
def sample(unet, global_cond, *, steps: int = 100, generator: torch.Generator | None = None, graphed: bool = True,
           alphas_cumprod: torch.Tensor | None = None, clip_sample: bool = True, scheduler: str = "ddpm",
           train_steps: int = 100) -> torch.Tensor:
    """Sample action sequences with ``steps`` DDPM or DDIM steps.

    Args:
        unet: a denoiser ``unet(sample, timestep, global_cond)`` with ``horizon`` and
            ``action_dim`` attributes (``fullgraph.models.ConditionalUnet1D``).
        global_cond: [B, global_cond_dim] observation features; sets batch, device, dtype.
        steps: denoising steps (DDPM: the schedule's length; DDIM: steps through a schedule
            of ``train_steps``, as Diffusion Policy samples on robots: 10 of 100).
            generator: for the noise, on global_cond's device. graphed: replay the whole loop
            from one CUDA graph (CUDA only; a new ``steps`` captures once more).
        alphas_cumprod: the schedule, [steps] for DDPM, [train_steps] for DDIM (default:
            squaredcos_cap_v2). clip_sample: clip x0. scheduler: "ddpm" or "ddim" (eta = 0).

    Returns:
        [B, horizon, action_dim] actions, a new tensor.
    """
    _validate.floating("global_cond", global_cond)
    _validate.rank("global_cond", global_cond, (2,), "[B, global_cond_dim]")
    steps = _validate.integer("steps", steps, 1)
    scheduler = _validate.choice("scheduler", scheduler, tuple(LOOPS))
    length = steps if scheduler == "ddpm" else _validate.integer("train_steps", train_steps, 1)
    device, dtype = global_cond.device, global_cond.dtype
    if alphas_cumprod is None:
        alphas_cumprod = squaredcos_cap_v2(length, device=device)
    if alphas_cumprod.shape != (length,):
        what = "one per step" if scheduler == "ddpm" else "one per training step"
        raise ValueError(f"alphas_cumprod: expected [{length}] ({what}), got {tuple(alphas_cumprod.shape)}")
    shape = (global_cond.shape[0], unet.horizon, unet.action_dim)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if scheduler == "ddim":
        arguments = (x, global_cond, alphas_cumprod, ddim_timesteps(length, steps, device=device), clip_sample)
    else:
        noise = torch.randn((steps, *shape), generator=generator, device=device, dtype=dtype)
        arguments = (x, noise, global_cond, alphas_cumprod, clip_sample)
    if graphed and device.type == "cuda":
        return _graphed_loop(unet, scheduler)(*arguments)
    return LOOPS[scheduler](unet, *arguments)
