"""PyG's own DGCNN and PointNet++ classification models (``fullgraph.models.pyg``; their edge
MLPs without batch norm, so that every variant runs the same model) with their point-cloud
operators from ``fullgraph.compat.pyg.install()``: fullgraph's reference backend (the plain
PyTorch search: a distance matrix and top-k, the FPS loop), torch_cluster's own kernels where it
is installed, fullgraph's kernels eagerly, and the whole model compiled as one graph; forward
and an Adam train step."""

from __future__ import annotations

import copy
import importlib.util

import torch

from .base import Case, Workload, register

PLAIN = "pyg on plain pytorch eager"
SIZES = {"seed": {"batch": 8, "points": 1024, "k": 20}, "small": {"batch": 4, "points": 512, "k": 20},
         "tiny": {"batch": 2, "points": 256, "k": 10}}


def _variants():
    """(name, backend of PyG's operators, torch.compile options or None); torch_cluster's own
    kernels (the peer PyG called before 2.7) where it is installed."""
    peer = [("pyg on torch_cluster eager", "torch_cluster", None)] if importlib.util.find_spec("torch_cluster") else []
    return [(PLAIN, "torch", None), *peer, ("pyg on fullgraph eager", "auto", None),
            ("pyg on fullgraph compiled", "auto", {"fullgraph": True})]


def _cases(model_name: str):
    def build(params: dict, device: torch.device) -> list[Case]:
        if importlib.util.find_spec("torch_geometric") is None:
            raise ValueError(f"pyg-{model_name.lower()}: needs torch_geometric (pip install 'fullgraph[pyg]')")
        from ...compat import pyg
        from ...models import pyg as models

        pyg.install()
        torch.manual_seed(0)
        model = models.DGCNN(40, k=params["k"], norm=None) if model_name == "DGCNN" else models.PointNet2(40, norm=None)
        generator = torch.Generator().manual_seed(0)
        count = params["batch"]
        pos = torch.rand(count * params["points"], 3, generator=generator).to(device)
        batch = torch.arange(count).repeat_interleave(params["points"]).to(device)
        labels = torch.randint(0, 40, (count,), generator=generator).to(device)
        cases = []
        for name, backend, options in _variants():
            variant = copy.deepcopy(model).to(device)
            run = variant if options is None else torch.compile(variant, **options)
            optimizer = torch.optim.Adam(variant.parameters(), lr=1e-3)

            def forward(run=run, variant=variant, backend=backend):
                pyg.install(backend)
                variant.eval()
                with torch.no_grad():
                    return run(pos, batch, count)

            def train_step(run=run, variant=variant, optimizer=optimizer, backend=backend):
                pyg.install(backend)
                variant.train()
                optimizer.zero_grad()
                loss = torch.nn.functional.nll_loss(run(pos, batch, count), labels)
                loss.backward()
                optimizer.step()
                return loss

            cases.append(Case(name, forward, train_step))
        return cases
    return build


NOTES = ["models: PyG's dgcnn_classification.py / pointnet2_classification.py (fullgraph.models.pyg), edge MLPs "
         "without batch norm (batch norm over a data-dependent edge count does not compile with fullgraph=True)",
         "plain pytorch: pyg.install('torch'), fullgraph's reference backend (distance matrix + top-k, the FPS "
         "loop); fullgraph: pyg.install() (its kernels); torch_cluster: pyg.install('torch_cluster'), its own "
         "kernels (built from source: no wheel for this torch); pyg-lib (not on PyPI) is not in these rows"]

register(Workload(name="pyg-dgcnn", description="PyG's DGCNN (two DynamicEdgeConv layers, k nearest in feature "
                  "space) on fullgraph's operators", sizes=SIZES, build=_cases("DGCNN"), notes=NOTES, baseline=PLAIN))
register(Workload(name="pyg-pointnet2", description="PyG's PointNet++ (fps, radius, PointNetConv, two levels) on "
                  "fullgraph's operators", sizes=SIZES, build=_cases("PointNet2"), notes=NOTES, baseline=PLAIN))
