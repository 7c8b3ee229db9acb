"""knn_aggregate and radius_aggregate: oracle agreement, gradients, edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fullgraph
from conftest import (
    DEVICES, backend_cases, backends_for, oracle_aggregate, oracle_distances, oracle_nearest, points,
    skip_interpreted_extras, tolerance,
)



def _knn_mask(d: np.ndarray, k: int) -> np.ndarray:
    _, idx, _ = oracle_nearest(d, k)
    mask = np.zeros_like(d, dtype=bool)
    for row, chosen in enumerate(idx):
        mask[row, chosen[chosen >= 0]] = True
    return mask


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("distribution", ["uniform", "normal", "clustered", "far", "planar"])
@pytest.mark.parametrize("dim", [1, 3, 8])
@pytest.mark.interpreted(keep=2)
def test_aggregates_match_oracle(backend, device, distribution, dim, generator):
    skip_interpreted_extras(backend, device, distribution, dim)
    cloud = points(distribution, 250, dim, generator).float().to(device)
    query, ref = cloud[:50], cloud[50:]
    features = torch.randn(200, 5, generator=generator).to(device)
    d = oracle_distances(query, ref)
    out = fullgraph.knn_aggregate(query, ref, features, 7, sigma=0.1, backend=backend)
    np.testing.assert_allclose(out.cpu().double().numpy(), oracle_aggregate(d, features, _knn_mask(d, 7), 0.1),
                               **tolerance(torch.float32))
    r = {1: 0.05, 3: 0.4, 8: 1.5}[dim]
    out = fullgraph.radius_aggregate(query, ref, features, r, sigma=0.1, backend=backend)
    expected = oracle_aggregate(d, features, d <= r, 0.1)
    np.testing.assert_allclose(out.cpu().double().numpy(), expected, **tolerance(torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_aggregate_dtypes(device, dtype, generator):
    cloud = points("uniform", 160, 3, generator).to(dtype)
    query, ref = cloud[:40].to(device), cloud[40:].to(device)
    features = torch.randn(120, 4, generator=generator).to(dtype).to(device)
    d = oracle_distances(query, ref)
    for backend in backends_for(device, dtype):
        out = fullgraph.knn_aggregate(query, ref, features, 5, sigma=0.5, backend=backend)
        assert out.dtype == dtype
        np.testing.assert_allclose(out.cpu().double().numpy(),
                                   oracle_aggregate(d, features, _knn_mask(d, 5), 0.5), **tolerance(dtype))
        out = fullgraph.radius_aggregate(query, ref, features, 0.3, sigma=0.5, backend=backend)
        np.testing.assert_allclose(out.cpu().double().numpy(),
                                   oracle_aggregate(d, features, d <= 0.3, 0.5), **tolerance(dtype))


@pytest.mark.parametrize("backend, device", backend_cases())
def test_aggregate_is_stable_for_tiny_sigma_and_far_points(backend, device, generator):
    query = points("uniform", 20, 3, generator).float().to(device) + 100
    ref = torch.cat([query + 0.01 * torch.randn(20, 3, generator=generator).float().to(device), query + 0.5])
    features = torch.randn(40, 3, generator=generator).to(device)
    for out in (fullgraph.radius_aggregate(query, ref, features, 1.0, sigma=1e-4, backend=backend),
                fullgraph.knn_aggregate(query, ref, features, 4, sigma=1e-4, backend=backend)):
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, features[:20], rtol=1e-4, atol=1e-4)  # the nearest dominates


@pytest.mark.parametrize("backend, device", backend_cases())
def test_no_neighbours_give_zero(backend, device):
    query = torch.tensor([[10.0, 10.0], [0.0, 0.1]], device=device)
    ref = torch.tensor([[0.0, 0.0], [0.0, 0.2]], device=device)
    features = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device)
    out = fullgraph.radius_aggregate(query, ref, features, 0.5, backend=backend)
    assert out[0].tolist() == [0.0, 0.0]
    torch.testing.assert_close(out[1].cpu(), torch.tensor([2.0, 3.0]))  # equidistant: the mean
    empty = torch.empty(0, 2, device=device)
    out = fullgraph.knn_aggregate(query, empty, empty, 3, backend=backend)
    assert out.shape == (2, 2) and (out == 0).all()


@pytest.mark.parametrize("backend, device", backend_cases())
def test_batched_ragged_aggregates(backend, device, generator):
    query = torch.stack([points("uniform", 15, 3, generator) for _ in range(2)]).float().to(device)
    ref = torch.stack([points("uniform", 40, 3, generator) for _ in range(2)]).float().to(device)
    features = torch.randn(2, 40, 6, generator=generator).to(device)
    query_lengths, ref_lengths = torch.tensor([15, 7], device=device), torch.tensor([12, 40], device=device)
    knn_out = fullgraph.knn_aggregate(query, ref, features, 3, query_lengths=query_lengths,
                                      ref_lengths=ref_lengths, backend=backend)
    radius_out = fullgraph.radius_aggregate(query, ref, features, 0.5, query_lengths=query_lengths,
                                            ref_lengths=ref_lengths, backend=backend)
    for b in range(2):
        d = oracle_distances(query[b], ref[b], int(query_lengths[b]), int(ref_lengths[b]))
        np.testing.assert_allclose(knn_out[b].cpu().double().numpy(),
                                   oracle_aggregate(d, features[b], _knn_mask(d, 3), 0.1), **tolerance(torch.float32))
        np.testing.assert_allclose(radius_out[b].cpu().double().numpy(),
                                   oracle_aggregate(d, features[b], d <= 0.5, 0.1), **tolerance(torch.float32))
    assert (knn_out[1, 7:] == 0).all() and (radius_out[1, 7:] == 0).all()


def _nondet_tol(device: str) -> float:
    """index_add on CUDA accumulates with atomics: float64 sums may differ in the last bits."""
    return 1e-12 if device == "cuda" else 0.0


@pytest.mark.parametrize("backend, device", backend_cases(float64=True))
def test_gradcheck_aggregates(backend, device, generator):
    query = points("uniform", 10, 3, generator).to(device).requires_grad_()
    ref = points("uniform", 25, 3, generator).to(device).requires_grad_()
    features = torch.randn(25, 2, generator=generator, dtype=torch.float64).to(device).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 4, sigma=0.2, backend=backend), (query, ref, features),
        nondet_tol=_nondet_tol(device))
    assert torch.autograd.gradcheck(
        lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.45, sigma=0.2, backend=backend),
        (query, ref, features), nondet_tol=_nondet_tol(device))


@pytest.mark.parametrize("backend, device", backend_cases(float64=True))
def test_gradcheck_batched_ragged(backend, device, generator):
    query = torch.stack([points("uniform", 6, 2, generator) for _ in range(2)]).to(device).requires_grad_()
    ref = torch.stack([points("uniform", 12, 2, generator) for _ in range(2)]).to(device).requires_grad_()
    features = torch.randn(2, 12, 3, generator=generator, dtype=torch.float64).to(device).requires_grad_()
    lengths = {"query_lengths": torch.tensor([6, 4], device=device),
               "ref_lengths": torch.tensor([9, 12], device=device)}
    assert torch.autograd.gradcheck(
        lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 3, sigma=0.3, backend=backend, **lengths),
        (query, ref, features), nondet_tol=_nondet_tol(device))
    assert torch.autograd.gradcheck(
        lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.5, sigma=0.3, backend=backend, **lengths),
        (query, ref, features), nondet_tol=_nondet_tol(device))


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("rows, columns", [(0, 5), (4, 0), (0, 0)])
def test_backward_through_empty_inputs(backend, device, rows, columns):
    query = torch.rand(rows, 3, device=device, requires_grad=True)
    ref = torch.rand(columns, 3, device=device, requires_grad=True)
    features = torch.rand(columns, 2, device=device, requires_grad=True)
    dists, _ = fullgraph.knn(query, ref, 2, backend=backend)
    total = (dists.masked_fill(torch.isinf(dists), 0).sum()
             + fullgraph.knn_aggregate(query, ref, features, 2, backend=backend).sum()
             + fullgraph.radius_aggregate(query, ref, features, 0.5, backend=backend).sum())
    total.backward()
    for t in (query, ref, features):
        assert t.grad is not None and t.grad.shape == t.shape and (t.grad == 0).all()


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] == "triton"])
def test_triton_gradients_match_the_reference(backend, device, generator):
    """The Triton kernels compute in float32: their gradients against float64 ones."""
    query = torch.stack([points("uniform", 30, 3, generator) for _ in range(2)]).to(device)
    ref = torch.stack([points("uniform", 70, 3, generator) for _ in range(2)]).to(device)
    features = torch.randn(2, 70, 5, generator=generator, dtype=torch.float64).to(device)
    lengths = {"query_lengths": torch.tensor([30, 21], device=device),
               "ref_lengths": torch.tensor([64, 70], device=device)}
    calls = {
        "knn": lambda q, r, f, be: fullgraph.knn(q, r, 5, backend=be, **lengths)[0].masked_fill(
            torch.arange(30, device=device)[None, :, None] >= lengths["query_lengths"][:, None, None], 0),
        "knn_aggregate": lambda q, r, f, be: fullgraph.knn_aggregate(q, r, f, 5, sigma=0.2, backend=be, **lengths),
        "radius_aggregate": lambda q, r, f, be: fullgraph.radius_aggregate(q, r, f, 0.4, sigma=0.2, backend=be,
                                                                           **lengths),
    }
    for name, call in calls.items():
        inputs64 = [t.clone().requires_grad_() for t in (query, ref, features)]
        inputs32 = [t.float().requires_grad_() for t in (query, ref, features)]
        want = call(*inputs64, "torch")
        got = call(*inputs32, backend)
        grad = torch.randn_like(want)
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4, msg=name)
        expected = torch.autograd.grad(want, inputs64, grad, allow_unused=True)
        actual = torch.autograd.grad(got, inputs32, grad.float(), allow_unused=True)
        for e, a in zip(expected, actual):
            if e is not None:
                torch.testing.assert_close(a.double(), e, rtol=1e-3, atol=1e-3, msg=name)


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] == "triton"])
@pytest.mark.parametrize("distribution", ["uniform", "clustered"])
@pytest.mark.slow
@pytest.mark.interpreted(keep=1)
def test_triton_radius_tiles_crossing_rows_of_cells_match_the_reference(backend, device, distribution, generator):
    """Radius walks take tiles of consecutive sorted positions across the ranges of a box's
    rows of cells (what lies between two ranges is outside the box): a cloud of many cells
    with ~30 references within the radius, values and all three gradients against float64."""
    cloud = points(distribution, 1_400, 3, generator)
    queries = 200 if device == "cuda" else 40  # interpreted Triton on a CPU: a query costs ~0.4 s
    query, ref = cloud[:queries].to(device), cloud[200:].to(device)
    features = torch.randn(1_200, 6, generator=generator, dtype=torch.float64).to(device)
    radius = (3 * 30 / (4 * math.pi * 1_200)) ** (1 / 3)
    inputs64 = [t.clone().requires_grad_() for t in (query, ref, features)]
    inputs32 = [t.float().requires_grad_() for t in (query, ref, features)]
    want = fullgraph.radius_aggregate(*inputs64, radius, sigma=0.05, backend="torch")
    got = fullgraph.radius_aggregate(*inputs32, radius, sigma=0.05, backend=backend)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    grad = torch.randn(want.shape, generator=generator, dtype=torch.float64).to(device)
    for e, a in zip(torch.autograd.grad(want, inputs64, grad), torch.autograd.grad(got, inputs32, grad.float())):
        torch.testing.assert_close(a.double(), e, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("wanted", ["features", "features and query", "features and ref"])
def test_points_as_data_get_no_gradient_and_the_rest_is_unchanged(backend, device, wanted, generator):
    """Coordinates that do not require grad (data, as in the projectors) skip their
    gradient kernels; the gradients that are wanted equal those of the full backward."""
    query = points("normal", 40, 3, generator).float().to(device)
    ref = points("normal", 90, 3, generator).float().to(device)
    features = torch.randn(90, 4, generator=generator).to(device)
    for call in (lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 6, sigma=0.3, backend=backend),
                 lambda q, r, f: fullgraph.radius_aggregate(q, r, f, 0.8, sigma=0.3, backend=backend)):
        full = [t.clone().requires_grad_() for t in (query, ref, features)]
        out = call(*full)
        grad = torch.randn(out.shape, generator=generator).to(device)
        want = torch.autograd.grad(out, full, grad)
        partial = [t.clone().requires_grad_(name in wanted) for t, name in zip((query, ref, features),
                                                                                ("query", "ref", "features"))]
        out = call(*partial)
        got = torch.autograd.grad(out, [t for t in partial if t.requires_grad], grad)
        for g, w in zip(got, [w for w, t in zip(want, partial) if t.requires_grad]):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend, device", backend_cases())
def test_knn_backward_without_distance_gradients(backend, device, generator):
    """The op's dists_grad=False (points as data): grad_dists zeros, grad_features the same
    (bits, where the backend is deterministic: torch's index_add on CUDA is not)."""
    query = points("normal", 40, 3, generator).float().to(device)[None]
    ref = points("clustered", 90, 3, generator).float().to(device)[None]
    features = torch.randn(1, 90, 4, generator=generator).to(device)
    ops = torch.ops.fullgraph
    out, dists, idx = ops.knn_aggregate(query, ref, features, 6, 0.3, None, None, backend)
    grad = torch.randn(out.shape, generator=generator).to(device)
    full = ops.knn_aggregate_backward(grad, features, out, dists, idx, 0.3, backend)
    spared = ops.knn_aggregate_backward(grad, features, out, dists, idx, 0.3, backend, None, False)
    assert full[0].abs().sum() > 0 and torch.equal(spared[0], torch.zeros_like(full[0]))
    if backend == "torch" and device == "cuda":
        torch.testing.assert_close(spared[1], full[1], rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(spared[1], full[1])


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] == "triton"])
def test_triton_forward_stats_and_grid_spare_the_backward_a_pass(backend, device, generator):
    """The forward's per-query stats (least distance within the radius, weight sum) are what
    they say, and the backward given them and the forward's grid equals the one that
    recomputes both, bit for bit."""
    query = torch.stack([points("normal", 40, 3, generator) for _ in range(2)]).float().to(device) * 3
    ref = torch.stack([points("clustered", 90, 3, generator) for _ in range(2)]).float().to(device) * 3
    features = torch.randn(2, 90, 4, generator=generator).to(device)
    lengths = torch.tensor([40, 17], device=device), torch.tensor([90, 60], device=device)
    ops = torch.ops.fullgraph
    out, stats, grid = ops.radius_aggregate(query, ref, features, 1.5, 0.3, *lengths, backend)
    assert grid.dtype == torch.int32 and grid.numel() > 0
    d = torch.cdist(query.double(), ref.double())
    valid = (torch.arange(40, device=device)[None, :, None] < lengths[0][:, None, None]) & (
        torch.arange(90, device=device)[None, None, :] < lengths[1][:, None, None])
    inside = valid & (d <= 1.5)
    least = torch.where(inside, d, torch.inf).amin(-1)
    total = torch.where(inside, torch.exp((least[..., None] - d) / 0.3), 0.0).sum(-1)
    torch.testing.assert_close(stats[..., 0].double(), least, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats[..., 1].double(), total, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=generator).to(device)
    recomputed = ops.radius_aggregate_backward(grad, query, ref, features, out, 1.5, 0.3, *lengths, backend)
    for saved in ((stats, None), (None, grid), (stats, grid)):
        given = ops.radius_aggregate_backward(grad, query, ref, features, out, 1.5, 0.3, *lengths, backend, None,
                                              None, True, True, *saved)
        for a, b in zip(given, recomputed):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"grid: expected the forward's int32 \[\d+\]"):
        ops.radius_aggregate_backward(grad, query, ref, features, out, 1.5, 0.3, *lengths, backend, None, None, True,
                                      True, stats, grid[1:])


@pytest.mark.parametrize("backend, device", [c for c in backend_cases() if c.values[0] in ("triton", "cpu")])
def test_radius_aggregate_grid_output_has_the_compiled_size(backend, device, generator):
    """The grid output's length, worked out from the shapes when compiled (dynamic sizes),
    is the length the backend returns: a record for "triton", empty for a backend keeping none."""
    def grid_of(query, ref, features):
        return torch.ops.fullgraph.radius_aggregate(query, ref, features, 0.4, 0.2, None, None, backend)[2]

    compiled = torch.compile(grid_of, fullgraph=True, dynamic=True)
    for rows, columns in ((30, 50), (17, 201)):
        query = torch.rand(2, rows, 3, generator=generator).to(device)
        ref = torch.rand(2, columns, 3, generator=generator).to(device)
        features = torch.randn(2, columns, 5, generator=generator).to(device)
        eager = grid_of(query, ref, features)
        assert (eager.numel() > 0) == (backend == "triton")
        assert torch.equal(compiled(query, ref, features), eager)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_radius_aggregate_of_small_items_over_blocks_equals_the_pairs(monkeypatch, dtype):
    """The "cpu" backend sums small items' pairs over whole blocks in C++
    (``select.weighted_sums`` and its backward): values and all three gradients as the
    pairs' path, with ragged lengths, a query without neighbours, non-finite points and NaN
    features on references outside every radius (never read)."""
    from fullgraph.ops.neighbors.cpu import backend as cpu, native as select

    if not select.available():
        pytest.skip("the C++ extension did not build here")
    generator = torch.Generator().manual_seed(7)
    query = torch.rand(3, 30, 3, generator=generator, dtype=dtype)
    ref = torch.rand(3, 40, 3, generator=generator, dtype=dtype)
    features = torch.randn(3, 40, 5, generator=generator, dtype=dtype)
    ref[0, 3], query[1, 4, 0], query[2, 5] = math.nan, math.inf, 50.0  # query 5 of item 2: no neighbour
    ref[2, 39], features[2, 39] = 100.0, math.nan  # far from everything: its NaN features never count
    lengths = {"query_lengths": torch.tensor([30, 20, 30]), "ref_lengths": torch.tensor([40, 33, 40])}

    def run():
        leaves = [t.clone().requires_grad_() for t in (query, ref, features)]
        out = fullgraph.radius_aggregate(*leaves, 0.3, sigma=0.1, backend="cpu", **lengths)
        (out * torch.linspace(-1, 1, out.numel(), dtype=dtype).reshape(out.shape)).sum().backward()
        return [out.detach()] + [leaf.grad for leaf in leaves]

    blocks = run()
    monkeypatch.setattr(cpu, "DENSE_AGGREGATE_MAX_PAIRS", 0)  # every item by its pairs
    by_pairs = run()
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-12, "atol": 1e-13}
    for got, want in zip(blocks, by_pairs):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, **tolerance)
    assert bool((blocks[0][2, 5] == 0).all()) and bool((blocks[0][1, 20:] == 0).all())


def test_the_weighted_sums_ops_check_their_contract():
    from fullgraph.ops.neighbors.cpu import native as select

    if not select.available():
        pytest.skip("the C++ extension did not build here")
    d, ok, features = torch.rand(2, 3, 4), torch.ones(2, 3, 4, dtype=torch.bool), torch.rand(2, 4, 5)
    with pytest.raises(ValueError, match=r"ok: expected bool \[2, 3, 4\]"):
        select.weighted_sums(d, ok.float(), features, 0.1)
    with pytest.raises(ValueError, match=r"features: expected \[2, 4, C\]"):
        select.weighted_sums(d, ok, features[:, :3], 0.1)
    out = select.weighted_sums(d, ok, features, 0.1)
    with pytest.raises(ValueError, match=r"query, ref: expected \[2, 3, D\], \[2, 4, D\]"):
        select.weighted_sums_backward(d, ok, features, torch.rand(2, 3, 3), torch.rand(2, 4, 2), out, out, 0.1)
    with pytest.raises(ValueError, match=r"grad_out: expected \[2, 3, 5\]"):
        select.weighted_sums_backward(d, ok, features, torch.rand(2, 3, 3), torch.rand(2, 4, 3), out[:, :2], out, 0.1)
