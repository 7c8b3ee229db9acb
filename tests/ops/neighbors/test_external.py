"""The Warp (radius) and cuML (knn) backends: the reference's semantics, gradients, graphs.

They need CUDA and their library; without them only the argument checks run.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

import fullgraph
from conftest import (
    DISTRIBUTIONS, assert_neighbors, oracle_aggregate, oracle_distances, oracle_nearest, points, tolerance,
)

CUDA = torch.cuda.is_available()
needs_warp = pytest.mark.skipif(not CUDA or importlib.util.find_spec("warp") is None, reason="needs CUDA and warp")
needs_cuml = pytest.mark.skipif(not CUDA or importlib.util.find_spec("cuml") is None, reason="needs CUDA and cuml")


def _cloud(distribution, count, generator, dim=3):
    return points(distribution, count, dim, generator).float().cuda()


def test_external_backends_say_what_they_cover():
    cloud = torch.rand(20, 3)
    with pytest.raises(ValueError, match='"warp" provides radius and radius_aggregate, not knn'):
        fullgraph.knn(cloud, cloud, 3, backend="warp")
    with pytest.raises(ValueError, match='"cuml" provides knn and knn_aggregate, not radius_aggregate'):
        fullgraph.radius_aggregate(cloud, cloud, cloud, 0.1, backend="cuml")
    with pytest.raises(ValueError, match='"warp" needs CUDA tensors, got tensors on cpu'):
        fullgraph.radius(cloud, cloud, 0.1, 4, backend="warp")


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_warp_needs_float32_points_in_3d():
    cloud = torch.rand(20, 2, device="cuda")
    if importlib.util.find_spec("warp") is None:
        with pytest.raises(ImportError, match=r"fullgraph\[warp\]"):
            fullgraph.radius(cloud, cloud, 0.1, 4, backend="warp")
        return
    with pytest.raises(ValueError, match="needs D = 3"):
        fullgraph.radius(cloud, cloud, 0.1, 4, backend="warp")
    cloud = torch.rand(20, 3, device="cuda", dtype=torch.float64)
    with pytest.raises(TypeError, match="computes in float32 .*, got torch.float64"):
        fullgraph.radius(cloud, cloud, 0.1, 4, backend="warp")


@needs_warp
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_warp_radius_matches_oracle(distribution, generator):
    cloud = _cloud(distribution, 900, generator)
    query, ref = cloud[:150], cloud[150:]
    r = 0.3 if distribution != "grid" else 0.75
    dists, idx, counts = fullgraph.radius(query, ref, r, 6, backend="warp")
    d = oracle_distances(query, ref)
    expected_dists, expected_idx, expected_counts = oracle_nearest(d, 6, r)
    assert_neighbors(dists, idx, expected_dists, expected_idx, np.where(d <= r, d, np.inf), torch.float32)
    np.testing.assert_array_equal(counts.cpu().numpy(), expected_counts)


@needs_warp
def test_warp_keeps_the_nearest_and_breaks_ties_by_index():
    ref = torch.tensor([[0.9, 0, 0], [0.5, 0, 0], [0.1, 0, 0], [0.2, 0, 0], [0.1, 0, 0]], device="cuda")
    dists, idx, counts = fullgraph.radius(torch.tensor([[0.05, 0, 0]], device="cuda"), ref, 1.0, 2, backend="warp")
    assert idx.tolist() == [[2, 4]] and counts.tolist() == [5]
    dists, idx, counts = fullgraph.radius(torch.zeros(1, 3, device="cuda"), ref, 0.0, 2, backend="warp")
    assert idx.tolist() == [[-1, -1]] and counts.tolist() == [0]


@needs_warp
def test_warp_batched_ragged_and_non_finite(generator):
    query = _cloud("clustered", 2 * 60, generator).reshape(2, 60, 3)
    ref = _cloud("clustered", 2 * 200, generator).reshape(2, 200, 3)
    ref[0, 5] = float("nan")
    query[1, 3] = float("inf")
    query_lengths = torch.tensor([60, 41], device="cuda")
    ref_lengths = torch.tensor([150, 200], device="cuda")
    dists, idx, counts = fullgraph.radius(query, ref, 0.5, 8, query_lengths=query_lengths, ref_lengths=ref_lengths,
                                          backend="warp")
    want = fullgraph.radius(query, ref, 0.5, 8, query_lengths=query_lengths, ref_lengths=ref_lengths, backend="torch")
    assert torch.equal(idx, want[1]) and torch.equal(counts, want[2])
    torch.testing.assert_close(dists, want[0])
    features = torch.randn(2, 200, 4, device="cuda", generator=None)
    out = fullgraph.radius_aggregate(query, ref, features, 0.5, query_lengths=query_lengths, ref_lengths=ref_lengths,
                                     backend="warp")
    want = fullgraph.radius_aggregate(query, ref, features, 0.5, query_lengths=query_lengths,
                                      ref_lengths=ref_lengths, backend="torch")
    torch.testing.assert_close(out, want, **tolerance(torch.float32))


@needs_warp
@pytest.mark.parametrize("distribution", ["uniform", "duplicates", "far"])
def test_warp_aggregate_and_gradients_match_the_reference(distribution, generator):
    cloud = _cloud(distribution, 500, generator)
    features = torch.randn(400, 6, device="cuda")
    inputs = [cloud[:100].clone(), cloud[100:].clone(), features]
    d = oracle_distances(inputs[0], inputs[1])
    results = {}
    for backend in ("warp", "torch"):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fullgraph.radius_aggregate(*leaves, 0.35, sigma=0.2, backend=backend)
        (out * torch.linspace(-1, 1, 6, device="cuda")).sum().backward()
        results[backend] = [out.detach()] + [t.grad for t in leaves]
    np.testing.assert_allclose(results["warp"][0].cpu().double().numpy(),
                               oracle_aggregate(d, features, d <= 0.35, 0.2), rtol=1e-4, atol=1e-4)
    for got, want in zip(results["warp"], results["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@needs_warp
def test_warp_compiles_in_one_graph(generator):
    from torch._dynamo.testing import CompileCounter

    features = torch.randn(300, 5, device="cuda")

    def step(query, ref, feats):
        return fullgraph.radius_aggregate(query, ref, feats, 0.3, backend="warp").square().sum()

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for rows in (40, 70, 90):
        query, ref = _cloud("uniform", rows, generator), _cloud("uniform", 300, generator)
        torch.testing.assert_close(compiled(query, ref, features), step(query, ref, features))
    assert counter.frame_count == 1


@needs_warp
def test_warp_refuses_cuda_graphs_instead_of_replaying_wrong_results(generator):
    """Under torch.compile(mode="reduce-overhead"), cycling through three cloud sizes, the
    Warp backend's graphs replayed wrong results on the H100 (cause not yet found): it is
    declared not capturable, so a capture now says so instead."""
    from fullgraph.graphs import GraphCaptureError

    def step(query, ref, feats):
        dists, idx, counts = fullgraph.radius(query, ref, 0.25, 8, backend="warp")
        out = fullgraph.radius_aggregate(query, ref, feats, 0.25, backend="warp")
        return out.sum(-1) + dists.masked_fill(idx < 0, 0).sum(-1) + counts

    query, ref = _cloud("uniform", 200, generator), _cloud("normal", 900, generator)
    feats = torch.randn(900, 4, device="cuda")
    with pytest.raises(GraphCaptureError, match='backend="warp" runs radius'):
        fullgraph.graphs.graphed(step)(query, ref, feats)
    assert torch.isfinite(torch.randn(3, device="cuda")).all()
    compiled = torch.compile(step, fullgraph=True)  # without CUDA graphs: one graph, eager launches
    torch.testing.assert_close(compiled(query, ref, feats), step(query, ref, feats))


@needs_cuml
@pytest.mark.parametrize("distribution", ["uniform", "duplicates", "grid", "far"])
def test_cuml_knn_matches_oracle(distribution, generator):
    cloud = _cloud(distribution, 600, generator)
    query, ref = cloud[:100], cloud[100:]
    dists, idx = fullgraph.knn(query, ref, 9, backend="cuml")
    d = oracle_distances(query, ref)
    expected_dists, expected_idx, _ = oracle_nearest(d, 9)
    assert_neighbors(dists, idx, expected_dists, expected_idx, d, torch.float32)
    features = torch.randn(500, 4, device="cuda")
    out = fullgraph.knn_aggregate(query, ref, features, 9, backend="cuml")
    torch.testing.assert_close(out, fullgraph.knn_aggregate(query, ref, features, 9, backend="torch"),
                               **tolerance(torch.float32))

