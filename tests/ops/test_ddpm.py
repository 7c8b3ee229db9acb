"""fullgraph.ddpm_step against a float64 oracle written from diffusers' formulas."""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import DEVICES, HAVE_TRITON

import fullgraph
from fullgraph.ops import ddpm

STEPS = 100


def _oracle(eps, x, t, alphas, noise, clip):
    """DDPMScheduler.step (epsilon, fixed_small, prev_t = t - 1), one float64 scalar at a time."""
    a_t = float(alphas[t])
    a_prev = float(alphas[t - 1]) if t > 0 else 1.0
    b_t, b_prev = 1 - a_t, 1 - a_prev
    cur_a = a_t / a_prev
    cur_b = 1 - cur_a
    out = []
    for e, s, n in zip(eps.tolist(), x.tolist(), noise.tolist()):
        x0 = (s - math.sqrt(b_t) * e) / math.sqrt(a_t)
        if clip:
            x0 = min(max(x0, -1.0), 1.0)
        mean = math.sqrt(a_prev) * cur_b / b_t * x0 + math.sqrt(cur_a) * b_prev / b_t * s
        variance = max(b_prev / b_t * cur_b, 1e-20)
        out.append(mean + (math.sqrt(variance) * n if t > 0 else 0.0))
    return torch.tensor(out, dtype=torch.float64)


def _cases():
    """(backend, device): Triton on CUDA, and on CPU tensors through its interpreter."""
    triton_devices = [d for d in DEVICES if d == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"]
    return [("torch", d) for d in DEVICES] + ([("triton", d) for d in triton_devices] if HAVE_TRITON else [])


def _inputs(generator, shape=(3, 16, 2), scale=3.0):
    """Samples and predictions well outside [-1, 1], so clipping matters."""
    return [torch.randn(shape, generator=generator, dtype=torch.float64) * scale for _ in range(3)]


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("t", [0, 1, 57, STEPS - 1])
@pytest.mark.parametrize("clip", [True, False])
def test_matches_the_oracle(backend, device, t, clip, generator):
    eps, x, noise = _inputs(generator)
    alphas = ddpm.squaredcos_cap_v2(STEPS, dtype=torch.float64)
    want = _oracle(eps.flatten(), x.flatten(), t, alphas, noise.flatten(), clip).reshape(x.shape)
    dtype = torch.float32 if backend == "triton" else torch.float64
    got = fullgraph.ddpm_step(*(a.to(device, dtype) for a in (eps, x)), torch.tensor(t, device=device),
                              alphas.to(device, dtype), noise.to(device, dtype), clip_sample=clip, backend=backend)
    tol = 1e-12 if dtype == torch.float64 else 2e-4  # x0 / sqrt(alpha_99) amplifies float32 rounding
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_computes_in_float32(backend, device, dtype, generator):
    eps, x, noise = _inputs(generator)
    alphas = ddpm.squaredcos_cap_v2(STEPS)
    t = torch.tensor(30, device=device)
    rounded = [a.to(dtype) for a in (eps, x, noise)]
    want = _oracle(*(r.double().flatten() for r in rounded[:2]), 30, alphas.double(), rounded[2].double().flatten(),
                   True).reshape(x.shape)
    got = fullgraph.ddpm_step(rounded[0].to(device), rounded[1].to(device), t, alphas.to(device),
                              rounded[2].to(device), backend=backend)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double().cpu(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("t", [-1, STEPS])
def test_out_of_range_timestep_gives_nan(backend, device, t, generator):
    eps, x, noise = (a.float().to(device) for a in _inputs(generator))
    got = fullgraph.ddpm_step(eps, x, torch.tensor(t, device=device), ddpm.squaredcos_cap_v2(STEPS, device=device),
                              noise, backend=backend)
    assert torch.isnan(got).all()


def test_empty_sample():
    x = torch.empty(0, 16, 2)
    out = fullgraph.ddpm_step(x, x, torch.tensor(5), ddpm.squaredcos_cap_v2(STEPS), x)
    assert out.shape == (0, 16, 2)


def test_matches_diffusers_where_installed(generator):
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=STEPS, beta_schedule="squaredcos_cap_v2",
                                        clip_sample=True, prediction_type="epsilon")
    scheduler.set_timesteps(STEPS)
    eps, x, _ = (a.float() for a in _inputs(generator))
    for t in (99, 40, 0):
        torch.manual_seed(t)
        want = scheduler.step(eps, t, x, generator=torch.Generator().manual_seed(t)).prev_sample
        drawn = torch.randn(x.shape, generator=torch.Generator().manual_seed(t))
        got = fullgraph.ddpm_step(eps, x, torch.tensor(t), scheduler.alphas_cumprod, drawn)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, device", _cases())
def test_opcheck(backend, device, generator):
    eps, x, noise = (a.float().to(device) for a in _inputs(generator))
    args = (eps, x, torch.tensor(7, device=device), ddpm.squaredcos_cap_v2(STEPS, device=device), noise, True, backend)
    torch.library.opcheck(torch.ops.fullgraph.ddpm_step.default, args)


@pytest.mark.slow
def test_compiled_loop_is_one_graph(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    alphas = ddpm.squaredcos_cap_v2(STEPS)

    def denoise(x, t, eps, noise):
        return fullgraph.ddpm_step(eps, x, t, alphas, noise)

    compiled = torch.compile(denoise, backend=counter, fullgraph=True)
    eps, x, noise = (a.float() for a in _inputs(generator))
    for t in (99, 98, 0):  # a new timestep value is new data, not a new graph
        torch.testing.assert_close(compiled(x, torch.tensor(t), eps, noise), denoise(x, torch.tensor(t), eps, noise))
    assert counter.frame_count == 1


@pytest.mark.parametrize("change, error, message", [
    (lambda a: {**a, "timestep": 5}, TypeError, "timestep: expected a torch.Tensor"),
    (lambda a: {**a, "timestep": torch.tensor(5.0)}, TypeError, "timestep: expected a 0-d int64 tensor"),
    (lambda a: {**a, "timestep": torch.tensor([5])}, TypeError, "of shape (1,)"),
    (lambda a: {**a, "noise": a["noise"][:1]}, ValueError, "noise: expected the shape of sample"),
    (lambda a: {**a, "model_output": a["model_output"].double()}, TypeError, "model_output: expected torch.float32"),
    (lambda a: {**a, "sample": a["sample"].long()}, TypeError, "sample: expected a floating-point tensor"),
    (lambda a: {**a, "alphas_cumprod": a["alphas_cumprod"][None]}, ValueError, "alphas_cumprod: expected shape [T]"),
    (lambda a: {**a, "clip_sample": 1}, TypeError, "clip_sample: expected a bool"),
    (lambda a: {**a, "backend": "cuda"}, ValueError, "backend: expected one of"),
])
def test_bad_input(change, error, message, generator):
    eps, x, noise = (a.float() for a in _inputs(generator))
    arguments = {"model_output": eps, "sample": x, "timestep": torch.tensor(3),
                 "alphas_cumprod": ddpm.squaredcos_cap_v2(STEPS), "noise": noise}
    with pytest.raises(error, match=None) as raised:
        fullgraph.ddpm_step(**change(arguments))
    assert message in str(raised.value)
