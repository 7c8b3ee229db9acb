"""One graphed step of Diffusion Policy's U-Net (seed size: batch 1, down_dims 256/512/1024,
79.9 M parameters) in bfloat16 as `fullgraph bench diffusion-policy` samples with, compiled:
the matrix-product convolutions ("matmul"), or the fused blocks then those ("fused"): the
kernels of one replay (count, time, share), the step's time against the sum of its kernels
(the gaps), and the floor (the weights read once). As the sampling loops call it: the step
and condition's part (``unet.condition``: the step embedding, the fused network's FiLM)
computed once before, outside the step.

    python benchmarks/unet_profile.py [matmul|fused] [compile mode] > unet.log     (needs a CUDA device)
"""

from __future__ import annotations

import copy
import sys

import torch
from replay_profile import report

from fullgraph import graphs
from fullgraph.models import ConditionalUnet1D
from fullgraph.models.unet1d import fuse_conv_blocks, matmul_convolutions


def main(network: str = "matmul", mode: str = "default") -> None:
    torch.manual_seed(0)
    unet = ConditionalUnet1D(down_dims=(256, 512, 1024), global_cond_dim=1028).cuda().eval()
    fast = copy.deepcopy(unet) if network == "matmul" else fuse_conv_blocks(copy.deepcopy(unet), "triton")
    net = torch.compile(matmul_convolutions(fast).to(torch.bfloat16), fullgraph=True,
                        mode=None if mode == "default" else mode)
    x = torch.randn(1, unet.horizon, unet.action_dim, device="cuda", dtype=torch.bfloat16)
    cond = torch.randn(1, 1028, device="cuda", dtype=torch.bfloat16)
    step = torch.tensor([50], device="cuda")
    with torch.no_grad():
        row = net.condition(step, cond)[0]
    run = graphs.graphed(torch.no_grad()(lambda x, t, c, row: net(x, t, c, condition=row)), warmup=3)
    for _ in range(5):
        run(x, step, cond, row)
    conditioning = [*fast.step_encoder.parameters(), *(() if fast.film_encoder is None
                                                       else fast.film_encoder.parameters())]
    weights = sum(p.numel() * p.element_size() for p in net.parameters()) \
        - sum(p.numel() * p.element_size() for p in conditioning)
    report(lambda: run(x, step, cond, row), f"one graphed {network} U-Net step, compile mode {mode}",
           f"the weights once, {weights / 1e6:.1f} MB at 3.35 TB/s = {weights / 3.35e12 * 1e6:.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:])
