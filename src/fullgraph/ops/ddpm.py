"""Diffusion scheduler steps (the Diffusion Policy series), each fused into one Triton kernel:
``fullgraph.ddpm_step`` and ``fullgraph.ddim_step``.

DDPM: epsilon prediction, the x0 estimate clipped to [-1, 1], the posterior mean,
fixed-small variance, and noise added only when t > 0, as diffusers' ``DDPMScheduler.step``
with as many inference steps as training steps. DDIM: diffusers' ``DDIMScheduler.step``
(eta, clip_sample, "epsilon" or "sample" prediction, ``set_alpha_to_one``), the step from t
to a previous timestep of the caller's inference schedule (``ddim_timesteps``). Timesteps
are 0-d int64 tensors on the device, read by the kernels: a captured CUDA graph replays
every step of the sampling loop. Both are ``torch.library.triton_op``s launching through
``wrap_triton`` (``_triton.op``, ``_triton.traced``): Inductor traces into them, and an
AOTInductor package carries their kernels.
"""

from __future__ import annotations

import math

import torch

from .. import _contract, _triton, _validate, backends
from .._triton import cdiv, lazy

kernels = lazy(f"{__package__}.ddpm_kernels")

BLOCK = 1024


def squaredcos_cap_v2(steps: int = 100, dtype=torch.float32, device=None) -> torch.Tensor:
    """alphas_cumprod [steps] of the cosine schedule ("squaredcos_cap_v2", betas capped at 0.999)."""
    def alpha_bar(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = torch.tensor([min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), 0.999) for i in range(steps)],
                         dtype=torch.float64)
    return torch.cumprod(1 - betas, 0).to(dtype=dtype, device=device)


def reference(model_output, sample, timestep, alphas_cumprod, noise, clip_sample: bool):
    """The step in PyTorch (unfused), in float32 (float64 for float64), without reading t on the host.
    An out-of-range timestep gives NaN."""
    compute = torch.float64 if sample.dtype == torch.float64 else torch.float32
    steps = alphas_cumprod.shape[0]
    t = timestep.clamp(0, steps - 1)
    alphas = alphas_cumprod.to(compute)
    alpha_t = _alpha_at(alphas, t)
    alpha_prev = torch.where(t > 0, _alpha_at(alphas, t - 1), torch.ones_like(alpha_t))
    beta_t, beta_prev = 1 - alpha_t, 1 - alpha_prev
    current_alpha = alpha_t / alpha_prev
    current_beta = 1 - current_alpha
    x, eps = sample.to(compute), model_output.to(compute)
    x0 = (x - beta_t.sqrt() * eps) / alpha_t.sqrt()
    if clip_sample:
        x0 = x0.clamp(-1, 1)
    mean = (alpha_prev.sqrt() * current_beta / beta_t) * x0 + (current_alpha.sqrt() * beta_prev / beta_t) * x
    std = (beta_prev / beta_t * current_beta).clamp(min=1e-20).sqrt()
    out = mean + torch.where(t > 0, std, torch.zeros_like(std)) * noise.to(compute)
    valid = (timestep >= 0) & (timestep < steps)
    return torch.where(valid, out, torch.full_like(out, math.nan)).to(sample.dtype)


def ddim_timesteps(train_steps: int, steps: int, steps_offset: int = 0, device=None) -> torch.Tensor:
    """[steps] int64, descending: diffusers' "leading" DDIM schedule, (arange(steps) *
    (train_steps // steps))[::-1] + steps_offset; each step goes to the next entry (the last
    to -1: the final alpha)."""
    if not 1 <= steps <= train_steps:
        raise ValueError(f"steps: expected an int in [1, {train_steps}] (the training steps), got {steps!r}")
    return (torch.arange(steps, dtype=torch.int64) * (train_steps // steps)).flip(0).add(steps_offset).to(device)


def _ddim_alphas(alphas, timestep, prev_timestep, set_alpha_to_one: bool):
    """alpha_t and alpha_prev (the final alpha for prev_timestep < 0), from [T] alphas."""
    alpha_t = _alpha_at(alphas, timestep)
    final = torch.ones_like(alpha_t) if set_alpha_to_one else alphas[0]
    alpha_prev = torch.where(prev_timestep >= 0, _alpha_at(alphas, prev_timestep), final)
    return alpha_t, alpha_prev


def _alpha_at(alphas, timestep):
    """alphas [T] at ``timestep`` clamped into [0, T), by a gather: indexing by a 0-d tensor
    reads its value on the host, which torch.export cannot trace."""
    return alphas.gather(0, timestep.clamp(0, alphas.shape[0] - 1).reshape(-1)).reshape(timestep.shape)


def ddim_reference(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta: float,
                   clip_sample: bool, predict_sample: bool, set_alpha_to_one: bool):
    """The DDIM step in PyTorch (unfused), in float32 (float64 for float64), no host read.
    A timestep outside [0, T), or a previous timestep >= T, gives NaN."""
    compute = torch.float64 if sample.dtype == torch.float64 else torch.float32
    steps = alphas_cumprod.shape[0]
    alpha_t, alpha_prev = _ddim_alphas(alphas_cumprod.to(compute), timestep, prev_timestep, set_alpha_to_one)
    beta_t = 1 - alpha_t
    x, out = sample.to(compute), model_output.to(compute)
    if predict_sample:
        x0, eps = out, (x - alpha_t.sqrt() * out) / beta_t.sqrt()
    else:
        x0, eps = (x - beta_t.sqrt() * out) / alpha_t.sqrt(), out
    if clip_sample:
        x0 = x0.clamp(-1, 1)
    # Clamped at 0 as in the kernel: prev_timestep > timestep (DDIM inversion) has no variance.
    std = eta * ((1 - alpha_prev) / beta_t * (1 - alpha_t / alpha_prev)).clamp(min=0).sqrt()
    prev = alpha_prev.sqrt() * x0 + (1 - alpha_prev - std * std).clamp(min=0).sqrt() * eps
    if noise is not None:
        prev = prev + std * noise.to(compute)
    valid = (timestep >= 0) & (timestep < steps) & (prev_timestep < steps)
    return torch.where(valid, prev, torch.full_like(prev, math.nan)).to(sample.dtype)


def _triton_step(model_output, sample, timestep, alphas_cumprod, noise, clip_sample: bool):
    out = torch.empty_like(sample)
    count = sample.numel()
    if count:
        grid = (cdiv(count, BLOCK),)
        _triton.traced(kernels._step_kernel)[grid](model_output, sample, timestep, alphas_cumprod, noise, out, count,
                                                   alphas_cumprod.shape[0], CLIP=clip_sample, BLOCK=BLOCK)
    return out


def _triton_ddim(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta, clip_sample,
                 predict_sample, set_alpha_to_one):
    out = torch.empty_like(sample)
    count = sample.numel()
    if count:
        _triton.traced(kernels._ddim_kernel)[(cdiv(count, BLOCK),)](
            model_output, sample, timestep, prev_timestep, alphas_cumprod, sample if noise is None else noise, out,
            count, alphas_cumprod.shape[0], float(eta), CLIP=clip_sample, PREDICT_SAMPLE=predict_sample,
            ALPHA_ONE=set_alpha_to_one, NOISE=noise is not None, BLOCK=BLOCK)
    return out


def _step_family(op: str, fused, unfused):
    """The backends of one scheduler step: a Triton kernel (float32 maths) on CUDA, PyTorch anywhere."""
    return backends.family(
        op,
        backends.Backend("triton", ops=(op,), devices=_triton.devices(), auto_devices=("cuda",),
                         dtypes=(torch.float16, torch.bfloat16, torch.float32), install=_triton.INSTALL,
                         available=_triton.available, implementation=fused,
                         note='computes in float32 (use backend="torch" for float64)'),
        backends.Backend("torch", ops=(op,), devices=(backends.ANY_DEVICE,), auto_devices=(backends.ANY_DEVICE,),
                         implementation=unfused),
    )


BACKENDS = _step_family("ddpm_step", _triton_step, reference)
DDIM_BACKENDS = _step_family("ddim_step", _triton_ddim, ddim_reference)


def _check(model_output, sample, timestep, alphas_cumprod, noise, clip_sample, prev_timestep=None, *,
           ddim: bool = False) -> None:
    """The contract both steps share (DDIM: a prev_timestep, and noise may be None)."""
    for name, value in (("sample", sample), ("model_output", model_output), ("noise", noise)):
        if value is None and name == "noise" and ddim:
            continue
        _validate.floating(name, value)
        if name != "sample":
            _validate.same_dtype_and_device(name, value, "sample", sample)
            if value.shape != sample.shape:
                raise ValueError(f"{name}: expected the shape of sample {tuple(sample.shape)}, got {tuple(value.shape)}")
    for name, value in (("timestep", timestep), ("prev_timestep", prev_timestep)):
        if name == "prev_timestep" and not ddim:
            continue
        _validate.tensor(name, value)
        if value.dtype != torch.int64 or value.dim() != 0:
            raise TypeError(f"{name}: expected a 0-d int64 tensor (so a captured graph can replay every step), "
                            f"got {value.dtype} of shape {tuple(value.shape)}")
        if value.device != sample.device:
            raise ValueError(f"{name}: expected a tensor on {sample.device} like sample, got {value.device}")
    _validate.floating("alphas_cumprod", alphas_cumprod)
    _validate.rank("alphas_cumprod", alphas_cumprod, (1,), "[T]")
    if alphas_cumprod.device != sample.device or alphas_cumprod.shape[0] < 1:
        raise ValueError(f"alphas_cumprod: expected [T >= 1] on {sample.device}, got {tuple(alphas_cumprod.shape)} "
                         f"on {alphas_cumprod.device}")
    if not isinstance(clip_sample, bool):
        raise TypeError(f"clip_sample: expected a bool, got {type(clip_sample).__name__}")


def _check_ddim(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta, clip_sample,
                predict_sample, set_alpha_to_one) -> None:
    _check(model_output, sample, timestep, alphas_cumprod, noise, clip_sample, prev_timestep, ddim=True)
    eta = _validate.real("eta", eta, minimum=0.0, strict=False)
    if eta > 0 and noise is None:
        raise ValueError(f"noise: expected a tensor shaped like sample when eta > 0, got None (eta = {eta})")
    for name, value in (("predict_sample", predict_sample), ("set_alpha_to_one", set_alpha_to_one)):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


@_triton.op("fullgraph::ddpm_step")
def ddpm_step_op(model_output: torch.Tensor, sample: torch.Tensor, timestep: torch.Tensor,
                 alphas_cumprod: torch.Tensor, noise: torch.Tensor, clip_sample: bool, backend: str) -> torch.Tensor:
    _check(model_output, sample, timestep, alphas_cumprod, noise, clip_sample)
    run = BACKENDS.resolve(backend, "ddpm_step", sample.device, sample.dtype, argument="sample").implementation
    return run(model_output.contiguous(), sample.contiguous(), timestep, alphas_cumprod.contiguous(),
               noise.contiguous(), clip_sample)


def _check_ddpm_step(model_output, sample, timestep, alphas_cumprod, noise, *, clip_sample=True, backend="auto"):
    _check(model_output, sample, timestep, alphas_cumprod, noise, clip_sample)
    BACKENDS.resolve(backend, "ddpm_step", sample.device, sample.dtype, argument="sample")


@_contract.checked(_check_ddpm_step)
def ddpm_step(model_output, sample, timestep, alphas_cumprod, noise, *, clip_sample: bool = True,
              backend: str = "auto"):
    """One DDPM denoising step x_t -> x_{t-1} for an epsilon-predicting model.

    Args:
        model_output: predicted noise, any shape, floating. sample: x_t, same shape, dtype
            and device. timestep: t, a 0-d int64 tensor on the same device (a graph replay
            reads its current value). alphas_cumprod: [T] cumulative products of
            (1 - beta) on the device (e.g. ``squaredcos_cap_v2(100)``). noise: standard
            normal noise shaped like sample, used only when t > 0.
        clip_sample: clip the x0 estimate to [-1, 1]. backend: "auto" (Triton on CUDA,
            float64 through PyTorch), "triton" or "torch".

    Returns:
        x_{t-1}, shaped like sample, in its dtype (computed in float32, or float64).
        A timestep outside [0, T) gives NaN (checked on the device, without a sync).

    Example:
        >>> import torch, fullgraph
        >>> alphas = fullgraph.ops.ddpm.squaredcos_cap_v2(100)
        >>> x = torch.randn(1, 16, 2)
        >>> out = fullgraph.ddpm_step(torch.randn_like(x), x, torch.tensor(99), alphas, torch.randn_like(x))
        >>> out.shape
        torch.Size([1, 16, 2])
    """
    backend = BACKENDS.resolve(backend, "ddpm_step", sample.device, sample.dtype, argument="sample").name
    return torch.ops.fullgraph.ddpm_step(model_output, sample, timestep, alphas_cumprod, noise, clip_sample, backend)


@_triton.op("fullgraph::ddim_step")
def ddim_step_op(model_output: torch.Tensor, sample: torch.Tensor, timestep: torch.Tensor, prev_timestep: torch.Tensor,
                 alphas_cumprod: torch.Tensor, noise: torch.Tensor | None, eta: float, clip_sample: bool,
                 predict_sample: bool, set_alpha_to_one: bool, backend: str) -> torch.Tensor:
    args = (model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta, clip_sample, predict_sample,
            set_alpha_to_one)
    _check_ddim(*args)
    run = DDIM_BACKENDS.resolve(backend, "ddim_step", sample.device, sample.dtype, argument="sample").implementation
    return run(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args))


PREDICTION_TYPES = ("epsilon", "sample")


def _check_ddim_step(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise=None, *, eta=0.0,
                     clip_sample=True, prediction_type="epsilon", set_alpha_to_one=True, backend="auto"):
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction_type: expected one of {PREDICTION_TYPES}, got {prediction_type!r}")
    _check_ddim(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta, clip_sample,
                prediction_type == "sample", set_alpha_to_one)
    DDIM_BACKENDS.resolve(backend, "ddim_step", sample.device, sample.dtype, argument="sample")


@_contract.checked(_check_ddim_step)
def ddim_step(model_output, sample, timestep, prev_timestep, alphas_cumprod, noise=None, *, eta: float = 0.0,
              clip_sample: bool = True, prediction_type: str = "epsilon", set_alpha_to_one: bool = True,
              backend: str = "auto"):
    """One DDIM step x_t -> x_prev, as diffusers' ``DDIMScheduler.step``.

    Args:
        model_output: the model's prediction, any shape, floating: the noise
            (``prediction_type="epsilon"``) or x0 (``"sample"``). sample: x_t, same shape,
            dtype and device. timestep, prev_timestep: 0-d int64 tensors on the device (a graph
            replay reads their current values); prev_timestep < 0 steps to the final alpha
            (1 with ``set_alpha_to_one``, else alphas_cumprod[0]). ``ddim_timesteps`` gives a
            schedule. alphas_cumprod: [T] on the device. noise: standard normal noise shaped
            like sample, needed when eta > 0 (eta = 0: deterministic DDIM).
        clip_sample: clip the x0 estimate to [-1, 1]. backend: "auto" (Triton on CUDA,
            float64 through PyTorch), "triton" or "torch".

    Returns:
        x_prev, shaped like sample, in its dtype (computed in float32, or float64). A
        timestep outside [0, T) or a prev_timestep >= T gives NaN (on the device, no sync).
        prev_timestep > timestep steps towards noise (DDIM inversion, with no variance).

    Example:
        >>> import torch, fullgraph
        >>> alphas = fullgraph.ops.ddpm.squaredcos_cap_v2(100)
        >>> steps = fullgraph.ops.ddpm.ddim_timesteps(100, 10)
        >>> steps.tolist()
        [90, 80, 70, 60, 50, 40, 30, 20, 10, 0]
        >>> x = torch.randn(1, 16, 2)
        >>> fullgraph.ddim_step(torch.randn_like(x), x, steps[0], steps[1], alphas).shape
        torch.Size([1, 16, 2])
    """
    args = (model_output, sample, timestep, prev_timestep, alphas_cumprod, noise, eta, clip_sample,
            prediction_type == "sample", set_alpha_to_one)
    backend = DDIM_BACKENDS.resolve(backend, "ddim_step", sample.device, sample.dtype, argument="sample").name
    return torch.ops.fullgraph.ddim_step(*args[:6], float(eta), *args[7:], backend)
