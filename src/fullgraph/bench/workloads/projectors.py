"""PhysicsNeMo's projector tutorial's projectors (kNN and radius): MLP -> neighbour aggregation -> MLP, forward and
an Adam train step, in the tutorial's formulation and fullgraph's, eager, compiled and with
CUDA graphs; external backends (cuML, Warp) where installed."""

from __future__ import annotations

import copy
import functools
import importlib.util

import torch

from ...models import KNNProjector, RadiusProjector
from ...ops.neighbors.registration import BACKENDS
from .base import Case, Workload, outside_torch_pool, register, seed_point_clouds, whole_step_case


def _variants(device: torch.device, external: str | None):
    """(name, aggregation, torch.compile options or None for eager, backend).

    ``external`` ("warp" or "cuml") adds that backend's variants where it is installed."""
    variants = [
        ("document eager", "document", None, "auto"),
        ("document compiled", "document", {}, "auto"),
        ("fullgraph eager", "fullgraph", None, "auto"),
        ("fullgraph compiled", "fullgraph", {"fullgraph": True}, "auto"),
    ]
    if device.type == "cuda":
        with_graphs = {"fullgraph": True, "mode": "reduce-overhead"}
        variants += [
            ("document compiled+graphs", "document", {"mode": "reduce-overhead"}, "auto"),
            ("fullgraph compiled+graphs", "fullgraph", with_graphs, "auto"),
        ]
        if external is not None and importlib.util.find_spec(external) is not None:
            variants.append((f"fullgraph {external} compiled", "fullgraph", {"fullgraph": True}, external))
            if BACKENDS.get(external).capturable is True:
                variants.append((f"fullgraph {external} compiled+graphs", "fullgraph", with_graphs, external))
    return variants


def _projector_cases(model: torch.nn.Module, params: dict, device: torch.device, external=None) -> list[Case]:
    cloud, grid, targets = seed_point_clouds(params["cloud"], params["grid"], 1, device)
    cases = []
    for name, aggregation, options, backend in _variants(device, external):
        variant_model = copy.deepcopy(model).to(device)
        variant_model.aggregation, variant_model.backend = aggregation, backend
        run = variant_model if options is None else torch.compile(variant_model, **options)
        optimizer = torch.optim.Adam(variant_model.parameters(), lr=1e-3)

        def forward(run=run):
            with torch.no_grad():
                return run(grid, cloud)

        def train_step(run=run, optimizer=optimizer):
            optimizer.zero_grad()
            loss = torch.mean((run(grid, cloud) - targets) ** 2)
            loss.backward()
            optimizer.step()
            return loss

        check = functools.partial(outside_torch_pool, device) if device.type == "cuda" else None
        explain = (variant_model, (grid, cloud)) if options is None else None
        cases.append(Case(name, forward, train_step, check, explain))
    if device.type == "cuda":
        # The tutorial's points are data: no gradient, and those kernels do not run; the second
        # case also takes dL/dgrid and dL/dcloud.
        for point_gradients in (False, True):
            whole = copy.deepcopy(model).to(device)
            whole.aggregation = "fullgraph"
            name = "fullgraph compiled, whole step graphed" + (", point gradients" if point_gradients else "")
            cases.append(whole_step_case(name, whole, (grid, cloud), lambda out: torch.mean((out - targets) ** 2),
                                         leaves=point_gradients))
    return cases


def _knn_projector(params, device):
    torch.manual_seed(42)
    return _projector_cases(KNNProjector(k=params["k"], hidden_dim=25, sigma=0.1), params, device, "cuml")


def _radius_projector(params, device):
    torch.manual_seed(42)
    model = RadiusProjector(radius=params["radius"], hidden_dim=25, sigma=0.1)
    return _projector_cases(model, params, device, "warp")


register(Workload(
    name="knn-projector",
    description="PhysicsNeMo's projector: MLP -> kNN-weighted aggregation -> MLP, forward and Adam train step",
    sizes={"seed": {"grid": 30, "cloud": 100_000, "k": 7}, "small": {"grid": 12, "cloud": 8_000, "k": 7},
           "tiny": {"grid": 5, "cloud": 500, "k": 7}},
    build=_knn_projector,
))

register(Workload(
    name="radius-projector",
    description="PhysicsNeMo's projector: MLP -> radius-bounded aggregation -> MLP, forward and Adam train step",
    sizes={"seed": {"grid": 30, "cloud": 25_000, "radius": 0.1},
           "small": {"grid": 12, "cloud": 4_000, "radius": 0.1},
           "tiny": {"grid": 5, "cloud": 500, "radius": 0.5}},
    build=_radius_projector,
))
