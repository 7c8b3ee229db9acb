"""fullgraph.compat under torch.compile(fullgraph=True, dynamic=True): one compile for three
sizes, equal results; PyG's own models on fullgraph's operators compile and train."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from fullgraph.compat import pyg, pytorch3d, torch_cluster

pytestmark = pytest.mark.slow


def _flat(n, generator):
    pos = torch.rand(n, 3, generator=generator)
    batch = torch.arange(3).repeat_interleave(torch.tensor([n // 3, n // 3, n - 2 * (n // 3)]))
    return pos, batch


CALLS = {
    "torch_cluster.knn": lambda p, b: torch_cluster.knn(p, p[::2], 3, b, b[::2]),
    "torch_cluster.knn_graph": lambda p, b: torch_cluster.knn_graph(p, 3, b),
    "torch_cluster.radius": lambda p, b: torch_cluster.radius(p, p[::2], 0.3, b, b[::2], max_num_neighbors=8),
    "torch_cluster.radius_graph": lambda p, b: torch_cluster.radius_graph(p, 0.3, b),
    "torch_cluster.fps": lambda p, b: torch_cluster.fps(p, b, 0.5, random_start=False),
    "torch_cluster.nearest": lambda p, b: torch_cluster.nearest(p, p[::3], b, b[::3]),
    "torch_cluster.grid_cluster": lambda p, b: torch_cluster.grid_cluster(p, torch.tensor([0.25, 0.25, 0.25])),
    "pyg.voxel_grid": lambda p, b: pyg.voxel_grid(p, 0.25, b),
    "pyg.knn_interpolate": lambda p, b: pyg.knn_interpolate(p * 2, p, p[::2], b, b[::2], k=3),
    "pytorch3d.knn_points": lambda p, b: pytorch3d.knn_points(p.view(1, -1, 3), p.view(1, -1, 3), K=4)[:2],
    "pytorch3d.ball_query": lambda p, b: pytorch3d.ball_query(p.view(1, -1, 3), p.view(1, -1, 3), K=4,
                                                              radius=0.3)[:2],
    "pytorch3d.sample_farthest_points": lambda p, b: pytorch3d.sample_farthest_points(p.view(1, -1, 3), K=5),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_compiles_once_for_three_sizes(name, generator):
    call, counter = CALLS[name], CompileCounter()
    compiled = torch.compile(call, backend=counter, fullgraph=True, dynamic=True)
    for n in (30, 45, 61):
        pos, batch = _flat(n, generator)
        got, want = compiled(pos, batch), call(pos, batch)
        for a, b in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
            torch.testing.assert_close(a, b)
    assert counter.frame_count == 1


@pytest.mark.parametrize("model_name", ["DGCNN", "PointNet2"])
def test_pyg_models_compile_as_one_graph_on_fullgraph_operators_and_train(model_name, generator):
    pytest.importorskip("torch_geometric")
    from fullgraph.models import pyg as models

    pyg.install()
    torch.manual_seed(0)
    model = getattr(models, model_name)(10, norm=None) if model_name == "PointNet2" else models.DGCNN(10, k=6,
                                                                                                      norm=None)
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for points in (48, 64, 56, 64):
        pos = torch.rand(4 * points, 3, generator=generator)
        batch = torch.arange(4).repeat_interleave(points)
        labels = torch.randint(10, (4,), generator=generator)
        loss = torch.nn.functional.nll_loss(compiled(pos, batch, 4), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    assert counter.frame_count == 1 and all(torch.isfinite(torch.tensor(losses)))
    model.eval()  # eager PyG on fullgraph's operators gives the compiled forward's output
    pos, batch = torch.rand(120, 3, generator=generator), torch.arange(2).repeat_interleave(60)
    torch.manual_seed(1)
    want = model(pos, batch, 2)
    torch.manual_seed(1)
    torch.testing.assert_close(compiled(pos, batch, 2), want, rtol=1e-4, atol=1e-5)


def test_pyg_pool_functions_and_layers_run_on_fullgraph_operators(generator):
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn import DynamicEdgeConv, fps, knn_graph, knn_interpolate, radius_graph

    pyg.install()
    pos, batch = _flat(60, generator)
    assert torch.equal(knn_graph(pos, 4, batch, loop=True), torch_cluster.knn_graph(pos, 4, batch, loop=True))
    assert torch.equal(radius_graph(pos, 0.3, batch), torch_cluster.radius_graph(pos, 0.3, batch))
    assert torch.equal(fps(pos, batch, 0.5, random_start=False), torch_cluster.fps(pos, batch, 0.5, False))
    torch.testing.assert_close(knn_interpolate(pos, pos, pos[::2], batch, batch[::2]),
                               pyg.knn_interpolate(pos, pos, pos[::2], batch, batch[::2]))
    conv = DynamicEdgeConv(torch.nn.Linear(6, 8), k=4)
    assert conv(pos, batch).shape == (60, 8)


def test_install_routes_pyg_to_torch_clusters_own_kernels(generator):
    """install("torch_cluster") (the peer the bench times) gives PyG torch_cluster's kernels:
    the same edges as fullgraph's where nothing ties; without torch_cluster, a clear error."""
    pytest.importorskip("torch_geometric")
    import importlib.util

    if importlib.util.find_spec("torch_cluster") is None:
        with pytest.raises(ValueError, match="backend='torch_cluster' needs torch_cluster"):
            pyg.install("torch_cluster")
        return
    from torch_geometric.nn import fps, knn, nearest, radius

    pos, batch = _flat(90, generator)
    if torch.cuda.is_available():
        pos, batch = pos.cuda(), batch.cuda()
    calls = (lambda: knn(pos, pos[::2], 4, batch, batch[::2]),
             lambda: radius(pos, pos[::3], 0.3, batch, batch[::3], max_num_neighbors=90),
             lambda: nearest(pos, pos[::3], batch, batch[::3]), lambda: fps(pos, batch, 0.5, random_start=False))
    try:
        results = []
        for backend in ("torch_cluster", "auto"):
            pyg.install(backend)
            results.append([call() for call in calls])
    finally:
        pyg.install()
    for peer, ours in zip(*results):
        if peer.dim() == 2:  # edges as sets (the order of a query's neighbours may differ)
            peer, ours = (torch.unique(e[0] * 1000 + e[1]) for e in (peer, ours))
        assert torch.equal(peer, ours)
