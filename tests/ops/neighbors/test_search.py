"""knn and radius: every backend against the float64 brute-force oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fullgraph
from conftest import (
    DEVICES, DISTRIBUTIONS, assert_neighbors, backend_cases, backends_for, oracle_distances, oracle_nearest, points,
    skip_interpreted_extras,
)



def _cloud(distribution, count, dim, generator, dtype, device):
    return points(distribution, count, dim, generator).to(dtype).to(device)


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("dim", [1, 2, 3, 8])
@pytest.mark.interpreted(keep=2)
def test_knn_matches_oracle(backend, device, distribution, dim, generator):
    skip_interpreted_extras(backend, device, distribution, dim)
    cloud = _cloud(distribution, 264, dim, generator, torch.float32, device)
    query, ref = cloud[:61], cloud[61:]
    dists, idx = fullgraph.knn(query, ref, 9, backend=backend)
    d = oracle_distances(query, ref)
    expected_dists, expected_idx, _ = oracle_nearest(d, 9)
    assert dists.dtype == torch.float32 and idx.dtype == torch.int64
    assert_neighbors(dists, idx, expected_dists, expected_idx, d, torch.float32)


@pytest.mark.parametrize("k, radius", [(7, None), (16, None), (16, 0.3)])
def test_the_sorting_merge_of_search_tiles_matches_the_oracle(k, radius, generator, monkeypatch):
    """Tiles merged into the lists by sorting (from 3 wanted candidates: the default on GPUs;
    Triton's interpreter takes the per-candidate merge unless told), with exact ties: a
    cloud on a lattice of spacing 0.25."""
    from conftest import HAVE_TRITON

    from fullgraph.ops.neighbors.triton import backend as triton_grid

    if not HAVE_TRITON:
        pytest.skip("needs Triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(triton_grid, "INTERPRETER_SORT_FROM", triton_grid.SEARCH_SORT_FROM)
    ref = (torch.rand(120, 3, generator=generator) * 4).round() / 4
    query = torch.rand(8, 3, generator=generator)
    d = oracle_distances(query, ref)
    if radius is None:
        dists, idx = fullgraph.knn(query.to(device), ref.to(device), k, backend="triton")
        expected_dists, expected_idx, _ = oracle_nearest(d, k)
    else:
        dists, idx, counts = fullgraph.radius(query.to(device), ref.to(device), radius, k, backend="triton")
        expected_dists, expected_idx, expected_counts = oracle_nearest(d, k, radius)
        assert counts.cpu().tolist() == list(expected_counts)
    assert_neighbors(dists.cpu(), idx.cpu(), expected_dists, expected_idx, d, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_knn_dtypes(device, dtype, generator):
    query = _cloud("normal", 40, 3, generator, dtype, device)
    ref = _cloud("normal", 150, 3, generator, dtype, device)
    d = oracle_distances(query, ref)
    expected_dists, expected_idx, _ = oracle_nearest(d, 5)
    for backend in backends_for(device, dtype):
        dists, idx = fullgraph.knn(query, ref, 5, backend=backend)
        assert dists.dtype == dtype and dists.device.type == device
        assert_neighbors(dists, idx, expected_dists, expected_idx, d, dtype)


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("distribution", ["uniform", "duplicates", "grid", "clustered"])
@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.interpreted(keep=2)
def test_radius_matches_oracle(backend, device, distribution, dim, generator):
    skip_interpreted_extras(backend, device, distribution, dim)
    cloud = _cloud(distribution, 370, dim, generator, torch.float32, device)
    query, ref = cloud[:70], cloud[70:]
    r = 0.3 if distribution != "grid" else 0.75  # grid spacing 0.5: 0.75 is not a tie
    dists, idx, counts = fullgraph.radius(query, ref, r, 6, backend=backend)
    d = oracle_distances(query, ref)
    expected_dists, expected_idx, expected_counts = oracle_nearest(d, 6, r)
    assert_neighbors(dists, idx, expected_dists, expected_idx, np.where(d <= r, d, np.inf), torch.float32)
    np.testing.assert_array_equal(counts.cpu().numpy(), expected_counts)
    assert (counts > 6).any(), "the cap must be exercised"


@pytest.mark.parametrize("backend, device", backend_cases())
def test_radius_keeps_the_nearest_not_the_first(backend, device):
    ref = torch.tensor([[0.9], [0.5], [0.1], [0.2]], device=device)
    dists, idx, counts = fullgraph.radius(torch.zeros(1, 1, device=device) + 0.05, ref, 1.0, 2, backend=backend)
    assert idx.tolist() == [[2, 3]] and counts.tolist() == [4]


@pytest.mark.parametrize("backend, device", backend_cases())
def test_ties_go_to_smaller_index(backend, device):
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [1.0, 0.0], [2.0, 0.0]], device=device)
    origin = torch.zeros(1, 2, device=device)
    dists, idx = fullgraph.knn(origin, ref, 3, backend=backend)
    assert idx.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(dists.cpu(), torch.ones(1, 3))
    dists, idx, counts = fullgraph.radius(origin, ref, 1.0, 2, backend=backend)
    assert idx.tolist() == [[0, 1]] and counts.tolist() == [5]


@pytest.mark.parametrize("backend, device", backend_cases())
def test_lists_are_ordered_by_the_reported_distance_then_index(backend, device, generator):
    """Two squared distances one ulp apart can give one distance once square-rooted: a list is
    ordered by the distance it reports, ties to the smaller index (the Triton search ordered
    by the squared distance and listed 79864 before 66696 at equal distances on an H100).
    Lattice points scaled by 0.1 give many such near-ties."""
    if backend == "triton" and device == "cpu":
        pytest.skip("interpreted Triton takes 80 s on this case: it runs on the GPU")
    lattice = torch.randint(0, 10, (1500, 3), generator=generator).float() * 0.1
    query, ref = lattice[:300].to(device), lattice[300:].to(device)
    dists, idx = fullgraph.knn(query, ref, 16, backend=backend)
    d, i = dists.cpu(), idx.cpu()
    later, earlier = (d[:, 1:], i[:, 1:]), (d[:, :-1], i[:, :-1])
    ordered = (later[0] > earlier[0]) | ((later[0] == earlier[0]) & (later[1] > earlier[1]))
    assert bool(ordered.all()), f"{int((~ordered).sum())} pairs out of order"
    exact = (query.double().cpu()[:, None] - ref.double().cpu()[None]).norm(dim=-1)
    kth = exact.topk(16, largest=False).values[:, -1:]
    # Every listed reference is within float32 rounding of the true k nearest.
    assert bool((exact.gather(1, i) <= kth * (1 + 1e-6)).all())


@pytest.mark.parametrize("backend, device", backend_cases())
def test_tiny_and_empty(backend, device):
    one = torch.tensor([[0.5, 0.5]], device=device)
    empty = torch.empty(0, 2, device=device)
    dists, idx = fullgraph.knn(one, one + 1, 3, backend=backend)
    assert idx.tolist() == [[0, -1, -1]]
    assert dists[0, 0].item() == pytest.approx(math.sqrt(2)) and torch.isinf(dists[0, 1:]).all()
    dists, idx = fullgraph.knn(empty, one, 2, backend=backend)
    assert dists.shape == (0, 2) and idx.shape == (0, 2)
    dists, idx = fullgraph.knn(one, empty, 2, backend=backend)
    assert idx.tolist() == [[-1, -1]] and torch.isinf(dists).all()
    dists, idx, counts = fullgraph.radius(one, empty, 1.0, 2, backend=backend)
    assert idx.tolist() == [[-1, -1]] and counts.tolist() == [0]
    dists, idx, counts = fullgraph.radius(one, one, 0.0, 1, backend=backend)
    assert idx.tolist() == [[0]] and dists.tolist() == [[0.0]] and counts.tolist() == [1]


@pytest.mark.parametrize("backend, device", backend_cases())
def test_non_finite_points_are_isolated(backend, device, generator):
    query = points("normal", 30, 3, generator).float().to(device)
    ref = points("normal", 80, 3, generator).float().to(device)
    expected_dists, expected_idx = fullgraph.knn(query, ref, 4, backend=backend)
    query[3, 1] = math.nan
    query[7, 0] = math.inf
    ref_bad = ref.clone()
    ref_bad[5] = math.nan
    ref_bad[9, 2] = -math.inf
    dists, idx = fullgraph.knn(query, ref_bad, 4, backend=backend)
    assert (idx[[3, 7]] == -1).all() and torch.isinf(dists[[3, 7]]).all()
    assert not ((idx == 5) | (idx == 9)).any()
    d = oracle_distances(query, ref_bad)
    want_dists, want_idx, _ = oracle_nearest(d, 4)
    assert_neighbors(dists, idx, want_dists, want_idx, d, torch.float32)
    untouched = [i for i in range(30) if i not in (3, 7) and not set(expected_idx[i].tolist()) & {5, 9}]
    assert torch.equal(idx[untouched], expected_idx[untouched])


@pytest.mark.parametrize("backend, device", backend_cases())
def test_batched_and_ragged(backend, device, generator):
    query = torch.stack([points("normal", 25, 3, generator) for _ in range(3)]).float().to(device)
    ref = torch.stack([points("uniform", 60, 3, generator) for _ in range(3)]).float().to(device)
    query_lengths = torch.tensor([25, 10, 0], device=device)
    ref_lengths = torch.tensor([60, 3, 40], device=device)
    dists, idx = fullgraph.knn(query, ref, 5, query_lengths=query_lengths, ref_lengths=ref_lengths,
                               backend=backend)
    rdists, ridx, counts = fullgraph.radius(query, ref, 0.8, 4, query_lengths=query_lengths,
                                            ref_lengths=ref_lengths, backend=backend)
    assert dists.shape == (3, 25, 5) and counts.shape == (3, 25)
    for b in range(3):
        d = oracle_distances(query[b], ref[b], int(query_lengths[b]), int(ref_lengths[b]))
        want_dists, want_idx, _ = oracle_nearest(d, 5)
        assert_neighbors(dists[b], idx[b], want_dists, want_idx, d, torch.float32)
        want_dists, want_idx, want_counts = oracle_nearest(d, 4, 0.8)
        assert_neighbors(rdists[b], ridx[b], want_dists, want_idx, np.where(d <= 0.8, d, np.inf), torch.float32)
        np.testing.assert_array_equal(counts[b].cpu().numpy(), want_counts)
    assert (idx[1, :10, 3:] == -1).all() and (idx[1, 10:] == -1).all() and (idx[2] == -1).all()
    assert (idx < ref_lengths[:, None, None]).all()


@pytest.mark.parametrize("backend, device", backend_cases())
def test_non_contiguous_inputs(backend, device, generator):
    base = points("normal", 200, 6, generator).float().to(device)
    query, ref = base[:40, ::2], base[40:, 1::2]
    assert not query.is_contiguous()
    dists, idx = fullgraph.knn(query, ref, 3, backend=backend)
    want_dists, want_idx = fullgraph.knn(query.contiguous(), ref.contiguous(), 3, backend=backend)
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)


def test_reference_never_builds_the_full_matrix(monkeypatch, generator):
    from fullgraph.ops.neighbors import pairs, reference

    monkeypatch.setattr(pairs, "BLOCK_BYTES", 200 * 1000 * 8 * 7)
    seen = []
    original = reference.pairwise_distances
    monkeypatch.setattr(reference, "pairwise_distances", lambda q, r, s: seen.append(q.shape[-2]) or original(q, r, s))
    query = points("normal", 2000, 3, generator).float()
    ref = points("normal", 1000, 3, generator).float()
    dists, idx = fullgraph.knn(query, ref, 4, backend="torch")
    assert max(seen) < 2000 and sum(seen) == 2000
    cpu_dists, cpu_idx = fullgraph.knn(query, ref, 4, backend="cpu")
    assert torch.equal(idx, cpu_idx)


@pytest.mark.parametrize("backend, device", backend_cases())
def test_gradient_at_coincident_points_is_zero(backend, device):
    query = torch.tensor([[0.0, 0.0], [1.0, 1.0]], device=device, requires_grad=True)
    ref = torch.tensor([[0.0, 0.0], [1.0, 0.0]], device=device, requires_grad=True)
    dists, _ = fullgraph.knn(query, ref, 2, backend=backend)
    dists.sum().backward()
    assert torch.isfinite(query.grad).all() and torch.isfinite(ref.grad).all()
    assert query.grad[0, 0].item() == pytest.approx(-1.0)  # only the (1, 0) neighbour pulls


@pytest.mark.parametrize("backend, device", backend_cases(float64=True))
def test_gradcheck_distances(backend, device, generator):
    query = points("uniform", 12, 3, generator).to(device).requires_grad_()
    ref = points("uniform", 30, 3, generator).to(device).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, r: fullgraph.knn(q, r, 4, backend=backend)[0], (query, ref))

    def capped(q, r):
        dists, idx, _ = fullgraph.radius(q, r, 0.4, 3, backend=backend)
        assert (idx < 0).any() and (idx >= 0).any()
        return dists.masked_fill(idx < 0, 0)  # +inf padding has no finite difference

    assert torch.autograd.gradcheck(capped, (query, ref))


def test_auto_radius_on_cpu_searches_small_items_by_brute_force(monkeypatch):
    """Radius searches on CPUs: the CPU backend at every size, items of at most
    cpu.BRUTE_FORCE_MAX_PAIRS query-reference pairs by brute force (C++), the k-d tree
    beyond; the reference's lists either way."""
    from fullgraph.ops.neighbors.cpu import backend as cpu

    calls = []
    original = cpu.brute_force
    monkeypatch.setattr(cpu, "brute_force", lambda *a: calls.append(a[1].shape[1]) or original(*a))
    monkeypatch.setattr(cpu, "BRUTE_FORCE_MAX_PAIRS", 5 * 9)
    generator = torch.Generator().manual_seed(3)
    for columns in (9, 10):
        query, ref = torch.randn(5, 3, generator=generator), torch.randn(columns, 3, generator=generator)
        got = fullgraph.radius(query, ref, 1.0, 4)
        want = fullgraph.radius(query, ref, 1.0, 4, backend="torch")
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert calls == [9]


@pytest.mark.parametrize("dim", [1, 3, 4, 5, 16, 64, 300, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_brute_force_equals_the_reference_bit_for_bit(dim, dtype):
    """cpu.brute_force (every pair measured in C++) against reference.nearest: lists,
    distances and counts equal bit for bit on ragged batches with duplicates (ties to the
    smaller index), non-finite points, an item of huge coordinates (its scale), pairs exactly
    at the radius, k beyond the cloud, and kNN (no radius)."""
    from fullgraph.ops.neighbors import reference
    from fullgraph.ops.neighbors.cpu import backend as cpu, native as select

    if not select.available():
        pytest.skip("the C++ extension did not build here")
    generator = torch.Generator().manual_seed(dim)
    query = torch.randint(0, 4, (3, 40, dim), generator=generator).to(dtype) / 4  # many equal distances
    ref = torch.randint(0, 4, (3, 50, dim), generator=generator).to(dtype) / 4
    ref[:, 10:15] = ref[:, :5]  # duplicates
    ref[0, 7, 0], query[0, 3, -1] = float("nan"), float("inf")
    query[2], ref[2] = query[2] * 1e30, ref[2] * 1e30  # scaled item
    query_lengths, ref_lengths = torch.tensor([40, 17, 0]), torch.tensor([50, 3, 50])
    for k, radius in ((4, 0.5), (8, 0.25 * dim**0.5), (60, math.inf), (6, math.inf)):
        got = cpu.brute_force(query, ref, k, radius, query_lengths, ref_lengths)
        want = reference.nearest(query, ref, k, radius, query_lengths, ref_lengths)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
        if math.isfinite(radius):
            assert torch.equal(got[2], want[2])
    # every point valid (items 1 and 2; item 0 has a NaN reference): kNN selects in place
    full_q, full_r = torch.tensor([40, 40, 40]), torch.tensor([50, 50, 50])
    for k in (4, 50):
        got = cpu.brute_force(query, ref, k, math.inf, full_q, full_r)
        want = reference.nearest(query, ref, k, math.inf, full_q, full_r)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])


def test_auto_picks_the_tree_on_cpu_beyond_small_items(monkeypatch):
    """3-D points on CPUs: the k-d tree for items of more query-reference pairs than
    dense.CPU_AUTO_MAX_PAIRS, the products for fewer."""
    from fullgraph.ops.neighbors.cpu import backend as cpu
    from fullgraph.ops.neighbors.dense import backend as dense

    calls = []
    kernels = cpu.BACKEND.implementation
    original = kernels.nearest
    monkeypatch.setattr(kernels, "nearest", lambda *a: calls.append(a[1].shape[1]) or original(*a))
    monkeypatch.setattr(dense, "CPU_AUTO_MAX_PAIRS", 5 * 9)
    monkeypatch.setattr(dense, "CPU_BRUTE_FORCE", {1: ()})
    monkeypatch.setattr(cpu, "BRUTE_FORCE_MAX_PAIRS", 5 * 9)
    monkeypatch.setattr(cpu, "TINY_MAX_WORK", 0)
    fullgraph.knn(torch.randn(5, 3), torch.randn(9, 3), 2)
    fullgraph.knn(torch.randn(5, 3), torch.randn(10, 3), 2)
    assert calls == [10]


def test_large_knn_is_fast_and_lean():
    """The issue's acceptance size: 30k x 300k, k=8, on the 2-core machine."""
    import resource
    import time

    generator = torch.Generator().manual_seed(7)
    query = torch.rand(30_000, 3, generator=generator)
    ref = torch.rand(300_000, 3, generator=generator)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    dists, idx = fullgraph.knn(query, ref, 8)
    elapsed = time.perf_counter() - start
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert elapsed < 20 and grown_kib < 2 * 2**20
    sample = torch.arange(0, 30_000, 997)
    d = oracle_distances(query[sample], ref)
    want_dists, want_idx, _ = oracle_nearest(d, 8)
    assert_neighbors(dists[sample], idx[sample], want_dists, want_idx, d, torch.float32)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_the_cpu_trees_equal_the_reference(monkeypatch, distribution, generator):
    """The CPU backend's k-d trees (forced: small items otherwise take its brute force) give
    the reference's lists, counts and aggregations on every distribution, ragged."""
    from fullgraph.ops.neighbors.cpu import backend as cpu

    monkeypatch.setattr(cpu, "BRUTE_FORCE_MAX_PAIRS", 0)
    monkeypatch.setattr(cpu, "PAIRS_BRUTE_FORCE_MAX_PAIRS", 0)
    query = torch.stack([points(distribution, 60, 3, generator) for _ in range(2)]).float()
    ref = torch.stack([points(distribution, 80, 3, generator) for _ in range(2)]).float()
    features = torch.randn(2, 80, 4, generator=generator)
    lengths = dict(query_lengths=torch.tensor([60, 41]), ref_lengths=torch.tensor([80, 33]))
    radius = float(torch.cdist(query[0], ref[0]).median())
    for backend_results in (lambda b: fullgraph.knn(query, ref, 7, backend=b, **lengths),
                            lambda b: fullgraph.radius(query, ref, radius, 9, backend=b, **lengths),
                            lambda b: (fullgraph.radius_aggregate(query, ref, features, radius, sigma=0.5, backend=b,
                                                                  **lengths),)):
        got, want = backend_results("cpu"), backend_results("torch")
        for a, b in zip(got, want):
            close = torch.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True)
            assert torch.equal(a, b) if a.dtype == torch.int64 else close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(None, 10, 10, 64, 4), (4, 32, 32, 12, 4), (2, 7, 3, 5, 6), (None, 0, 5, 3, 2),
                                   (3, 6, 0, 2, 3), (None, 1, 1, 1, 1), (2, 8, 16, 256, 16), (2, 64, 300, 16, 4),
                                   (None, 256, 64, 16, 1)])
def test_tiny_cpu_calls_answer_as_the_reference(shape, dtype, monkeypatch):
    """Small eager CPU calls that "auto" gives the brute force (at most cpu.TINY_MAX_WORK
    pair-coordinates, or items within its limits) go past the operator layers to its one C++
    call: the reference's lists bit for bit, with duplicates (ties to the smaller index), a
    non-finite point, k beyond N (padding), huge coordinates (the item's scale), empty clouds
    and unbatched inputs."""
    from fullgraph.ops.neighbors import registration
    from fullgraph.ops.neighbors.cpu import backend as cpu

    batch, rows, columns, dim, k = shape
    chosen = registration.BACKENDS.resolve("auto", "knn", torch.device("cpu"), dtype, dim, k, size=rows * columns)
    assert (batch or 1) * rows * columns * dim <= cpu.TINY_MAX_WORK or chosen.name == "cpu"
    taken = []
    original = cpu.tiny_lists  # (the brute force's one call, however it is reached)
    monkeypatch.setattr(cpu, "tiny_lists", lambda *a: taken.append(a[2]) or original(*a))
    generator = torch.Generator().manual_seed(rows * 31 + columns)
    lead = () if batch is None else (batch,)
    query = torch.randn(*lead, rows, dim, generator=generator, dtype=dtype)
    ref = torch.randn(*lead, columns, dim, generator=generator, dtype=dtype)
    if columns > 2:
        ref[..., 1, :] = ref[..., 0, :]  # a duplicate
        ref[..., 2, 0] = math.nan
    if rows > 1:
        query[..., -1, :] *= 1e30  # far beyond the scale's bounds
    got = fullgraph.knn(query, ref, k)
    want = fullgraph.knn(query, ref, k, backend="torch")
    assert taken == [k]
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 300, 16, 4), (1, 64, 256, 64, 8), (3, 40, 500, 40, 12)])
def test_small_half_precision_cpu_calls_answer_as_the_reference(shape, dtype, monkeypatch):
    """float16 / bfloat16 CPU calls beyond the tiny ones (the brute force of small items, the
    plain products path) measure in float32 as the reference does, in their one C++ call: the
    reference's lists bit for bit, duplicates, a non-finite point and k beyond a short item
    included."""
    from fullgraph.ops.neighbors.cpu import native

    if not native.available():
        pytest.skip("the C++ extension did not build here")
    calls = []
    for name in ("nearest_small", "nearest_small_unchecked", "plain_nearest"):
        original = getattr(native, name)
        monkeypatch.setattr(native, name, lambda *a, _f=original, **kw: calls.append(a[0].dtype) or _f(*a, **kw))
    batch, rows, columns, dim, k = shape
    generator = torch.Generator().manual_seed(rows + dim)
    query = torch.randn(batch, rows, dim, generator=generator).to(dtype)
    ref = torch.randn(batch, columns, dim, generator=generator).to(dtype)
    ref[:, 5] = ref[:, 4]  # a duplicate
    query[:, 2] = ref[:, 4]  # at distance 0 from both
    ref[0, 7, 1] = math.nan
    for got, want in ((fullgraph.knn(query, ref, k), fullgraph.knn(query, ref, k, backend="torch")),
                      (fullgraph.knn(query, ref[:, :k - 1], k), fullgraph.knn(query, ref[:, :k - 1], k, backend="torch"))):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    assert calls and set(calls) == {torch.float32}


def _graph_ops(fn, *args):
    """(result, the operators of the graphs torch.compile(fullgraph=True, dynamic=True) made of fn)."""
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(node.target).removesuffix(".default") for node in gm.graph.nodes
                   if node.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, dynamic=True, backend=backend)(*args), ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 9, 10, 16, 12), (2, 64, 300, 16, 4), (None, 30, 40, 8, 5), (4, 512, 512, 64, 256)])
def test_compiled_cpu_brute_force_calls_hold_its_operator(shape, dtype):
    """Compiled, a CPU call that "auto" answers by the brute force's one C++ call holds that
    operator in the graph instead of the public one (whose layers cost most of such a call):
    the reference's lists, with duplicates, a non-finite point, a far point and k beyond N."""
    from fullgraph.ops.neighbors import registration
    from fullgraph.ops.neighbors.cpu import native

    if not native.available():
        pytest.skip("the C++ extension did not build here")
    batch, rows, columns, dim, k = shape
    generator = torch.Generator().manual_seed(rows + columns)
    lead = () if batch is None else (batch,)
    query = torch.randn(*lead, rows, dim, generator=generator).to(dtype)
    ref = torch.randn(*lead, columns, dim, generator=generator).to(dtype)
    ref[..., 1, :] = ref[..., 0, :]  # a duplicate
    ref[..., 4, 3] = math.inf
    query[..., -1, :] *= 1e30
    assert registration.BACKENDS.resolve("auto", "knn", query.device, dtype, dim, k, size=rows * columns).name == "cpu"
    got, ops = _graph_ops(lambda q, r: fullgraph.knn(q, r, k), query, ref)
    assert "fullgraph_cpu.nearest_small" in ops and "fullgraph.knn" not in ops
    want = fullgraph.knn(query, ref, k, backend="torch")
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("plain", [True, False])
@pytest.mark.parametrize("shape", [(1, 50, 400, 200, 8, "small_nearest"), (2, 30, 40, 96, 3, "small_nearest"),
                                   (None, 64, 70, 128, 64, "nearest_small")])
def test_compiled_small_dense_calls_hold_their_one_cpp_call(shape, plain):
    """Compiled, a small CPU call that "auto" gives the products answers by their one C++ call
    in the graph (``dense.plain_in_one_call``), which measures every pair where the products'
    call refuses (a non-finite or a far point), lists of nearly every reference by the brute
    force's call: the reference's lists in every case."""
    from fullgraph.ops.neighbors.cpu import native

    if not native.available():
        pytest.skip("the C++ extension did not build here")
    batch, rows, columns, dim, k, call = shape
    generator = torch.Generator().manual_seed(rows + dim)
    lead = () if batch is None else (batch,)
    query = torch.randn(*lead, rows, dim, generator=generator)
    ref = torch.randn(*lead, columns, dim, generator=generator)
    ref[..., 1, :] = ref[..., 0, :]  # a duplicate
    if not plain:
        ref[..., 4, 3] = math.nan
        query[..., -1, :] *= 1e30
    got, ops = _graph_ops(lambda q, r: fullgraph.knn(q, r, k), query, ref)
    assert f"fullgraph_cpu.{call}" in ops and "fullgraph.knn" not in ops
    want = fullgraph.knn(query, ref, k, backend="torch")
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, r: fullgraph.knn(q, r, k), fullgraph=True, dynamic=True)
    for a, b in zip(compiled(query, ref), want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("plain", [True, False])
def test_small_eager_dense_calls_take_their_one_cpp_call(plain, monkeypatch):
    """Eagerly too, a small CPU call that "auto" gives the products goes straight to their one
    C++ call (``dense.plain_in_one_call``, past the operator's layers); bad arguments still get
    the usual errors, and the lists are the reference's."""
    from fullgraph.ops.neighbors.cpu import native
    from fullgraph.ops.neighbors.dense import backend as dense

    if not native.available():
        pytest.skip("the C++ extension did not build here")
    taken = []
    monkeypatch.setattr(dense, "plain_in_one_call", lambda *a, f=dense.plain_in_one_call: taken.append(1) or f(*a))
    generator = torch.Generator().manual_seed(3)
    query, ref = torch.randn(256, 48, generator=generator), torch.randn(64, 48, generator=generator)
    if not plain:
        ref[4, 3] = math.nan
        query[-1] *= 1e30
    got, want = fullgraph.knn(query, ref, 1), fullgraph.knn(query, ref, 1, backend="torch")
    assert taken == [1] and all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match="ref"):
        fullgraph.knn(query, ref[:, :47], 1)
    with pytest.raises(ValueError, match="k"):
        fullgraph.knn(query, ref, 0)


def test_constants_to_compile_carry_torchs_own_mark():
    """``api._constant_to_compile`` sets what torch.compiler.assume_constant_result sets."""
    from fullgraph.ops.neighbors import api

    marked, plain = api._constant_to_compile(lambda: 1), lambda: 1
    torch.compiler.assume_constant_result(plain)
    assert {n for n in vars(plain) if "dynamo" in n} == {n for n in vars(marked) if "dynamo" in n} != set()


def test_compiled_calls_beyond_the_brute_force_hold_the_public_operator():
    """Where "auto" takes another path (here the products of many pairs), with gradients,
    lengths or an explicit backend, and under torch.export, the graph holds the public
    operator; a compiled function called past the one-call sizes compiles again (guarded on
    them), right."""
    from fullgraph.ops.neighbors.cpu import native

    if not native.available():
        pytest.skip("the C++ extension did not build here")
    generator = torch.Generator().manual_seed(3)
    small = torch.randn(2, 9, 16, generator=generator), torch.randn(2, 10, 16, generator=generator)
    large = torch.randn(1, 1500, 200, generator=generator), torch.randn(1, 3000, 200, generator=generator)
    for fn, args in ((lambda q, r: fullgraph.knn(q, r, 3), large),
                     (lambda q, r: fullgraph.knn(q, r, 3, backend="cpu"), small),
                     (lambda q, r: fullgraph.knn(q, r, 3, ref_lengths=torch.tensor([10, 7])), small),
                     (lambda q, r: fullgraph.knn(q, r, 3), (small[0].clone().requires_grad_(), small[1]))):
        _, ops = _graph_ops(fn, *args)
        assert "fullgraph.knn" in ops and "fullgraph_cpu.nearest_small" not in ops

    class Search(torch.nn.Module):
        def forward(self, q, r):
            return fullgraph.knn(q, r, 3)

    exported = torch.export.export(Search(), small)
    assert any(node.target is torch.ops.fullgraph.knn.default for node in exported.graph.nodes)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, r: fullgraph.knn(q, r, 3), fullgraph=True, dynamic=True)
    for q, r in (small, large, small):
        for a, b in zip(compiled(q, r), fullgraph.knn(q, r, 3, backend="torch")):
            assert torch.equal(a, b)


def test_tiny_cpu_calls_keep_the_usual_path_where_it_must_run():
    """Gradients, an explicit backend, lengths and bad arguments take the usual path (its
    autograd, its choice and its errors)."""
    query = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 6, 3, dtype=torch.float64)
    dists, _ = fullgraph.knn(query, ref, 3)
    assert dists.requires_grad
    torch.autograd.gradcheck(lambda q: fullgraph.knn(q, ref, 3)[0], (query,))
    with pytest.raises(ValueError, match="k: expected"):
        fullgraph.knn(query.detach(), ref, 0)
    with pytest.raises(TypeError, match="k: expected"):
        fullgraph.knn(query.detach(), ref, True)
    with pytest.raises(ValueError, match="ref: expected D = 3"):
        fullgraph.knn(query.detach(), ref[..., :2], 3)
    with pytest.raises(ValueError, match="k: expected at most"):
        fullgraph.knn(query.detach(), ref, 2000)
    with pytest.raises(TypeError):
        fullgraph.knn(query.detach(), ref.float(), 3)


def test_auto_means_the_brute_force_for_tiny_cpu_work():
    """The tiny calls' path is the one "auto" resolves to for the same work."""
    from fullgraph.ops.neighbors import registration
    from fullgraph.ops.neighbors.cpu import backend as cpu
    from fullgraph.ops.neighbors.cpu import native

    if not native.available():
        pytest.skip("the CPU extension did not build")
    for rows, columns, dim in [(10, 10, 64), (1, 1, 2048), (32, 32, 64), (64, 64, 16)]:
        assert rows * columns * dim <= cpu.TINY_MAX_WORK
        chosen = registration.BACKENDS.resolve("auto", "knn", torch.device("cpu"), torch.float32, dim, 4,
                                               size=rows * columns)
        assert chosen.name == "cpu"

