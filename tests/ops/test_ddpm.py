"""fullgraph.ddpm_step and fullgraph.ddim_step against float64 oracles written from diffusers' formulas."""

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
@pytest.mark.parametrize("scheduler", ["ddpm", "ddim"])
def test_compiled_loop_is_one_graph(scheduler, generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    alphas = ddpm.squaredcos_cap_v2(STEPS)

    def step(x, t, prev, out, noise):
        if scheduler == "ddpm":
            return fullgraph.ddpm_step(out, x, t, alphas, noise)
        return fullgraph.ddim_step(out, x, t, prev, alphas)

    compiled = torch.compile(step, backend=counter, fullgraph=True)
    out, x, noise = (a.float() for a in _inputs(generator))
    for t, prev in ((99, 89), (98, 88), (0, -1)):  # new timesteps are new data, not new graphs
        args = (x, torch.tensor(t), torch.tensor(prev), out, noise)
        torch.testing.assert_close(compiled(*args), step(*args))
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


# ------------------------------------------------------------------------ DDIM


def _ddim_oracle(out, x, t, prev, alphas, noise, eta, clip, predict_sample, alpha_one):
    """DDIMScheduler.step, one float64 scalar at a time."""
    a_t = float(alphas[t])
    a_prev = float(alphas[prev]) if prev >= 0 else (1.0 if alpha_one else float(alphas[0]))
    b_t = 1 - a_t
    std = eta * math.sqrt((1 - a_prev) / b_t * (1 - a_t / a_prev))
    result = []
    for o, s, n in zip(out.tolist(), x.tolist(), noise.tolist()):
        if predict_sample:
            x0, e = o, (s - math.sqrt(a_t) * o) / math.sqrt(b_t)
        else:
            x0, e = (s - math.sqrt(b_t) * o) / math.sqrt(a_t), o
        if clip:
            x0 = min(max(x0, -1.0), 1.0)
        result.append(math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev - std * std) * e + std * n)
    return torch.tensor(result, dtype=torch.float64)


@pytest.mark.parametrize("backend, device", _cases())
@pytest.mark.parametrize("t, prev", [(90, 80), (10, 0), (0, -1), (99, 49), (5, -1)])
@pytest.mark.parametrize("eta, clip, prediction, alpha_one", [
    (0.0, True, "epsilon", True), (0.7, False, "epsilon", True), (1.0, True, "sample", False),
    (0.0, False, "sample", True), (0.3, True, "epsilon", False)])
def test_ddim_matches_the_oracle(backend, device, t, prev, eta, clip, prediction, alpha_one, generator):
    out, x, noise = _inputs(generator)
    alphas = ddpm.squaredcos_cap_v2(STEPS, dtype=torch.float64)
    want = _ddim_oracle(out.flatten(), x.flatten(), t, prev, alphas, noise.flatten(), eta, clip, prediction == "sample",
                   alpha_one).reshape(x.shape)
    dtype = torch.float32 if backend == "triton" else torch.float64
    got = fullgraph.ddim_step(*(a.to(device, dtype) for a in (out, x)), torch.tensor(t, device=device),
                              torch.tensor(prev, device=device), alphas.to(device, dtype), noise.to(device, dtype),
                              eta=eta, clip_sample=clip, prediction_type=prediction, set_alpha_to_one=alpha_one,
                              backend=backend)
    tol = 1e-12 if dtype == torch.float64 else 5e-4  # x0 / sqrt(alpha_99) amplifies float32 rounding
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


def test_ddim_schedule_and_a_deterministic_ten_step_loop(generator):
    """eta = 0 without noise: the 10-step loop is deterministic and ends in [-1, 1]-ish actions."""
    alphas = ddpm.squaredcos_cap_v2(STEPS)
    steps = ddpm.ddim_timesteps(STEPS, 10)
    assert steps.tolist() == [90, 80, 70, 60, 50, 40, 30, 20, 10, 0]
    assert ddpm.ddim_timesteps(STEPS, 10, steps_offset=1).tolist()[0] == 91
    x = torch.randn(2, 16, 2, generator=generator)
    runs = []
    for _ in range(2):
        y = x
        for i, t in enumerate(steps):
            prev = steps[i + 1] if i + 1 < len(steps) else torch.tensor(-1)
            y = fullgraph.ddim_step(0.1 * y, y, t, prev, alphas)
        runs.append(y)
    assert torch.equal(runs[0], runs[1]) and torch.isfinite(runs[0]).all()
    with pytest.raises(ValueError, match=r"steps: expected an int in \[1, 100\]"):
        ddpm.ddim_timesteps(STEPS, 101)


@pytest.mark.parametrize("t, prev", [(STEPS, 10), (-2, -1), (50, STEPS)])
def test_ddim_out_of_range_timesteps_give_nan(t, prev, generator):
    out, x, _ = (a.float() for a in _inputs(generator))
    for backend, device in _cases():
        got = fullgraph.ddim_step(out.to(device), x.to(device), torch.tensor(t, device=device),
                                  torch.tensor(prev, device=device), ddpm.squaredcos_cap_v2(STEPS, device=device),
                                  backend=backend)
        assert torch.isnan(got).all()


@pytest.mark.parametrize("backend, device", _cases())
def test_ddim_opcheck(backend, device, generator):
    out, x, noise = (a.float().to(device) for a in _inputs(generator))
    steps = [torch.tensor(v, device=device) for v in (70, 60)]
    alphas = ddpm.squaredcos_cap_v2(STEPS, device=device)
    torch.library.opcheck(torch.ops.fullgraph.ddim_step.default,
                          (out, x, *steps, alphas, noise, 0.5, True, False, True, backend))
    torch.library.opcheck(torch.ops.fullgraph.ddim_step.default,
                          (out, x, *steps, alphas, None, 0.0, False, True, False, backend))


@pytest.mark.parametrize("change, error, message", [
    (lambda a: {**a, "prev_timestep": 5}, TypeError, "prev_timestep: expected a torch.Tensor"),
    (lambda a: {**a, "prev_timestep": torch.tensor([5])}, TypeError, "prev_timestep: expected a 0-d int64 tensor"),
    (lambda a: {**a, "eta": -0.1}, ValueError, "eta: expected a finite float >= 0.0, got -0.1"),
    (lambda a: {**a, "eta": 0.5}, ValueError, "noise: expected a tensor shaped like sample when eta > 0, got None"),
    (lambda a: {**a, "prediction_type": "v_prediction"}, ValueError, "prediction_type: expected one of"),
    (lambda a: {**a, "set_alpha_to_one": 1}, TypeError, "set_alpha_to_one: expected a bool"),
    (lambda a: {**a, "noise": a["sample"][:1]}, ValueError, "noise: expected the shape of sample"),
])
def test_ddim_bad_input(change, error, message, generator):
    out, x, _ = (a.float() for a in _inputs(generator))
    arguments = {"model_output": out, "sample": x, "timestep": torch.tensor(30), "prev_timestep": torch.tensor(20),
                 "alphas_cumprod": ddpm.squaredcos_cap_v2(STEPS)}
    with pytest.raises(error) as raised:
        fullgraph.ddim_step(**change(arguments))
    assert message in str(raised.value)


def test_ddim_the_registered_operator_checks_its_contract(generator):
    out, x, _ = (a.float() for a in _inputs(generator))
    with pytest.raises(ValueError, match="noise: expected a tensor shaped like sample when eta > 0"):
        torch.ops.fullgraph.ddim_step(out, x, torch.tensor(30), torch.tensor(20), ddpm.squaredcos_cap_v2(STEPS),
                                      None, 0.5, True, False, True, "torch")
