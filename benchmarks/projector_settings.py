"""The seed projectors' forward and whole train step (graphed, as `fullgraph bench` times
"fullgraph compiled, whole step graphed") under other settings of the Triton neighbour
backend and the narrow MLPs, all in one process: each setting a fresh model, compiled and
captured again.

    python benchmarks/projector_settings.py [ATTRIBUTE ... | defaults] > settings.log     (needs a CUDA device)
"""

from __future__ import annotations

import sys

import torch

from fullgraph.bench import WORKLOADS
from fullgraph.bench.timing import time_call
from fullgraph.ops import mlp
from fullgraph.ops.neighbors.triton import backend as triton_grid

# (module, attribute, values, projectors); the first value of each is the default, restored after.
# (Session 26: grid.lower_bounds by counts and a scan instead of binary searches measured even,
# kNN forward / train 0.327 / 0.566 against 0.339 / 0.565 ms, radius 0.351 / 0.855 against
# 0.354 / 0.845, run OI; not kept. The MLPs' "ieee" products: kNN train 1.08 -> 2.70 ms, run OH.)
SETTINGS = ((mlp, "PRECISION", ("tf32x3", "ieee"), ("knn", "radius")),
            (triton_grid, "RADIUS_CELL_SIDE", (1.0, 0.9, 1.2), ("radius",)),
            (triton_grid, "AGGREGATE_PRECISION", ("ieee", "tf32x3"), ("radius",)),
            (triton_grid, "GRAD_PRECISION", ("tf32x3", "ieee"), ("radius",)),
            # (ncu, session 28 run QE: the gradient kernel at 255 registers a thread with spills, 2
            # blocks of 4 warps an SM; the aggregation at 144, 3 blocks: more warps spread the tiles)
            (triton_grid, "GRAD_BLOCKS", (((16, 32), (32, 16), 2), ((16, 32), (64, 32), 4), ((16, 32), (16, 16), 2),
                                          ((16, 32), (64, 16), 2)), ("radius",)),
            (triton_grid, "AGGREGATE_BLOCKS", ((16, 32, 4), (16, 32, 8), (32, 32, 8), (16, 64, 8)), ("radius",)),
            (triton_grid, "SEGMENT_LANES", (128, 64, 256), ("radius",)))


def step_ms(which: str, queued: bool = True) -> tuple[float, ...]:
    """(forward, train step, train step with the points' gradients) medians of 50, ms; calls
    queued back to back, or each on an idle GPU (``queued`` False: host latency included)."""
    workload = WORKLOADS[f"{which}-projector"]
    cases = workload.build(workload.sizes["seed"], torch.device("cuda"))
    variant = "fullgraph compiled, whole step graphed"
    case = next(c for c in cases if c.variant == variant)
    points = next(c for c in cases if c.variant == variant + ", point gradients")
    return tuple(time_call(fn, torch.device("cuda"), warmup=5, runs=50, queued=queued).median_ms
                 for fn in (case.forward, case.train_step, points.train_step))


def main() -> None:
    names = sys.argv[1:]  # attributes to vary (all when none is named; "defaults": none)
    # every setting compiles the projectors' one forward code again
    torch._dynamo.config.recompile_limit = 64
    print(torch.cuda.get_device_name(), torch.__version__,
          "whole step graphed, forward / train / train with point gradients, median ms of 50")
    step_ms("radius")  # discarded: a process's first case read a few % slower than the same later (run PE)
    if names == ["defaults"]:
        for queued in (True, False):
            print(f"defaults ({'queued' if queued else 'each call on an idle GPU'}):",
                  ", ".join(f"{w} {'/'.join(f'{t:.3f}' for t in step_ms(w, queued))}" for w in ("knn", "radius")))
        return
    for module, name, values, projectors in SETTINGS:
        if names and name not in names:
            continue
        for value in values:
            setattr(module, name, value)
            times = ", ".join(f"{w} {'/'.join(f'{t:.3f}' for t in step_ms(w))}" for w in projectors)
            print(f"{name} = {value!r}: {times}", flush=True)
        setattr(module, name, values[0])


if __name__ == "__main__":
    main()
