"""One graphed step of Diffusion Policy's U-Net (seed size: batch 1, down_dims 256/512/1024,
79.9 M parameters), the compiled matmul-convolution U-Net in bfloat16 as `fullgraph bench
diffusion-policy` samples with: the kernels of one replay (count, time, share), the step's
time against the sum of its kernels (the gaps), and the floor (the weights read once).

    python benchmarks/unet_profile.py > unet.log     (needs a CUDA device)
"""

from __future__ import annotations

import copy
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fullgraph import graphs
from fullgraph.bench.timing import time_call
from fullgraph.models import ConditionalUnet1D
from fullgraph.models.unet1d import matmul_convolutions

REPLAYS = 20


def median_ms(fn, runs=30) -> float:
    return time_call(fn, torch.device("cuda"), warmup=0, runs=runs).median_ms


def main(mode: str = "default") -> None:
    torch.manual_seed(0)
    unet = ConditionalUnet1D(down_dims=(256, 512, 1024), global_cond_dim=1028).cuda().eval()
    net = torch.compile(matmul_convolutions(copy.deepcopy(unet)).to(torch.bfloat16), fullgraph=True,
                        mode=None if mode == "default" else mode)
    x = torch.randn(1, unet.horizon, unet.action_dim, device="cuda", dtype=torch.bfloat16)
    cond = torch.randn(1, 1028, device="cuda", dtype=torch.bfloat16)
    step = torch.tensor([50], device="cuda")
    run = graphs.graphed(torch.no_grad()(lambda x, t, c: net(x, t, c)), warmup=3)
    for _ in range(5):
        run(x, step, cond)
    torch.cuda.synchronize()
    per_step = median_ms(lambda: run(x, step, cond), runs=50)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            run(x, step, cond)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernel_us = sum(e.device_time_total for e in kernels) / REPLAYS
    launches = sum(e.count for e in kernels) / REPLAYS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, compile mode {mode}")
    print(f"one graphed U-Net step: {per_step * 1000:.1f} us (CUDA events, median of 50 replays)")
    print(f"kernels per step: {launches:.0f}, their time summed: {kernel_us:.1f} us; "
          f"gaps and launch latency inside the graph: {per_step * 1000 - kernel_us:.1f} us")
    print(f"floor: the weights once, {weights / 1e6:.1f} MB at 3.35 TB/s = {weights / 3.35e12 * 1e6:.1f} us")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70))


if __name__ == "__main__":
    main(*sys.argv[1:])
