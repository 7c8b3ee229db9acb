"""The seed projectors' whole train step (graphed, as `fullgraph bench` times "fullgraph
compiled, whole step graphed") under other settings of the Triton neighbour backend, all in
one process: each setting a fresh model, compiled and captured again.

    python benchmarks/projector_settings.py > settings.log     (needs a CUDA device)
"""

from __future__ import annotations

import torch

from fullgraph.bench import WORKLOADS
from fullgraph.bench.timing import time_call
from fullgraph.ops.neighbors import triton_grid

# (module attribute, values); the first value of each is the default, restored after.
SETTINGS = (("GRAD_REF_BLOCKS", ((32, 16, 4), (16, 16, 4), (32, 32, 4), (64, 16, 4), (16, 32, 2), (32, 16, 2))),
            ("AGGREGATE_BLOCKS", ((32, 16, 4), (16, 16, 4), (64, 16, 4), (32, 32, 4))))
WORKLOADS_OF = {"GRAD_REF_BLOCKS": ("radius",), "AGGREGATE_BLOCKS": ("radius",)}


def step_ms(which: str) -> float:
    workload = WORKLOADS[f"{which}-projector"]
    cases = workload.build(workload.sizes["seed"], torch.device("cuda"))
    step = next(c for c in cases if c.variant == "fullgraph compiled, whole step graphed").train_step
    return time_call(step, torch.device("cuda"), warmup=5, runs=50).median_ms


def main() -> None:
    # every setting compiles the projectors' one forward code again
    torch._dynamo.config.recompile_limit = 64
    print(torch.cuda.get_device_name(), torch.__version__, "whole train step graphed, median ms of 50")
    for name, values in SETTINGS:
        for value in values:
            setattr(triton_grid, name, value)
            times = ", ".join(f"{w} {step_ms(w):.3f}" for w in WORKLOADS_OF.get(name, ("knn", "radius")))
            print(f"{name} = {value!r}: {times}", flush=True)
        setattr(triton_grid, name, values[0])


if __name__ == "__main__":
    main()
