"""One ConditionalUnet1D call at batch 1 on a GPU: where the time of a sampling step goes.

    python benchmarks/unet_step.py

Times one U-Net call replayed from a CUDA graph (the GPU's work alone) for the network as
written (cuDNN convolutions), compiled, with its convolutions recast as matrix products
over unfolded windows (weights streamed once, N = batch * horizon columns), in float32 and
bf16, and lists the heaviest kernels of the compiled float32 network. Floor: the weights
read once, 320 MB in float32 at ~3 TB/s = 0.107 ms (bf16: 0.053 ms).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fullgraph.bench.timing import graphed, time_call
from fullgraph.models import ConditionalUnet1D


class MatmulConv1d(nn.Module):
    """A Conv1d (stride 1, same padding) as unfold + one matrix product with the weights."""

    def __init__(self, conv: nn.Conv1d):
        super().__init__()
        self.kernel, self.padding = conv.kernel_size[0], conv.padding[0]
        self.weight = nn.Parameter(conv.weight.detach().flatten(1).clone())  # [out, in * k]
        self.bias = nn.Parameter(conv.bias.detach().clone())

    def forward(self, x):
        windows = F.pad(x, (self.padding, self.padding)).unfold(2, self.kernel, 1)  # [B, in, T, k]
        columns = windows.permute(0, 2, 1, 3).flatten(2)  # [B, T, in * k]
        return F.linear(columns, self.weight, self.bias).transpose(1, 2)


def matmul_convs(module: nn.Module) -> nn.Module:
    for name, child in module.named_children():
        if isinstance(child, nn.Conv1d) and child.stride == (1,) and child.groups == 1:
            setattr(module, name, MatmulConv1d(child))
        else:
            matmul_convs(child)
    return module


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    unet = ConditionalUnet1D().to(device).eval()
    sample, cond = torch.randn(1, 16, 2, device=device), torch.randn(1, 1028, device=device)
    t = torch.tensor(50, device=device)
    want = unet(sample, t, cond)
    variants = {"cuDNN convs": unet, "matmul convs": matmul_convs(copy.deepcopy(unet))}
    for name, net in list(variants.items()):
        variants[f"{name}, bf16"] = copy.deepcopy(net).to(torch.bfloat16)
    for name, net in variants.items():
        dtype = next(net.parameters()).dtype
        for compiled in (False, True):
            run = torch.compile(net, fullgraph=True) if compiled else net
            with torch.no_grad():
                call = lambda run=run, dtype=dtype: run(sample.to(dtype), t, cond.to(dtype))  # noqa: E731
                error = float((call().float() - want).abs().max())
                replay = graphed(call, device)
                ms = time_call(replay, device, warmup=10, runs=100).median_ms
            label = f"{name}{', compiled' if compiled else ''}"
            print(f"{label:32s} {ms:.3f} ms per call graphed, max |diff| {error:.2e}", flush=True)
            if name == "cuDNN convs" and compiled:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        replay()
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
