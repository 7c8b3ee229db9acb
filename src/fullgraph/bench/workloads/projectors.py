"""PhysicsNeMo's projector tutorial's projectors (kNN and radius): MLP -> neighbour aggregation -> MLP, forward and
an Adam train step, in the tutorial's formulation and fullgraph's, eager, compiled and with
CUDA graphs; external backends (cuML, Warp) where installed."""

from __future__ import annotations

import copy
import functools
import importlib.util

import torch

from ... import graphs
from ...models import KNNProjector, RadiusProjector
from ...ops.neighbors.registration import BACKENDS
from .base import Case, Workload, outside_torch_pool, register, seed_point_clouds


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
        for point_gradients in (False, True):
            cases.append(_whole_step_case(copy.deepcopy(model).to(device), grid, cloud, targets, point_gradients))
    return cases


def _whole_step_case(model: torch.nn.Module, grid, cloud, targets, point_gradients: bool) -> Case:
    """The whole train step (forward, backward, Adam) replayed from one CUDA graph: the model
    compiled (default mode), Adam fused (one kernel for every parameter; ``capturable=True``:
    its step counts on the device), gradients set to None after the step (the next backward writes
    them afresh from the graph's memory pool instead of adding into zeroed ones: no accumulation
    kernels), all captured by fullgraph.graphs.
    The tutorial's points are data: no gradient, and those kernels do not run. With
    ``point_gradients`` the step also takes dL/dgrid and dL/dcloud (leaves of the step, not
    graph inputs: fullgraph.graphs copies its inputs, detached)."""
    model.aggregation = "fullgraph"
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True, fused=True)
    points = [grid.clone().requires_grad_(), cloud.clone().requires_grad_()] if point_gradients else []

    def step(grid, cloud, targets):
        if points:
            grid, cloud = points
        loss = torch.mean((compiled(grid, cloud) - targets) ** 2)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for point in points:
            point.grad = None
        return loss

    train_step = functools.partial(graphs.graphed(step), grid, cloud, targets)
    forward = functools.partial(graphs.graphed(torch.no_grad()(compiled)), grid, cloud)
    name = "fullgraph compiled, whole step graphed" + (", point gradients" if point_gradients else "")
    return Case(name, forward, train_step)


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
