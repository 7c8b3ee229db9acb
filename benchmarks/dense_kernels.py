"""The dense backend's tensor-core kernels alone, under tile settings: the threshold pass
(``kth_slot_minimum``), the listing pass (``within``, both ways of placing hits) and the
chunk selection (``least_chunks``), against cuBLAS's product of the same operands (TF32,
the floor of one pass's arithmetic), on the issue-14 shapes.

    python benchmarks/dense_kernels.py > dense-kernels.log     (needs a CUDA device)

CUDA-event medians after warm-up, one process.
"""

from __future__ import annotations

import torch

from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors import triton_dense

SHAPES = ((8, 4096, 4096, 64, 20), (32, 1024, 1024, 64, 20), (1, 20000, 200000, 16, 10), (4, 4096, 16384, 32, 50),
          (1, 10000, 1000000, 128, 10))
# (THRESHOLD_BLOCK_M, THRESHOLD_NUM_WARPS, STAGES, WHOLE_MAX_DIM)
SETTINGS = ((64, 4, 3, 64), (64, 4, 2, 64), (64, 4, 4, 64), (64, 8, 3, 64), (128, 8, 3, 64), (128, 4, 3, 64),
            (64, 4, 3, 0), (128, 8, 3, 0), (64, 4, 2, 128))


def median_ms(fn, runs) -> float:
    return time_call(fn, torch.device("cuda"), warmup=2, runs=runs).median_ms


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for batch, rows, columns, dim, k in SHAPES:
        q = torch.randn(batch, rows, dim, device="cuda", generator=generator)
        r = torch.randn(batch, columns, dim, device="cuda", generator=generator)
        q, r = q - r.mean(1, keepdim=True), r - r.mean(1, keepdim=True)
        norms = (r * r).sum(-1)
        runs = 5 if rows * columns > 1e9 else 20
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            floor = median_ms(lambda: torch.baddbmm(norms[:, None, :], q, r.transpose(1, 2), alpha=-2), runs)
        except torch.OutOfMemoryError:
            floor = float("nan")
        torch.backends.cuda.matmul.allow_tf32 = False
        print(f"B={batch} M={rows} N={columns} D={dim} k={k}: cuBLAS TF32 product {floor:.3f} ms", flush=True)
        kth = triton_dense.kth_slot_minimum(q, r, norms, k, "tf32")
        bound = 3 * 2 * 2.0**-9 * (q * q).sum(-1).sqrt() * norms.amax(-1, keepdim=True).sqrt()
        limit = kth + bound
        cap = max(64, triton_dense.triton.next_power_of_2(2 * k + 8))
        for block_m, warps, stages, whole in SETTINGS:
            triton_dense.THRESHOLD_BLOCK_M, triton_dense.THRESHOLD_NUM_WARPS = block_m, warps
            triton_dense.STAGES, triton_dense.WHOLE_MAX_DIM = stages, whole
            row = {}
            try:
                row["kth tf32"] = median_ms(lambda: triton_dense.kth_slot_minimum(q, r, norms, k, "tf32"), runs)
                row["kth tf32x3"] = median_ms(lambda: triton_dense.kth_slot_minimum(q, r, norms, k, "tf32x3"), runs)
                for scan in (False, True):
                    triton_dense.WITHIN_SCAN = scan
                    row[f"within scan={scan}"] = median_ms(lambda: triton_dense.within(q, r, norms, limit, cap, "tf32"),
                                                           runs)
                triton_dense.WITHIN_SCAN = False
                if columns <= triton_dense.FUSED_MAX_COLUMNS:
                    row["least_chunks tf32x3"] = median_ms(
                        lambda: triton_dense.least_chunks(q, r, norms, k + 5, triton_dense.FUSED_CHUNK, "tf32x3"), runs)
            except Exception as error:  # a setting the compiler refuses (shared memory): say so, go on
                row["error"] = f"{type(error).__name__}: {str(error)[:120]}"
            cells = ", ".join(f"{n} {v:.3f}" if isinstance(v, float) else f"{n} {v}" for n, v in row.items())
            print(f"  BLOCK_M={block_m} warps={warps} stages={stages} whole<={whole}: {cells} ms", flush=True)
        _, counts = triton_dense.within(q, r, norms, limit, cap, "tf32")
        print(f"  lists: mean {counts.float().mean():.1f}, max {int(counts.max())}, cut {int((counts > cap).sum())}",
              flush=True)


if __name__ == "__main__":
    main()
