"""The radius aggregation's cell size (``triton_grid.RADIUS_CELL_SIDE``, radii a side, and
``RADIUS_CELL_POINTS``, the most references a query's cell holds; side 0: that many always)
beyond the seed: graphed forward + backward (gradients of the points and features) of
``fullgraph.radius_aggregate`` on uniform and normal clouds at radii holding ~8 to ~250
references, by setting, ms (CUDA-event medians of graph replays, one process).

    python benchmarks/radius_cells.py > radius-cells.log     (needs a CUDA device)
"""

from __future__ import annotations

import math

import torch
from replay_profile import graphed_ms

import fullgraph
from fullgraph.ops.neighbors.triton import backend as triton_grid

SETTINGS = ((1.2, 8), (1.0, 8), (0.9, 8), (1.5, 8), (0.0, 8), (0.0, 2))  # (RADIUS_CELL_SIDE, RADIUS_CELL_POINTS)
POINTS, CHANNELS = 100_000, 16
NEIGHBOURS = (8, 32, 250)  # references within the radius, on average (uniform cloud)


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    clouds = {"uniform": torch.rand(POINTS, 3, device="cuda", generator=generator),
              "normal": torch.randn(POINTS, 3, device="cuda", generator=generator)}
    features = torch.randn(POINTS, CHANNELS, device="cuda", generator=generator).requires_grad_()
    print(torch.cuda.get_device_name(), torch.__version__, f"{POINTS:,} points, {CHANNELS} channels, "
          "forward + backward graphed, ms by (RADIUS_CELL_SIDE, RADIUS_CELL_POINTS)", SETTINGS, flush=True)
    for name, cloud in clouds.items():
        points = cloud.clone().requires_grad_()
        for neighbours in NEIGHBOURS:
            radius = (3 * neighbours / (4 * math.pi * POINTS)) ** (1 / 3)  # in the unit cube
            if name == "normal":
                radius *= 2.5  # about as many near the normal cloud's core (density (2 pi)^-1.5 N)

            def step():
                out = fullgraph.radius_aggregate(points, points, features, radius)
                out.square().sum().backward()
                points.grad = features.grad = None

            times, default = [], (triton_grid.RADIUS_CELL_SIDE, triton_grid.RADIUS_CELL_POINTS)
            for triton_grid.RADIUS_CELL_SIDE, triton_grid.RADIUS_CELL_POINTS in SETTINGS:
                times.append(graphed_ms(step, runs=30))
            triton_grid.RADIUS_CELL_SIDE, triton_grid.RADIUS_CELL_POINTS = default
            print(f"{name}, radius {radius:.4f} (~{neighbours} neighbours):", " / ".join(f"{t:.3f}" for t in times),
                  flush=True)


if __name__ == "__main__":
    main()
