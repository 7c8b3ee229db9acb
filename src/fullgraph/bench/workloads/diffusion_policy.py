"""The Diffusion Policy series's sampler: 100 DDPM steps of the ConditionalUnet1D, from the series' own
eager loop ("document" variants) to the whole loop replayed from one CUDA graph; and the 10 DDIM
steps robots sample with."""

from __future__ import annotations

import copy
import functools

import torch

from ... import graphs
from ...diffusion import denoise, denoise_ddim
from ...models import ConditionalUnet1D
from ...models.unet1d import fuse_conv_blocks, matmul_convolutions
from ...ops import ddpm
from .base import Case, Workload, register


def _diffusion_policy(params, device):
    """forward = the whole sampler: ``steps`` U-Net calls and denoise steps from fixed noise."""
    torch.manual_seed(0)
    batch, steps = params["batch"], params["steps"]
    unet = ConditionalUnet1D(down_dims=params["down_dims"], global_cond_dim=params["cond"]).to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    cond = torch.randn(batch, params["cond"], device=device, generator=generator)
    x = torch.randn(batch, unet.horizon, unet.action_dim, device=device, generator=generator)
    noise = torch.randn(steps, *x.shape, device=device, generator=generator)
    alphas = ddpm.squaredcos_cap_v2(steps, device=device)

    def unfused_loop(net):  # the document's loop: the whole network at every step, unfused steps
        return torch.no_grad()(functools.partial(denoise, net, x, noise, cond, alphas, True, ddpm.reference,
                                                 condition_once=False))

    baseline = unfused_loop(unet)()

    def deviation(run):
        return lambda: {"max_abs_diff_vs_eager": float((run().float() - baseline).abs().max())}

    def fused_loop(net):
        return torch.no_grad()(functools.partial(denoise, net, x, noise, cond, alphas, True))

    # DDIM as robots sample: ddim_steps deterministic steps through the same schedule, its
    # rows checked against the eager DDIM loop (a different sampler than the DDPM baseline).
    timesteps = ddpm.ddim_timesteps(steps, params["ddim_steps"], device=device)

    def ddim_loop(net, condition_once=True):
        return torch.no_grad()(functools.partial(denoise_ddim, net, x, cond, alphas, timesteps, True,
                                                 condition_once=condition_once))

    ddim_baseline = ddim_loop(unet, condition_once=False)()

    def ddim_deviation(run):
        return lambda: {"max_abs_diff_vs_eager_ddim": float((run().float() - ddim_baseline).abs().max())}

    def ddim_cases():
        label = f"DDIM {params['ddim_steps']} steps"
        yield f"{label}, eager", ddim_loop(unet, condition_once=False)
        if device.type != "cuda":
            yield f"{label}, compiled matmul-conv U-Net", ddim_loop(torch.compile(streamlined, fullgraph=True))
            return
        for name, net in ((f"{label}, graphed loop, compiled matmul-conv U-Net", torch.compile(streamlined,
                                                                                             fullgraph=True)),
                          (f"{label}, graphed loop, compiled matmul-conv bf16 U-Net",
                           torch.compile(copy.deepcopy(streamlined).to(torch.bfloat16), fullgraph=True)),
                          (f"{label}, graphed loop, compiled fused-block bf16 U-Net",
                           torch.compile(copy.deepcopy(fused_blocks).to(torch.bfloat16), fullgraph=True))):
            loop = graphs.graphed(torch.no_grad()(functools.partial(denoise_ddim, net)), warmup=2)
            yield name, functools.partial(loop, x, cond, alphas, timesteps, True)

    streamlined = matmul_convolutions(copy.deepcopy(unet))
    # The residual blocks as fused Triton operators (FiLM and the skip sum in their epilogues, the
    # FiLM encoders as one product), the other convolutions as products.
    fused_blocks = matmul_convolutions(fuse_conv_blocks(copy.deepcopy(unet), "triton")) if device.type == "cuda" \
        else None

    def cases():
        yield "document eager", unfused_loop(unet)
        yield "document compiled", unfused_loop(torch.compile(unet))
        if device.type != "cuda":  # no CUDA graphs: the fused step and the compiled U-Nets alone
            yield "fullgraph loop, compiled U-Net", fused_loop(torch.compile(unet, fullgraph=True))
            yield "fullgraph loop, compiled matmul-conv U-Net", fused_loop(torch.compile(streamlined, fullgraph=True))
            return
        yield "document compiled+graphs", unfused_loop(torch.compile(unet, mode="reduce-overhead"))
        yield "document recipe (U-Net graphed)", unfused_loop(graphs.graphed(unet))
        for name, net in (
                ("fullgraph graphed loop", unet),
                ("fullgraph graphed loop, compiled U-Net", torch.compile(unet, fullgraph=True)),
                ("fullgraph graphed loop, compiled matmul-conv U-Net", torch.compile(streamlined, fullgraph=True)),
                ("fullgraph graphed loop, compiled matmul-conv bf16 U-Net",
                 torch.compile(copy.deepcopy(streamlined).to(torch.bfloat16), fullgraph=True)),
                ("fullgraph graphed loop, compiled fused-block U-Net", torch.compile(fused_blocks, fullgraph=True)),
                ("fullgraph graphed loop, compiled fused-block bf16 U-Net",
                 torch.compile(copy.deepcopy(fused_blocks).to(torch.bfloat16), fullgraph=True))):
            loop = graphs.graphed(torch.no_grad()(functools.partial(denoise, net)), warmup=2)
            yield name, functools.partial(loop, x, noise, cond, alphas, True)

    return ([Case(name, run, check=deviation(run)) for name, run in cases()]
            + [Case(name, run, check=ddim_deviation(run)) for name, run in ddim_cases()])


register(Workload(
    name="diffusion-policy",
    description="Diffusion Policy: DDPM sampling of Diffusion Policy's ConditionalUnet1D (79.9 M parameters at the "
                "seed size), the whole loop from fixed noise",
    sizes={"seed": {"batch": 1, "steps": 100, "ddim_steps": 10, "down_dims": (256, 512, 1024), "cond": 1028},
           "batch8": {"batch": 8, "steps": 100, "ddim_steps": 10, "down_dims": (256, 512, 1024), "cond": 1028},
           "small": {"batch": 1, "steps": 10, "ddim_steps": 5, "down_dims": (64, 128, 256), "cond": 1028},
           "tiny": {"batch": 1, "steps": 3, "ddim_steps": 3, "down_dims": (16, 32, 64), "cond": 1028}},
    build=_diffusion_policy,
    notes=[("floor per step at the seed size: read the weights once, 320 MB in float32 (~0.11 ms at ~3 TB/s; "
            "160 MB in bf16); 100 steps: ~11 ms (float32), ~5.5 ms (bf16)")],
))
