"""Where the graph builders' time goes at 10^6 uniform points: kNN at k = 16 and 17 (what
knn_graph without loops searched before it skipped each point itself), the edge list, and
the radius search against radius_graph.

    python benchmarks/graph_builder_parts.py > parts.log     (needs a CUDA device)
"""

from __future__ import annotations

import math

import torch

import fullgraph
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors.cluster import _edges


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    x = torch.rand(1_000_000, 3, generator=torch.Generator().manual_seed(0)).cuda()

    def ms(fn):
        return time_call(fn, x.device, warmup=2, runs=10).median_ms
    for k in (16, 17):
        print(f"knn 1M x 1M k={k}: {ms(lambda: fullgraph.knn(x, x, k)):.2f} ms", flush=True)
    idx = fullgraph.knn(x, x, 17)[1]
    print(f"edges from [1M, 17] lists: {ms(lambda: _edges(idx, x.shape[0], True)):.2f} ms")
    print(f"knn_graph k=16: {ms(lambda: fullgraph.knn_graph(x, 16)):.2f} ms")
    r = (3 * 20 / (4 * math.pi * 1e6)) ** (1 / 3)  # about 20 neighbours a point
    print(f"radius 1M x 1M cap 33: {ms(lambda: fullgraph.radius(x, x, r, 33)):.2f} ms")
    print(f"radius_graph: {ms(lambda: fullgraph.radius_graph(x, r)):.2f} ms")


if __name__ == "__main__":
    main()
