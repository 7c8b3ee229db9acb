"""The Triton kernels of the fused DDPM and DDIM steps (``ddpm`` launches them)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _ddim_kernel(out_ptr_model, x_ptr, t_ptr, prev_ptr, alphas_ptr, noise_ptr, out_ptr, count, steps, eta,
                 CLIP: tl.constexpr, PREDICT_SAMPLE: tl.constexpr, ALPHA_ONE: tl.constexpr,
                 NOISE: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    t_raw = tl.load(t_ptr)
    prev_raw = tl.load(prev_ptr)
    alpha_t = tl.load(alphas_ptr + tl.minimum(tl.maximum(t_raw, 0), steps - 1)).to(tl.float32)
    final = 1.0 if ALPHA_ONE else tl.load(alphas_ptr).to(tl.float32)
    alpha_prev = tl.where(prev_raw >= 0,
                          tl.load(alphas_ptr + tl.minimum(tl.maximum(prev_raw, 0), steps - 1)).to(tl.float32),
                          final)
    beta_t = 1.0 - alpha_t
    # Triton's float32 division is approximate: alpha / alpha can round above 1, so the
    # square roots' arguments are clamped at 0 (exactly 0 when t and prev share an alpha).
    std = eta * tl.sqrt(tl.maximum((1.0 - alpha_prev) / beta_t * (1.0 - alpha_t / alpha_prev), 0.0))
    direction = tl.sqrt(tl.maximum(1.0 - alpha_prev - std * std, 0.0))
    valid = (t_raw >= 0) & (t_raw < steps) & (prev_raw < steps)

    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    out = tl.load(out_ptr_model + offsets, mask=mask).to(tl.float32)
    if PREDICT_SAMPLE:
        x0 = out
        eps = (x - tl.sqrt(alpha_t) * out) / tl.sqrt(beta_t)
    else:
        x0 = (x - tl.sqrt(beta_t) * out) / tl.sqrt(alpha_t)
        eps = out
    if CLIP:
        x0 = tl.minimum(tl.maximum(x0, -1.0), 1.0)
    prev = tl.sqrt(alpha_prev) * x0 + direction * eps
    if NOISE:
        prev += std * tl.load(noise_ptr + offsets, mask=mask).to(tl.float32)
    prev = tl.where(valid, prev, float("nan"))
    tl.store(out_ptr + offsets, prev.to(out_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _step_kernel(eps_ptr, x_ptr, t_ptr, alphas_ptr, noise_ptr, out_ptr, count, steps,
                 CLIP: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < count
    t_raw = tl.load(t_ptr)
    t = tl.minimum(tl.maximum(t_raw, 0), steps - 1)
    alpha_t = tl.load(alphas_ptr + t).to(tl.float32)
    alpha_prev = tl.where(t > 0, tl.load(alphas_ptr + tl.maximum(t - 1, 0)).to(tl.float32), 1.0)
    beta_t = 1.0 - alpha_t
    beta_prev = 1.0 - alpha_prev
    current_alpha = alpha_t / alpha_prev
    current_beta = 1.0 - current_alpha
    x0_coeff = tl.sqrt(alpha_prev) * current_beta / beta_t
    x_coeff = tl.sqrt(current_alpha) * beta_prev / beta_t
    std = tl.where(t > 0, tl.sqrt(tl.maximum(beta_prev / beta_t * current_beta, 1e-20)), 0.0)
    std = tl.where((t_raw >= 0) & (t_raw < steps), std, float("nan"))

    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    eps = tl.load(eps_ptr + offsets, mask=mask).to(tl.float32)
    noise = tl.load(noise_ptr + offsets, mask=mask).to(tl.float32)
    x0 = (x - tl.sqrt(beta_t) * eps) / tl.sqrt(alpha_t)
    if CLIP:
        x0 = tl.minimum(tl.maximum(x0, -1.0), 1.0)
    out = x0_coeff * x0 + x_coeff * x + std * noise
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)
