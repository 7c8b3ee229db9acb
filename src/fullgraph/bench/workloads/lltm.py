"""PyTorch's LLTM extension tutorial's LLTM cell: the tutorial's PyTorch cell against the C++/CUDA extension."""

from __future__ import annotations

import copy

import torch

from ...models import LLTM
from .base import Case, Workload, register, replayed


def _lltm(params, device):
    """forward = one cell step; train = the step and its backward (the tutorial's loop body:
    ``(new_h.sum() + new_cell.sum()).backward()``), gradients for the weights and bias.
    "graphed" variants capture the eager step (and its backward) in one CUDA graph."""
    generator = torch.Generator().manual_seed(0)
    batch, features, state = params["batch"], params["features"], params["state"]
    x, h, c = (torch.randn(batch, n, generator=generator).to(device) for n in (features, state, state))
    torch.manual_seed(42)
    reference = LLTM(features, state, backend="torch").to(device)
    native = device.type  # the extension's backend for this device ("cpu" or "cuda")
    variants = [("document eager", "torch", None), ("document compiled", "torch", {}),
                ("extension eager", native, None), ("extension compiled", native, {"fullgraph": True})]
    if device.type == "cuda":
        variants += [("document compiled+graphs", "torch", {"mode": "reduce-overhead"}),
                     ("extension compiled+graphs", native, {"fullgraph": True, "mode": "reduce-overhead"}),
                     ("document graphed", "torch", "graphed"), ("extension graphed", native, "graphed")]
    cases = []
    for name, backend, options in variants:
        cell = copy.deepcopy(reference)
        cell.backend = backend
        run = torch.compile(cell, **options) if isinstance(options, dict) else cell

        def forward(run=run):
            with torch.no_grad():
                return run(x, (h, c))

        def train_step(run=run, cell=cell):
            cell.zero_grad(set_to_none=True)
            new_h, new_cell = run(x, (h, c))
            (new_h.sum() + new_cell.sum()).backward()
            return cell.weights.grad

        def gradients(cell=cell):
            new_h, new_cell = cell(x, (h, c))
            return torch.autograd.grad(new_h.sum() + new_cell.sum(), [cell.weights, cell.bias])

        if options == "graphed":
            forward, train_step = replayed(forward, device), replayed(gradients, device)
        cases.append(Case(name, forward, train_step, explain=(cell, (x, (h, c))) if options is None else None))
    return cases


register(Workload(
    name="lltm",
    description="PyTorch's LLTM tutorial: one cell step (forward) and step + backward (train); C++ kernel on CPUs, "
                "CUDA kernel on GPUs",
    sizes={"seed": {"batch": 16, "features": 32, "state": 128}, "small": {"batch": 16, "features": 32, "state": 128},
           "tiny": {"batch": 4, "features": 8, "state": 16},
           # where the extension and plain PyTorch cross on CPUs (the rule of "auto" cites them)
           "batch256": {"batch": 256, "features": 32, "state": 128},
           "batch2048": {"batch": 2048, "features": 32, "state": 128}},
    build=_lltm,
    notes=[("floor at the tutorial's size: ~0.2 MFLOP and ~0.3 MB per step, microseconds of GPU work; "
            "what remains is launch latency (3 kernels forward, 4-6 backward)")],
))
