"""Farthest-point sampling: the loop PointNet++ ports write against ``fullgraph.fps`` on each
backend (the PyTorch loop as one operator; the Triton kernel, one launch: a program per cloud
or per part of one, the parts exchanging candidates through L2; the CUDA kernel: a cloud of up
to 65,536 points on one thread-block cluster, built on first use), eager, and the default
backend replayed from a CUDA graph as a compiled model runs it (the GPU's work alone)."""

from __future__ import annotations

import torch

from ...models.pointnet2 import plain_fps
from ...ops.sampling import fps
from .base import Case, Workload, register, replayed

PLAIN = "plain loop"


def _fps(params, device):
    """forward = sample ``samples`` points of each of ``batch`` uniform clouds of ``points``."""
    generator = torch.Generator().manual_seed(0)
    xyz = torch.rand(params["batch"], params["points"], 3, generator=generator).to(device)
    count = params["samples"]
    baseline = plain_fps(xyz, count)

    def agreement(run):
        return lambda: {"same_as_plain": bool(torch.equal(run(), baseline))}

    cases = [Case(PLAIN, lambda: plain_fps(xyz, count))]
    for backend in ("torch", "triton", "cuda"):
        def run(backend=backend):
            return fps(xyz, n_samples=count, random_start=False, backend=backend)
        try:
            run()
        except (ValueError, ImportError, TypeError):  # a backend that does not run here
            continue
        cases.append(Case(f"fullgraph.fps, {backend}", run, check=agreement(run)))
    if device.type == "cuda":
        cases.append(Case("fullgraph.fps, graphed", replayed(
            lambda: fps(xyz, n_samples=count, random_start=False), device)))
    return cases


register(Workload(
    name="fps",
    description="farthest-point sampling of uniform 3-D clouds: PointNet++'s loop against fullgraph.fps per backend",
    sizes={"seed": {"batch": 16, "points": 16384, "samples": 4096},
           "large": {"batch": 1, "points": 1_000_000, "samples": 8192},
           "small": {"batch": 32, "points": 1024, "samples": 512},
           "tiny": {"batch": 2, "points": 500, "samples": 16}},
    build=_fps,
    notes=["floor per sample: latency, not bytes (the cloud stays in registers): a reduction over each part "
           "and, with several parts a cloud, one exchange of their candidates (cuda: through the cluster's "
           "shared memory, ~0.6-0.75 us a sample; triton: through L2, ~1.5-2 us)",
           "eager rows include the call's host time (~0.1 ms: validation, the operator's dispatch); "
           "the graphed row replays the default backend's kernel alone"],
    baseline=PLAIN,
))
