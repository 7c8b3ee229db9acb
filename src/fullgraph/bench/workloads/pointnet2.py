"""PointNet++ SSG classification (fps + ball query + grouping + shared MLP + max, three
levels): the plain-PyTorch sampling and grouping users write against fullgraph's
operators, eager, compiled and with CUDA graphs; forward and an Adam train step."""

from __future__ import annotations

import copy
import functools

import torch

from ...models import PointNet2
from .base import Case, Workload, register, whole_step_case

PLAIN_EAGER = "plain eager"


def _variants(device: torch.device):
    """(name, implementation, torch.compile options or None for eager)."""
    variants = [
        (PLAIN_EAGER, "plain", None),
        ("plain compiled", "plain", {}),
        ("fullgraph eager", "fullgraph", None),
        ("fullgraph compiled", "fullgraph", {"fullgraph": True}),
    ]
    if device.type == "cuda":
        variants.append(("fullgraph compiled+graphs", "fullgraph", {"fullgraph": True, "mode": "reduce-overhead"}))
    return variants


def model_cases(model: torch.nn.Module, params: dict, device: torch.device, task: str,
                plain_compiled=lambda model: model, whole_step: tuple[str, ...] = ()) -> list[Case]:
    """The variants of a point-cloud model with an ``implementation`` switch ("plain" /
    "fullgraph") on random clouds [batch, points, 3]: forward, and an Adam step on a
    classification (40 classes) or per-point regression loss. ``plain_compiled(model)``
    prepares the plain implementation for torch.compile. ``whole_step``: the implementations
    whose whole train step is also replayed from one CUDA graph (on GPUs)."""
    generator = torch.Generator().manual_seed(0)
    xyz = torch.rand(params["batch"], params["points"], 3, generator=generator).to(device)
    labels = torch.randint(0, 40, (params["batch"],), generator=generator).to(device)
    cases = []
    for name, implementation, options in _variants(device):
        variant = copy.deepcopy(model).to(device)
        variant.implementation = implementation
        if options is not None and implementation == "plain":
            variant = plain_compiled(variant)
        run = variant if options is None else torch.compile(variant, **options)
        optimizer = torch.optim.Adam(variant.parameters(), lr=1e-3)

        def forward(run=run, variant=variant):
            variant.eval()
            with torch.no_grad():
                return run(xyz)

        def train_step(run=run, variant=variant, optimizer=optimizer):
            variant.train()
            optimizer.zero_grad()
            out = run(xyz)
            loss = _loss(task, labels, out)
            loss.backward()
            optimizer.step()
            return loss

        cases.append(Case(name, forward, train_step, explain=(variant, (xyz,)) if options is None else None))
    for implementation in whole_step if device.type == "cuda" else ():
        whole = copy.deepcopy(model).to(device)
        whole.implementation = implementation
        cases.append(whole_step_case(f"{implementation} compiled, whole step graphed", whole, (xyz,),
                                     functools.partial(_loss, task, labels)))
    return cases


def _loss(task: str, labels: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, labels) if task == "classification" else out.square().mean()


def _cases(params: dict, device: torch.device) -> list[Case]:
    torch.manual_seed(0)
    return model_cases(PointNet2(num_classes=40), params, device, "classification",
                       plain_compiled=PointNet2.sample_outside_the_graph)


register(Workload(
    name="pointnet2",
    description="PointNet++ SSG classification: fps + ball query + grouping + shared MLP + max, three levels",
    sizes={"seed": {"batch": 32, "points": 1024}, "small": {"batch": 4, "points": 1024},
           "tiny": {"batch": 2, "points": 600}},
    build=_cases,
    notes=["plain: the FPS loop, a dense cdist for the ball query and a sort, as PointNet++ ports write them; "
           "plain compiled leaves the FPS loop out of the graph (compiling it unrolls 640 steps: 275 s, then a C++ "
           "compiler failure on a CPU); fullgraph: fullgraph.fps (one operator), ball_query(order='first') and "
           "knn_gather"],
    baseline=PLAIN_EAGER,
))
