"""Where a DGCNN step's time goes (``fullgraph bench edgeconv``'s seed size: B=8, 4,096
points, k=20): forward (eval) and Adam train step medians, then a torch.profiler table of
the train step's CUDA kernels, for DGCNN's plain code compiled, fullgraph compiled with CUDA
graphs, and fullgraph's kNN with the edges through the 1x1 convolution (EdgeConv's previous
formulation, to A/B the per-point products).

    python benchmarks/edgeconv_profile.py [--batch 8 --points 4096 --k 20] [--timeline] > edgeconv-profile.log
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch.profiler import ProfilerActivity, profile

from fullgraph.bench.timing import time_call
from fullgraph.models import DGCNN
from fullgraph.models.edgeconv import EdgeConv
from fullgraph.ops.neighbors import knn_gather

VARIANTS = (("plain compiled", "plain", {}),
            ("fullgraph compiled+graphs", "fullgraph", {"fullgraph": True, "mode": "reduce-overhead"}),
            ("edges through the convolution, compiled+graphs", "edges", {"fullgraph": True, "mode": "reduce-overhead"}))


def _edges_mlp(self, x, idx):
    """EdgeConv's previous formulation: every edge [x_i, x_j - x_i] through the MLP."""
    neighbours = knn_gather(x, idx)
    centre = x[:, :, None, :].expand_as(neighbours)
    edges = torch.cat([centre, neighbours - centre], -1).permute(0, 3, 1, 2)
    return self.mlp(edges).amax(-1).transpose(1, 2)


def steps(model, implementation, options, xyz):
    variant = copy.deepcopy(model).cuda()
    if implementation == "edges":
        for layer in variant.modules():
            if isinstance(layer, EdgeConv):
                layer._per_point = _edges_mlp.__get__(layer)
        implementation = "fullgraph"
    variant.implementation = implementation
    run = torch.compile(variant, **options)
    optimizer = torch.optim.Adam(variant.parameters(), lr=1e-3)

    def forward():
        variant.eval()
        with torch.no_grad():
            return run(xyz)

    def train():
        variant.train()
        optimizer.zero_grad()
        loss = run(xyz).square().mean()
        loss.backward()
        optimizer.step()
        return loss

    return forward, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--points", type=int, default=4096)
    parser.add_argument("--k", type=int, default=20)
    parser.add_argument("--timeline", action="store_true", help="also every kernel of one fullgraph train step")
    parser.add_argument("--only", choices=[name for name, _, _ in VARIANTS], help="this variant alone")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DGCNN(out_channels=16, k=args.k)
    xyz = torch.rand(args.batch, args.points, 3, generator=torch.Generator().manual_seed(0)).cuda()
    device = torch.device("cuda")
    for name, implementation, options in VARIANTS:
        if args.only not in (None, name):
            continue
        forward, train = steps(model, implementation, options, xyz)
        ms = [time_call(fn, device, warmup=3, runs=20).median_ms for fn in (forward, train)]
        print(f"{name}: forward {ms[0]:.3f} ms, train {ms[1]:.3f} ms", flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                train()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=70))
        if args.timeline and implementation == "fullgraph":
            timeline(train)


def timeline(train) -> None:
    """Every CUDA kernel and copy of one train step in the order it ran: start (us from the
    first), duration (us), name; then the host's operations of 20 us or more on the same clock
    (what the host did while the device waited)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        train()
        torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    first = device[0].time_range.start if device else 0
    for e in device:
        print(f"{e.time_range.start - first:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:110]}")
    print("host:")
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.elapsed_us() >= 20:
            print(f"{e.time_range.start - first:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:110]}")


if __name__ == "__main__":
    main()
