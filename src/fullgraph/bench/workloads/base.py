"""What a benchmark workload is: ``Case`` (one variant's callables) and ``Workload`` (its
sizes and how to build the cases), the registry the CLI reads, and helpers shared by workloads."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ... import graphs

BASELINE = "document eager"


@dataclass
class Case:
    """One variant: a forward callable and, where it trains, a train-step callable."""

    variant: str
    forward: Callable[[], object]
    train_step: Callable[[], object] | None = None
    check: Callable[[], dict] | None = None  # extra fields for the forward row (e.g. error vs eager)
    explain: tuple | None = None  # (callable, args): what `fullgraph explain` compiles for this variant
    group: str | None = None  # consecutive cases of one group are timed side by side (in turns)


@dataclass
class Workload:
    name: str
    description: str
    sizes: dict[str, dict]
    build: Callable[[dict, torch.device], list[Case]]
    notes: list[str] = field(default_factory=list)
    baseline: str = BASELINE  # the variant the "x eager" ratios divide by
    collective: bool = False  # its variants are torch.distributed collectives: every rank runs them in step


WORKLOADS: dict[str, Workload] = {}


def register(workload: Workload) -> Workload:
    WORKLOADS[workload.name] = workload
    return workload


def seed_point_clouds(n_cloud: int, grid_side: int, target_features: int, device, dtype=torch.float32):
    """The tutorial's data: a normal cloud [n_cloud, 3], a [-1, 1]^3 grid [grid_side^3, 3],
    and random targets [grid_side^3, target_features]."""
    generator = torch.Generator(device="cpu").manual_seed(42)
    cloud = torch.randn(n_cloud, 3, generator=generator, dtype=dtype)
    axis = torch.linspace(-1, 1, grid_side, dtype=dtype)
    grid = torch.stack([c.flatten() for c in torch.meshgrid(axis, axis, axis, indexing="ij")], dim=1)
    targets = torch.randn(grid.shape[0], target_features, generator=generator, dtype=dtype)
    return cloud.to(device), grid.to(device), targets.to(device)


def outside_torch_pool(device: torch.device) -> dict:
    """Device memory in use that PyTorch's caching allocator does not hold (the CUDA
    context, library workspaces, external libraries' own pools), in bytes."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return {"outside_torch_pool_bytes": total - free - torch.cuda.memory_reserved(device)}


def replayed(fn, device: torch.device):
    """``fn`` (no arguments) captured in a CUDA graph on its first call (the timing's first
    call, so capture counts as first-call time), then replayed: times the GPU's work alone."""
    replay = None

    def call():
        nonlocal replay
        if replay is None:
            graph, _ = graphs.capture(fn, device)
            replay = graph.replay
        return replay()

    return call


def whole_step_case(name: str, model: torch.nn.Module, inputs: tuple, loss_of: Callable, leaves: bool = False) -> Case:
    """The whole train step (forward, loss, backward, Adam) replayed from one CUDA graph: the
    model compiled (default mode), Adam fused (one kernel for every parameter;
    ``capturable=True``: its step counts on the device), gradients set to None after the step
    (the next backward writes them afresh from the graph's memory pool instead of adding into
    zeroed ones: no accumulation kernels), all captured by fullgraph.graphs; the forward
    (eval mode, no gradients) graphed alike. ``loss_of(output)`` -> the scalar loss.
    ``leaves``: the step also takes the gradients of the inputs (leaves of the step, not graph
    inputs: fullgraph.graphs copies its inputs, detached)."""
    compiled = torch.compile(model, fullgraph=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True, fused=True)
    points = [x.clone().requires_grad_() for x in inputs] if leaves else []

    def step(*args):
        model.train()
        loss = loss_of(compiled(*(points or args)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for point in points:
            point.grad = None
        return loss

    @torch.no_grad()
    def evaluate(*args):
        model.eval()
        return compiled(*args)

    return Case(name, functools.partial(graphs.graphed(evaluate), *inputs),
                functools.partial(graphs.graphed(step), *inputs))
