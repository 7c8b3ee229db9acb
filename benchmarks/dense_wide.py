"""Feature-space kNN beyond D = 128 on CUDA, where "auto" takes the dense backend outside a
capture: median ms of fullgraph.knn against cdist + topk (CUDA events), and whether the lists
equal the torch backend's (up to 5 x 10^8 pairs).

    python benchmarks/dense_wide.py > dense-wide.log     (needs a CUDA device)
"""

from __future__ import annotations

import torch

import fullgraph
from fullgraph.bench.timing import time_call

SHAPES = [(1, 4096, 100_000, 256, 10), (1, 10_000, 200_000, 512, 16), (8, 2048, 2048, 256, 20)]  # B, M, N, D, k


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    for batch, rows, columns, dim, k in SHAPES:
        query = torch.randn(batch, rows, dim, device="cuda")
        ref = torch.randn(batch, columns, dim, device="cuda")

        def ms(fn):
            return time_call(fn, query.device, warmup=1, runs=5).median_ms
        auto = ms(lambda: fullgraph.knn(query, ref, k))
        plain = ms(lambda: torch.cdist(query, ref).topk(k, largest=False))
        same = "-"
        if rows * columns <= 5e8:
            same = torch.equal(fullgraph.knn(query, ref, k)[1], fullgraph.knn(query, ref, k, backend="torch")[1])
        print(f"B={batch} {rows}x{columns} D={dim} k={k}: auto {auto:.1f} ms, cdist+topk {plain:.1f} ms, "
              f"same as torch backend: {same}", flush=True)


if __name__ == "__main__":
    main()
