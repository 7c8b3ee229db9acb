"""fullgraph.diffusion.sample: the DDPM and DDIM loops, eager and replayed from one CUDA graph."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from fullgraph.ops import ddpm


def _unet(device="cpu"):
    torch.manual_seed(0)
    return fullgraph.models.ConditionalUnet1D(down_dims=(16, 32, 64), global_cond_dim=10).to(device).eval()


def test_loop_matches_the_reference_steps():
    unet, cond = _unet(), torch.randn(2, 10)
    got = fullgraph.diffusion.sample(unet, cond, steps=8, generator=torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 2, generator=generator)
    noise = torch.randn(8, 2, 16, 2, generator=generator)
    alphas = ddpm.squaredcos_cap_v2(8)
    with torch.no_grad():
        for i, t in enumerate(range(7, -1, -1)):
            x = ddpm.reference(unet(x, t, cond), x, torch.tensor(t), alphas, noise[i], True)
    torch.testing.assert_close(got, x)
    assert got.abs().max() <= 1  # the last step returns the clipped x0 estimate


def test_ddim_loop_matches_the_reference_steps():
    """10 deterministic DDIM steps through a 100-step schedule, as Diffusion Policy runs on robots."""
    unet, cond = _unet(), torch.randn(2, 10)
    got = fullgraph.diffusion.sample(unet, cond, steps=10, scheduler="ddim", generator=torch.Generator().manual_seed(3))
    x = torch.randn(2, 16, 2, generator=torch.Generator().manual_seed(3))
    alphas = ddpm.squaredcos_cap_v2(100)
    timesteps = list(range(90, -1, -10))
    with torch.no_grad():
        for t, prev in zip(timesteps, timesteps[1:] + [-1]):
            x = ddpm.ddim_reference(unet(x, t, cond), x, torch.tensor(t), torch.tensor(prev), alphas, None, 0.0, True,
                                    False, True)
    torch.testing.assert_close(got, x)
    with pytest.raises(ValueError, match=r"alphas_cumprod: expected \[100\] \(one per training step\)"):
        fullgraph.diffusion.sample(unet, cond, steps=10, scheduler="ddim", alphas_cumprod=alphas[:10])
    with pytest.raises(ValueError, match=r"scheduler: expected one of \['ddim', 'ddpm'\], got 'euler'"):
        fullgraph.diffusion.sample(unet, cond, scheduler="euler")


def test_bad_input():
    with pytest.raises(ValueError, match=r"alphas_cumprod: expected \[8\]"):
        fullgraph.diffusion.sample(_unet(), torch.randn(2, 10), steps=8, alphas_cumprod=ddpm.squaredcos_cap_v2(9))
    with pytest.raises(ValueError, match="steps: expected an int >= 1"):
        fullgraph.diffusion.sample(_unet(), torch.randn(2, 10), steps=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_loop_equals_eager_and_is_captured_once():
    unet = _unet("cuda")
    for seed in (1, 2):
        cond = torch.randn(2, 10, device="cuda")
        eager = fullgraph.diffusion.sample(unet, cond, steps=20, graphed=False,
                                           generator=torch.Generator(device="cuda").manual_seed(seed))
        graphed = fullgraph.diffusion.sample(unet, cond, steps=20,
                                             generator=torch.Generator(device="cuda").manual_seed(seed))
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert fullgraph.diffusion._GRAPHED_LOOPS[unet]["ddpm"].captures == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_ddim_loop_equals_eager_and_recaptures_once_per_step_count():
    unet = _unet("cuda")
    cond = torch.randn(2, 10, device="cuda")
    for steps in (10, 10, 5):
        eager = fullgraph.diffusion.sample(unet, cond, steps=steps, scheduler="ddim", graphed=False,
                                           generator=torch.Generator(device="cuda").manual_seed(steps))
        graphed = fullgraph.diffusion.sample(unet, cond, steps=steps, scheduler="ddim",
                                             generator=torch.Generator(device="cuda").manual_seed(steps))
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-4)
    assert fullgraph.diffusion._GRAPHED_LOOPS[unet]["ddim"].captures == 2
