"""One whole train step of the seed projectors (forward, backward and Adam replayed from one
CUDA graph, as `fullgraph bench knn-projector` / `radius-projector` time it as "fullgraph
compiled, whole step graphed"): the kernels of a replay, their time and the gaps.

    python benchmarks/projector_profile.py [knn|radius] [points] > projector.log     (needs a CUDA device)

With "points", the step also takes the gradients of both point clouds (the variant "whole step
graphed, point gradients"); without, the tutorial's points are data.
"""

from __future__ import annotations

import sys

import torch
from replay_profile import report

from fullgraph.bench import WORKLOADS

FLOOR = ("tens of microseconds: the seed's MLPs on <= 100,000 x 25 values and one search read a few MB "
         "(~2 us at 3.35 TB/s); the rest is the launches' own latency (~2-4 us each in a graph)")


def main(which: str = "knn", points: str = "") -> None:
    workload = WORKLOADS[f"{which}-projector"]
    cases = workload.build(workload.sizes["seed"], torch.device("cuda"))
    variant = "fullgraph compiled, whole step graphed" + (", point gradients" if points == "points" else "")
    step = next(c for c in cases if c.variant == variant).train_step
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    report(step, f"{which} projector, seed size, one {variant.removeprefix('fullgraph compiled, ')} train step", FLOOR,
           sequence=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
