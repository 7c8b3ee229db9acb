"""The "dense" backend (matrix products on BLAS, CPU): exactly the reference's lists in
feature space, on adversarial inputs where the product's cancellation error matters."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import fullgraph
from conftest import DEVICES, DISTRIBUTIONS, HAVE_TRITON, assert_neighbors, oracle_distances, oracle_nearest, points, tolerance
from fullgraph.ops.neighbors.dense import backend as dense


def _planned(monkeypatch, **decisions):
    """Every call's ``dense.Plan`` with ``decisions`` forced."""
    original = dense.plan
    monkeypatch.setattr(dense, "plan", lambda *args: dataclasses.replace(original(*args), **decisions))


@pytest.fixture(autouse=True)
def _tensor_cores_by_default(monkeypatch):
    """The tests here check the products' path on every size; the brute force only where
    ``path`` asks for it."""
    monkeypatch.setattr(dense, "SMALL_ITEM_MAX_PAIRS", 0)


@pytest.fixture(params=["blas", "tensor cores", "brute force"])
def path(request, monkeypatch):
    """Which formulation runs, and on which device: the products stored per block (BLAS, CPU),
    chunk minima on tensor cores, or every pair measured in one kernel (the GPU; without one,
    Triton's interpreter on CPU tensors). Returns the device."""
    if request.param == "blas":
        monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: False)
        return "cpu"
    if not HAVE_TRITON:
        pytest.skip("needs triton")
    interpreted_cases = ("test_gradients",)
    if request.param == "brute force" and not torch.cuda.is_available() and (
            request.node.originalname not in interpreted_cases):
        pytest.skip("interpreted Triton is slow here: the brute force runs in its own tests and the gradient "
                    "case; every case on the GPU")
    monkeypatch.setattr(dense, "SMALL_ITEM_MAX_PAIRS", 0 if request.param == "tensor cores" else 2**62)
    if request.param == "brute force":  # every D the kernel takes, not only where "auto" sends it
        from fullgraph.ops.neighbors.dense import kernels as triton_dense

        monkeypatch.setattr(dense, "SMALL_ITEM_MAX_DIM", triton_dense.every_pair.BRUTE_FORCE_MAX_DIM)
    if torch.cuda.is_available():
        return "cuda"
    monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: query.dtype != torch.float64)
    return "cpu"


def _clouds(distribution, dim, generator, rows=120, columns=700):
    return points(distribution, rows, dim, generator), points(distribution, columns, dim, generator)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dim", [4, 16, 64, 128, 300])
@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.interpreted(keep=3)
def test_matches_the_oracle(distribution, dim, device, path, generator):
    if device != path:
        pytest.skip("the path runs on the other device")
    interpreted = device == "cpu" and dense._on_tensor_cores(torch.empty(0))
    # Interpreted Triton (~20-40 s a case): D = 4 and 64 on the distributions that take the
    # kernels' other paths (ties, clusters, far points), and 300 on far points, cover the loop over D.
    covered = {4: ("uniform", "duplicates", "far"), 64: ("uniform", "clustered", "duplicates", "far"), 300: ("far",)}
    if interpreted and distribution not in covered.get(dim, ()):
        pytest.skip("interpreted Triton: this combination runs on the GPU")
    rows, columns = (60, 350) if interpreted else (120, 700)
    query, ref = (t.float().to(device) for t in _clouds(distribution, dim, generator, rows, columns))
    dists, idx = fullgraph.knn(query, ref, 9, backend="dense")
    d = oracle_distances(query, ref)
    want_dists, want_idx, _ = oracle_nearest(d, 9)
    assert_neighbors(dists, idx, want_dists, want_idx, d, torch.float32)
    # and exactly the reference's lists (same arithmetic, same tie-breaking)
    assert torch.equal(idx, fullgraph.knn(query, ref, 9, backend="torch")[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter: the lists' own test)")
@pytest.mark.parametrize("distribution", ["normal", "clustered", "duplicates"])
@pytest.mark.parametrize("k", [32, 50])
def test_long_lists_on_wide_clouds_match_the_reference(distribution, k, generator):
    """k = 28-59 keeps 64 chunks a query in one kernel up to 2^12 references: the lists on
    4,096 references, graphed and not, are the reference's, bit for bit."""
    query, ref = (t.float().cuda() for t in _clouds(distribution, 32, generator, rows=512, columns=4096))
    want_dists, want_idx = fullgraph.knn(query, ref, k, backend="torch")
    dists, idx = fullgraph.knn(query, ref, k, backend="dense")
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)
    dists, idx = fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, k, backend="dense"))(query, ref)
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter: the bound's own test)")
@pytest.mark.parametrize("second", ["tf32x3", "fp16x3"])
@pytest.mark.parametrize("distribution", ["normal", "clustered", "duplicates", "far"])
@pytest.mark.parametrize("dim", [256, 1024, 2048])
def test_wide_clouds_on_the_stored_minima_match_the_reference(distribution, dim, second, monkeypatch, generator):
    """Wide points on more references than the fused lists take (frames by Triton to D = 2048):
    float16 first products, the rows they leave unproven again in three TF32 products or in
    float16 halves and lows ("fp16x3", from HALF_SECOND_MIN_DIM): the reference's lists, bit for
    bit, graphed and not."""
    monkeypatch.setattr(dense, "HALF_SECOND_MIN_DIM", 256 if second == "fp16x3" else 2**31)
    query, ref = (t.float().cuda() for t in _clouds(distribution, dim, generator, rows=300, columns=20000))
    assert dense.plan(query[None], ref[None], 10).second == second
    want_dists, want_idx = fullgraph.knn(query, ref, 10, backend="torch")
    dists, idx = fullgraph.knn(query, ref, 10, backend="dense")
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)
    dists, idx = fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, 10, backend="dense"))(query, ref)
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)


@pytest.mark.parametrize("offset", [1e3, 1e5])
@pytest.mark.parametrize("precision", ["highest", "high"])  # "high": TF32 products on GPUs that have them
@pytest.mark.interpreted(keep=1)
def test_far_from_the_origin(offset, precision, path, generator):
    """|q|^2 dwarfs the differences: centring and the certificate keep the lists exact."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        query, ref = (t.float().to(path) + offset for t in _clouds("normal", 32, generator))
        assert torch.equal(fullgraph.knn(query, ref, 5, backend="dense")[1],
                           fullgraph.knn(query, ref, 5, backend="torch")[1])
    finally:
        torch.set_float32_matmul_precision(previous)


def test_ties_wider_than_the_slack_are_redone(monkeypatch, path, generator):
    """Many exact duplicates at the k-th place fail the certificate; those rows are redone: on
    tensor cores with more candidates a pass (up to every reference), on CPUs by the
    reference."""
    if dense.SMALL_ITEM_MAX_PAIRS:
        pytest.skip("the brute force measures every pair: nothing to redo")
    _planned(monkeypatch, redo="reference")
    query, ref = _tied(generator, path)
    redone, takes = [], []
    original, block = dense.reference.nearest, dense._block
    monkeypatch.setattr(dense.reference, "nearest", lambda q, *a: redone.append(q.shape[1]) or original(q, *a))
    monkeypatch.setattr(dense, "_block", lambda *a: takes.append(a[-2]) or block(*a))
    dists, idx = fullgraph.knn(query, ref, 6, backend="dense")
    if dense._on_tensor_cores(query):
        first = 6 + dense.CANDIDATE_SLACK
        assert not redone and first in takes and max(takes) > first
    else:
        assert sum(redone) > 0
    assert torch.equal(idx, fullgraph.knn(query, ref, 6, backend="torch")[1])


def _tied(generator, device="cpu", rows=40, columns=600, dim=8):
    """Queries near a pool of 5 points that the references duplicate: ties wider than the slack."""
    pool = points("normal", 5, dim, generator).float()
    ref = pool[torch.randint(0, 5, (columns,), generator=generator)]
    query = pool[torch.randint(0, 5, (rows,), generator=generator)] + 0.01
    return query.to(device), ref.to(device)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_the_triton_search_restricted_to_flagged_rows(generator):
    """What redoes failed rows on CUDA without a host read: the flagged rows equal a full search."""
    from fullgraph.ops.neighbors.triton import backend as triton_grid

    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, ref = (t.to(device) for t in _clouds("normal", 16, generator, rows=24, columns=90))
    query, ref = query[None].float().contiguous(), ref[None].float().contiguous()
    needed = torch.zeros(1, 24, dtype=torch.bool, device=device)
    needed[0, torch.tensor([0, 5, 6, 23])] = True
    full = triton_grid.nearest(query, ref, 7, math.inf, None, None)
    some = triton_grid.nearest(query, ref, 7, math.inf, None, None, needed=needed)
    assert torch.equal(some[1][needed], full[1][needed]) and torch.equal(some[0][needed], full[0][needed])


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_the_triton_search_on_a_one_cell_grid_from_the_frames(generator):
    """What the dense path hands the Triton search instead of building its grid (D > 3): the
    frames' scaled clouds, valid rows first, give the lists of a grid built from scratch, with
    ragged lengths, non-finite points and flagged rows."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.triton import backend as triton_grid, grid

    device = "cuda" if torch.cuda.is_available() else "cpu"
    query = torch.stack([points("normal", 30, 8, generator) for _ in range(2)]).float() * 1e15
    ref = torch.stack([points("normal", 90, 8, generator) for _ in range(2)]).float() * 1e15
    query[0, 4, 2], ref[1, 7, 0], ref[0, 11, 5] = math.nan, math.inf, math.nan
    query, ref = query.to(device), ref.to(device)
    query_lengths, ref_lengths = torch.tensor([30, 21], device=device), torch.tensor([90, 64], device=device)
    frames = dense.Frames(query, ref, query_lengths, ref_lengths, torch.float32)
    query_ok, ref_ok = frames.query_ok, frames.ref_ok
    assert torch.equal(query_ok, pairs.valid_points(query, query_lengths))
    assert frames.scale.min().item() > 1  # far out: the clouds are scaled
    built = grid.one_cell(frames.q, frames.r, query_ok, ref_ok, frames.scale)
    assert torch.equal(built[2].bucket_start.cpu(), torch.tensor([0, 89, 90, 90 + 63, 180], dtype=torch.int32))
    needed = query_ok.clone()
    needed[1, :5] = False
    full = triton_grid.nearest(query, ref, 7, math.inf, query_lengths, ref_lengths, needed=needed)
    some = triton_grid.nearest(query, ref, 7, math.inf, query_lengths, ref_lengths, needed=needed, built=built)
    assert torch.equal(some[1][needed], full[1][needed]) and torch.equal(some[0][needed], full[0][needed])


def _count_searched_rows(monkeypatch) -> list[int]:
    """The number of rows each call of the restricted Triton search or brute force is asked for."""
    searched = []
    search, brute_force = dense.triton_grid.nearest, dense.triton_dense.brute_force
    monkeypatch.setattr(dense.triton_grid, "nearest",
                        lambda *a, needed, **kw: searched.append(int(needed.sum())) or search(*a, needed=needed, **kw))

    def counted_brute_force(*args, needed=None, **kwargs):
        if needed is not None:
            searched.append(int(needed.sum()))
        return brute_force(*args, needed=needed, **kwargs)

    monkeypatch.setattr(dense.triton_dense, "brute_force", counted_brute_force)
    return searched


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("redo", ["brute force", "search"])
@pytest.mark.parametrize("k", [6, pytest.param(60, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="interpreted Triton: k = 6 covers the path"))])
@pytest.mark.interpreted(keep=1)
def test_the_capture_path_proves_rows_before_one_re_measure(monkeypatch, k, redo, generator):
    """Inside a capture (forced here; on a CPU through Triton's interpreter): rows proven from
    the measured members, the rest (ties wider than the slack, and normal queries beside
    them) taken from the brute force (small items) or the Triton search, one re-measure:
    the reference's lists."""
    monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: query.dtype != torch.float64)
    monkeypatch.setattr(dense, "_capturing", lambda query: True)
    if redo == "search":
        monkeypatch.setattr(dense, "BRUTE_FORCE_REDO_MAX_COLUMNS", 0)
    searched = _count_searched_rows(monkeypatch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, ref = _tied(generator, device)
    query = torch.cat([query, points("normal", 20, 8, generator).float().to(device) + 10])
    ref = torch.cat([ref, points("normal", 300, 8, generator).float().to(device) + 10])
    dists, idx = fullgraph.knn(query, ref, k, backend="dense")
    assert searched and 0 < searched[0] < query.shape[0]
    want_dists, want_idx = fullgraph.knn(query, ref, k, backend="torch")
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_failed_rows_redone_by_the_triton_search(monkeypatch, generator):
    """The redo of a capture (no host read; through Triton's interpreter on a CPU): ties found
    again."""
    _planned(monkeypatch, redo="search", capture=True)
    flagged = _count_searched_rows(monkeypatch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, ref = _tied(generator, device)
    dists, idx = fullgraph.knn(query, ref, 6, backend="dense")
    assert flagged and flagged[0] > 0
    want_dists, want_idx = fullgraph.knn(query, ref, 6, backend="torch")
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(dists, want_dists, **tolerance(torch.float32))


@pytest.mark.interpreted(keep=0)
def test_ragged_batches_non_finite_points_and_small_sets(path, generator):
    query = torch.stack([points("uniform", 30, 16, generator) for _ in range(3)]).float()
    ref = torch.stack([points("uniform", 50, 16, generator) for _ in range(3)]).float()
    query[0, 4, 2], ref[1, 7, 0] = math.nan, math.inf
    query, ref = query.to(path), ref.to(path)
    lengths = torch.tensor([30, 12, 0], device=path), torch.tensor([50, 3, 20], device=path)
    for k in (1, 5, 53, 60):  # 53: more than the cloud, on the GPU's short chunks
        got = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="dense")
        want = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert (got[1][0, 4] == -1).all() and (got[1][2] == -1).all()
    empty = fullgraph.knn(query[:, :0], ref, 3, backend="dense")
    assert empty[0].shape == (3, 0, 3)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.interpreted(keep=1)
def test_dtypes(dtype, path, generator):
    query, ref = (t.to(dtype=dtype, device=path) for t in _clouds("normal", 24, generator))
    dists, idx = fullgraph.knn(query, ref, 4, backend="dense")
    assert dists.dtype == dtype
    d = oracle_distances(query, ref)
    want_dists, want_idx, _ = oracle_nearest(d, 4)
    assert_neighbors(dists, idx, want_dists, want_idx, d, dtype)


def test_gradients(path, generator):
    query, ref = (t.to(path).requires_grad_() for t in _clouds("uniform", 6, generator, rows=10, columns=40))
    features = torch.randn(40, 3, dtype=torch.float64, generator=generator).to(path).requires_grad_()
    assert torch.autograd.gradcheck(lambda q, r: fullgraph.knn(q, r, 4, backend="dense")[0], (query, ref))
    # CUDA's scatter-adds of the features' gradient sum in no fixed order
    assert torch.autograd.gradcheck(lambda q, r, f: fullgraph.knn_aggregate(q, r, f, 4, sigma=0.3, backend="dense"),
                                    (query, ref, features), nondet_tol=1e-12 if path == "cuda" else 0.0)


def test_auto_leaves_small_items_to_the_cpu_brute_force(monkeypatch, generator):
    """Items of few pairs (dense.CPU_BRUTE_FORCE, by D) go to the "cpu" backend's brute force
    where the extension built, the same lists as the reference; wider D or more pairs to the
    products."""
    from fullgraph.ops.neighbors.cpu import backend as cpu, native as select

    if not select.available():
        pytest.skip("the C++ extension did not build here")
    brute, products = [], []
    monkeypatch.setattr(cpu, "brute_force", lambda *a, f=cpu.brute_force: brute.append(a[0].shape[-1]) or f(*a))
    # (eager calls the brute force takes go straight to its one C++ call: api._knn_in_one_call)
    monkeypatch.setattr(cpu, "tiny_lists", lambda *a, f=cpu.tiny_lists: brute.append(a[0].shape[-1]) or f(*a))
    kernels = dense.BACKEND.implementation
    monkeypatch.setattr(kernels, "nearest", lambda *a, f=kernels.nearest: products.append(a[0].shape[-1]) or f(*a))
    # (and small eager calls of the products, in their one C++ call: api._knn_in_one_call)
    monkeypatch.setattr(dense, "plain_in_one_call",
                        lambda *a, f=dense.plain_in_one_call: products.append(a[0].shape[-1]) or f(*a))
    monkeypatch.setattr(dense, "CPU_BRUTE_FORCE", {1: ((8, 6 * 30), (64, 6 * 20)), 64: ()})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)  # nearer 1 than 64
    monkeypatch.setattr(dense.cpu_backend, "TINY_MAX_WORK", 0)  # (tiny calls: tests/ops/neighbors/test_search.py)
    for dim, columns in ((3, 30), (8, 30), (16, 20), (16, 30), (64, 20), (65, 30)):
        query, ref = (t.float() for t in _clouds("normal", dim, generator, rows=6, columns=columns))
        got = fullgraph.knn(query, ref, 4)
        want = fullgraph.knn(query, ref, 4, backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    assert brute == [3, 8, 16, 64] and products == [16, 65]
    # lists of half the references or more (k + CANDIDATE_SLACK): the products' path measures every
    # pair in the brute force's call (dense.lists_of_most)
    brute.clear()
    query, ref = (t.float() for t in _clouds("normal", 65, generator, rows=6, columns=2 * (4 + dense.CANDIDATE_SLACK)))
    got, want = fullgraph.knn(query, ref, 4), fullgraph.knn(query, ref, 4, backend="torch")
    assert brute == [65] and torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    monkeypatch.setattr(torch, "get_num_threads", lambda: 32)  # nearer 64: its table, no brute force
    assert not dense.brute_force_limits() and dense._auto("cpu", torch.float32, 3, 4, 6 * 30)


def test_auto_takes_it_in_feature_space_and_for_small_items_on_cpus(monkeypatch, generator):
    """On CPUs "auto" takes the products from AUTO_MIN_DIM on, and below it for items of
    few query-reference pairs (more from CPU_AUTO_WIDE_DIM on); the k-d tree elsewhere."""
    calls = []
    kernels = dense.BACKEND.implementation
    original = kernels.nearest
    monkeypatch.setattr(kernels, "nearest", lambda *a: calls.append((a[0].shape[-1], a[1].shape[1])) or original(*a))
    # (small eager calls of the products, in their one C++ call: api._knn_in_one_call)
    monkeypatch.setattr(dense, "plain_in_one_call",
                        lambda *a, f=dense.plain_in_one_call: calls.append((a[0].shape[-1], a[1].shape[1])) or f(*a))
    monkeypatch.setattr(dense, "CPU_AUTO_MAX_PAIRS", 5 * 20)
    monkeypatch.setattr(dense, "CPU_AUTO_WIDE_MAX_PAIRS", 5 * 40)
    monkeypatch.setattr(dense, "CPU_BRUTE_FORCE", {1: ()})  # (its own test below)
    monkeypatch.setattr(dense.cpu_backend, "TINY_MAX_WORK", 0)  # (tiny calls: tests/ops/neighbors/test_search.py)
    for dim in (3, dense.CPU_AUTO_WIDE_DIM, dense.AUTO_MIN_DIM - 1, dense.AUTO_MIN_DIM, 64):
        for columns in (20, 40, 60):
            query, ref = (t.float() for t in _clouds("uniform", dim, generator, rows=5, columns=columns))
            dists, idx = fullgraph.knn(query, ref, 3)
            want = fullgraph.knn(query, ref, 3, backend="torch")
            assert torch.equal(idx, want[1]) and torch.equal(dists, want[0])
    wide = [(dim, 20) for dim in (dense.CPU_AUTO_WIDE_DIM, dense.AUTO_MIN_DIM - 1)] + [
        (dim, 40) for dim in (dense.CPU_AUTO_WIDE_DIM, dense.AUTO_MIN_DIM - 1)]
    assert sorted(calls) == sorted([(3, 20), *wide, *((dim, c) for dim in (dense.AUTO_MIN_DIM, 64)
                                                         for c in (20, 40, 60))])
    assert not dense._auto("cpu", torch.float32, 3, 3) and not dense._auto("cpu", torch.float32, None, 3, 10)
    with pytest.raises(ValueError, match='"dense" provides knn and knn_aggregate, not radius'):
        fullgraph.radius(query, ref, 0.5, 3, backend="dense")


@pytest.mark.skipif(not HAVE_TRITON, reason="the GPU path needs Triton")
def test_auto_on_cuda_takes_it_at_every_width_and_list_length_graphed_or_not(monkeypatch):
    """"auto" takes dense on CUDA from CUDA_AUTO_MIN_DIM at every D and k, graphed or not
    (lists beyond REDO_MAX_K too: a capture takes the products path for them), but for lists
    beyond CAPTURE_MAX_K inside a capture."""
    longer = dense.REDO_MAX_K + 1
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        for dim in (dense.CUDA_AUTO_MIN_DIM, 64, 129, 2048):
            for k in (1, 10, longer, 1024):
                assert dense._auto("cuda", torch.float32, dim, k)
        assert not dense._auto("cuda", torch.float64, 300, 10)
        assert not dense._auto("cuda", torch.float32, dense.CUDA_AUTO_MIN_DIM - 1, 10)
        assert dense._auto("cuda", torch.float32, 64, dense.CAPTURE_MAX_K + 1) == (not capturing)


@pytest.mark.parametrize("case", ["usual", "offset", "nan", "far out", "tiny", "ragged"])
def test_usual_cpu_clouds_are_framed_from_their_norms(case, generator):
    """On CPUs a cloud of valid, unscaled points whose mean reference lies near the origin is
    framed from its squared norms (the clouds themselves the products' operands); any other
    cloud is centred and scaled as before. Either way the lists are the reference's, bit for bit."""
    query, ref = (t.float() for t in _clouds("normal", 24, generator, rows=60, columns=300))
    query, ref = torch.stack([query, query.flip(1)]), torch.stack([ref, ref * 0.5])
    lengths = (None, None)
    if case == "offset":
        query, ref = query + 3, ref + 3
    if case == "nan":
        ref[1, 17, 3] = math.nan
    if case == "far out":
        query, ref = query * 2.0**45, ref * 2.0**45
    if case == "tiny":
        query, ref = query * 2.0**-40, ref * 2.0**-40
    if case == "ragged":
        lengths = (torch.tensor([60, 31]), torch.tensor([300, 120]))
    frames = dense.Frames(query, ref, *lengths, torch.float32)
    assert (frames.qc is query and frames.rc is ref) == (case == "usual")
    assert case == "ragged" or torch.equal(frames.largest, torch.maximum(query.abs().nan_to_num(0).amax((1, 2)),
                                                                      ref.abs().nan_to_num(0, 0, 0).amax((1, 2)))
                                            / frames.scale[:, 0])
    for k in (1, 9, 300):
        got = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="dense")
        want = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("distribution", ["normal", "clustered", "duplicates", "far"])
def test_products_in_reference_tiles_select_what_the_whole_rows_select(distribution, monkeypatch, generator):
    """On CPUs the products are selected a tile of references at a time, the tiles' least
    merged: the same least values as the whole rows (ragged items, a NaN query, k up to N),
    and the reference's lists."""
    query, ref = (t.float() for t in _clouds(distribution, 40, generator, rows=50, columns=700))
    query, ref = torch.stack([query, query + 3]), torch.stack([ref, ref * 2])
    query[1, 7] = math.nan
    lengths = torch.tensor([50, 41]), torch.tensor([700, 333])
    frames = dense.Frames(query, ref, *lengths, torch.float32)
    whole = dense._least_products(frames.qc, frames, 40)
    monkeypatch.setattr(dense, "CPU_REFERENCE_TILE", 64)
    tiled = dense._least_products(frames.qc, frames, 40)
    # (BLAS may block a tile's sums otherwise than the whole rows')
    torch.testing.assert_close(tiled[0], whole[0], rtol=1e-5, atol=1e-4, equal_nan=True)
    for k in (1, 9, 700):
        got = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="dense")
        want = fullgraph.knn(query, ref, k, query_lengths=lengths[0], ref_lengths=lengths[1], backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_unproven_rows_go_again_in_float32_with_no_host_read(monkeypatch, generator):
    """``_first_failed_again`` proves the first failed rows of each item in float32 products and
    clears them; rows beyond its share stay failed."""
    monkeypatch.setattr(dense, "CAPTURE_AGAIN_MIN_ROWS", 3)
    query, ref = (t.float() for t in _clouds("normal", 40, generator, rows=10, columns=200))
    query, ref = query.expand(2, -1, -1).contiguous(), ref.expand(2, -1, -1).contiguous()
    frames = dense.Frames(query, ref, None, None, torch.float32)
    want_d, want_i = fullgraph.knn(query, ref, 5, backend="torch")
    dists, idx = torch.full_like(want_d, math.inf), torch.full_like(want_i, -1)
    failed = torch.zeros(2, 10, dtype=torch.bool)
    failed[0, [1, 4, 7, 9]] = True
    failed[1, [0]] = True
    dense._first_failed_again(frames, 5, math.inf, failed, dists, idx)
    assert failed.nonzero().tolist() == [[0, 9]]
    redone = torch.zeros(2, 10, dtype=torch.bool)
    redone[0, [1, 4, 7]] = redone[1, 0] = True
    assert torch.equal(idx[redone], want_i[redone]) and torch.equal(dists[redone], want_d[redone])
    assert (idx[~redone] == -1).all()


@pytest.mark.parametrize("distribution", ["far", "normal"])
def test_float64_redo_proves_only_the_reference_lists(distribution, generator):
    """The float64 pass that redoes unproven rows multiplies the float32 centred clouds: on far
    clouds (centred norms ~10^4 their distances) the centring's rounding, not the float64
    products', decides near-ties, and a row it proves is the reference's."""
    proven_rows = 0
    for _ in range(4):
        query, ref = (t.float() for t in _clouds(distribution, 64, generator, rows=60, columns=350))
        frames = dense.Frames(query[None], ref[None], None, None, torch.float32)
        d, i, still = dense._block(frames, slice(None), frames.ref_ok, 9, math.inf, 17, "float64")
        want_d, want_i = fullgraph.knn(query, ref, 9, backend="torch")
        proven = ~still[0]
        assert torch.equal(i[0][proven], want_i[proven]) and torch.equal(d[0][proven], want_d[proven])
        proven_rows += int(proven.sum())
    assert proven_rows > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("redo", ["brute force", "search"])
@pytest.mark.parametrize("distribution", ["normal", "duplicates"])
def test_wide_points_in_a_capture_redo_failed_rows_without_a_host_read(distribution, redo, monkeypatch, generator):
    """Graphed, wide points take the tensor cores as eagerly; their unproven rows (ties wider
    than the slack) go again in float32 products first where the Triton search would redo them,
    then to the redo: the same lists as the reference, replayed on new points."""
    if redo == "search":
        monkeypatch.setattr(dense, "BRUTE_FORCE_REDO_MAX_COLUMNS", 0)
    plans, again = [], []
    original_plan, original_again = dense.plan, dense._first_failed_again
    monkeypatch.setattr(dense, "plan", lambda *args: plans.append(original_plan(*args)) or plans[-1])
    monkeypatch.setattr(dense, "_first_failed_again", lambda *args: again.append(1) or original_again(*args))
    dim = dense.CAPTURE_AGAIN_MIN_DIM + 71
    if distribution == "duplicates":
        query, ref = _tied(generator, "cuda", dim=dim)
    else:
        query, ref = (t.float().cuda() for t in _clouds("normal", dim, generator, rows=64, columns=700))
    graphed = fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, 9, backend="dense"))
    for scale in (1.0, 3.0):
        got = graphed(query * scale, ref * scale)
        want = fullgraph.knn(query * scale, ref * scale, 9, backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    captured = [p for p in plans if p.capture]
    assert captured and all(p.path == "tensor cores" for p in captured)
    assert bool(again) == (redo == "search")


@pytest.mark.parametrize("distribution", ["normal", "clustered", "duplicates", "far"])
@pytest.mark.parametrize("dim, k", [(24, 130), (1030, 40), (2050, 5)])
def test_products_in_tf32x3_equal_the_reference(distribution, dim, k, monkeypatch, generator):
    """Long lists and wide points on GPUs take each operand's two TF32 parts on cuBLAS (here
    on the device there is; the arithmetic is the same on CPUs), the rows they leave unproven
    again in float64: exactly the reference's lists."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    monkeypatch.setattr(dense, "PRODUCTS_MIN_K", 1)  # (wide points with short lists too)
    if device == "cpu":
        monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: False)
        _planned(monkeypatch, first="tf32x3")
    again = []
    original_block = dense._block
    monkeypatch.setattr(dense, "_block", lambda *args: again.append(args[-1]) or original_block(*args))
    if distribution == "duplicates":  # ties wider than the slack: float64 first, then the redo
        query, ref = _tied(generator, device, rows=50, columns=400, dim=dim)
    else:
        query, ref = (t.float().to(device) for t in _clouds(distribution, dim, generator, rows=50, columns=400))
    planned = dense.plan(query, ref, k)
    assert planned.path == "products" and planned.first == "tf32x3"
    dists, idx = fullgraph.knn(query, ref, k, backend="dense")
    want_dists, want_idx = fullgraph.knn(query, ref, k, backend="torch")
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)
    if distribution == "duplicates":
        assert "float64" in again


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_captures_redo_small_items_of_any_width_by_the_brute_force():
    """Inside a capture, unproven rows of items whose references times padded width stay within
    BRUTE_FORCE_REDO_MAX_COLUMNS x 256 go to the brute force (up to its widest points and
    longest lists), larger items to the Triton search."""
    most = dense.BRUTE_FORCE_REDO_MAX_COLUMNS
    assert dense._redone_by_every_pair(64, 16, most) and not dense._redone_by_every_pair(64, 16, most + 1)
    assert dense._redone_by_every_pair(768, 16, 256) and dense._redone_by_every_pair(768, 64, most // 4)
    assert not dense._redone_by_every_pair(768, 16, most // 4 + 1)
    assert dense._redone_by_every_pair(2048, 16, most // 8) and not dense._redone_by_every_pair(2049, 16, 16)
    assert not dense._redone_by_every_pair(768, 65, 256) and not dense._redone_by_every_pair(4, 16, 256)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_gpu_plans_take_the_products_for_long_lists(monkeypatch):
    """Where the chosen chunks lose (long lists) GPUs take the products in "tf32x3", up to
    PRODUCTS_MAX_PAIRS (fewer inside a capture); elsewhere the tensor cores' chunks."""
    monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: True)

    def path(batch, rows, columns, dim, k):
        query = torch.empty(batch, rows, dim, device="meta")
        planned = dense.plan(query, torch.empty(batch, columns, dim, device="meta"), k)
        return planned.path + (f" {planned.first}" if planned.path == "products" else "")

    assert path(4, 3000, 3000, 64, 256) == path(1, 2000, 50000, 128, 1024) == "products tf32x3"
    assert path(1, 2000, 50000, 1024, 50) == path(1, 2000, 50000, 2048, 10) == "tensor cores"
    monkeypatch.setattr(dense, "_capturing", lambda query: True)
    assert path(4, 3000, 3000, 64, 256) == "products tf32x3"
    assert path(1, 2000, 50000, 128, 256) == "tensor cores"
    assert path(1, 2000, 50000, 128, 1024) == path(1, 10**4, 10**6, 128, dense.REDO_MAX_K + 1) == "products tf32x3"
    assert path(4, 3000, 3000, 64, 64) == path(1, 2000, 50000, 1024, 10) == "tensor cores"
    assert path(1, 10**4, 2 * 10**5, 256, 128) == path(1, 10**4, 10**5, 1024, 50) == "tensor cores"


def test_tf32_parts_multiply_within_their_bound(generator):
    """high x high + high x low + low x high of two ``tf32_split``s, each part with TF32's 11
    significant bits, lies within product_error("tf32x3") of the float64 product."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense
    from fullgraph.ops.neighbors.dense.frames import tf32_split

    x = torch.randn(4096, generator=generator) * torch.logspace(-30, 30, 4096)
    y = torch.randn(4096, generator=generator).float()
    x = x.float()
    (xh, xl), (yh, yl) = tf32_split(x), tf32_split(y)
    for part in (xh, xl, yh, yl):
        assert not (part.view(torch.int32) & (2**13 - 1)).any()
    exact = x.double() * y.double()
    split = xh.double() * yh.double() + xh.double() * yl.double() + xl.double() * yh.double()
    error = product_error = triton_dense.product_error("tf32x3")
    assert ((split - exact).abs() <= error * exact.abs()).all()
    assert ((xh.double() + xl.double() - x.double()).abs() <= 2.0**-20 * x.double().abs()).all()
    assert product_error > 3 * 2.0**-20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("distribution", ["normal", "duplicates"])
@pytest.mark.parametrize("dim, k", [(24, 130), (1030, 40), (2050, 5), (24, 300), (200, 1024)])
def test_products_in_a_capture_redo_failed_rows_without_a_host_read(distribution, dim, k, generator):
    """Graphed, the products path's unproven rows go again in float64 and then to the Triton
    search (lists beyond REDO_MAX_K too): the reference's lists, replayed on new points."""
    if distribution == "duplicates":  # (more tied rows than the float64 pass takes: the search gets some)
        query, ref = _tied(generator, "cuda", rows=200, columns=max(600, k + 100), dim=dim)
    else:
        query, ref = (t.float().cuda() for t in _clouds("normal", dim, generator, rows=64, columns=1200))
    graphed = fullgraph.graphs.graphed(lambda q, r: fullgraph.knn(q, r, k))
    for scale in (1.0, 3.0):
        got = graphed(query * scale, ref * scale)
        want = fullgraph.knn(query * scale, ref * scale, k, backend="torch")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_cublas_products_restore_the_callers_precision():
    """cuBLAS's products in a precision leave the caller's matmul settings as they were, legacy or
    per backend."""
    before = torch.get_float32_matmul_precision()
    for precision in ("tf32", "ieee"):
        with dense._cublas_products(precision):
            pass
    assert torch.get_float32_matmul_precision() == before


@pytest.mark.slow
def test_compiles_once(generator):
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda q, r: fullgraph.knn(q, r, 4)[0].sum(-1), backend=counter, fullgraph=True,
                             dynamic=True)
    for rows, columns in [(20, 60), (33, 90)]:
        query, ref = (t.float() for t in _clouds("normal", 32, generator, rows, columns))
        torch.testing.assert_close(compiled(query, ref), fullgraph.knn(query, ref, 4, backend="torch")[0].sum(-1),
                                   **tolerance(torch.float32))
    assert counter.frame_count == 1


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("width, count", [(1, 1), (37, 7), (64, 64), (300, 5), (2048, 40), (2000, 600)])
def test_smallest_in_registers_orders_ties_by_position(width, count, monkeypatch, generator):
    """The GPU path's row selection (the least packed keys: runs sorted and halved, or the
    whole row sorted where most of it is kept): a stable sort's first ``count``, with ties,
    -0.0 beside 0.0, negatives and +inf; with ``needed``, those rows alike and the programs
    of the others skipped."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.round(torch.randn(3, 2, width, generator=generator) * 3) * 2  # many ties, -0.0 among them
    values[..., -1] = math.inf
    values = values.to(device)
    found, position = triton_dense.smallest(values, count, in_registers=True)
    want, want_position = torch.sort(values, dim=-1, stable=True)
    assert torch.equal(found, want[..., :count]) and torch.equal(position, want_position[..., :count])
    monkeypatch.setattr(triton_dense.selection, "SORT_KEYS", 1)  # a row a program: the rows not needed are skipped
    needed = torch.zeros(3, 2, dtype=torch.bool, device=device)
    needed[1, 0] = True
    some, some_position = triton_dense.smallest(values, count, in_registers=True, needed=needed)
    assert torch.equal(some[needed], found[needed]) and torch.equal(some_position[needed], position[needed])
    assert torch.isinf(some[~needed]).all() and (some_position[~needed] == torch.arange(count, device=device)).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("count", [1, 17, 64])
@pytest.mark.interpreted(keep=1)
def test_wide_smallest_orders_ties_by_position(count, monkeypatch, generator):
    """The selection of wide rows (a threshold from the minima of classes of positions, the
    values at or below it gathered and sorted): a stable sort's first ``count`` on normal
    rows, rows of few distinct values (more at the threshold than the gathering holds: each
    piece sorted and merged), one value repeated, -0.0 beside 0.0, +inf rows and a row whose
    least values crowd one class; with ``needed``, those rows alike and the others skipped."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    monkeypatch.setattr(triton_dense.selection, "WIDE_BLOCK", 256)  # (several blocks a row in the interpreter)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    width = 1000
    values = torch.randn(8, width, generator=generator)
    values[1] = torch.round(values[1] * 2)  # few distinct values: ties past the gathering's room
    values[2] = 3.0
    values[3, ::2] = -0.0
    values[3, 1::2] = 0.0
    values[4] = math.inf
    values[5, ::64] = -10.0 - torch.rand(16, generator=generator)  # the least all in one class
    values[6, -70:] = -5.0  # near the end, tied
    values = values.to(device)
    found, position = triton_dense.selection._wide_smallest(values, count, None)
    want, want_position = torch.sort(values, dim=-1, stable=True)
    assert torch.equal(found, want[..., :count]) and torch.equal(position, want_position[..., :count])
    needed = torch.zeros(8, dtype=torch.bool, device=device)
    needed[[1, 5]] = True
    some, some_position = triton_dense.selection._wide_smallest(values, count, needed)
    assert torch.equal(some[needed], found[needed]) and torch.equal(some_position[needed], position[needed])
    assert torch.isinf(some[~needed]).all() and (some_position[~needed] == torch.arange(count, device=device)).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("rows, columns, count", [(5, 37, 9), (70, 2100, 25), (3, 9, 3), (40, 5000, 40)])
@pytest.mark.interpreted(keep=1)
def test_least_chunks_in_one_kernel_equal_the_stored_minima_sorted(rows, columns, count, monkeypatch, generator):
    """The fused chunk selection (a running list per query, merged a tile at a time, shares of
    the references merged at the end) against every chunk minimum stored and sorted, plus
    |q|^2: integer
    points make the products exact, so ties between chunks are many and must go to the
    smaller chunk (small integers keep their order through the lists' rounding); invalid
    references (+inf norms) end the cloud."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    monkeypatch.setattr(triton_dense.products, "FUSED_PROGRAMS_PER_SM", 10**6)  # as many shares as there can be
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.round(torch.randn(2, rows, 5, generator=generator) * 2).to(device)
    r = torch.round(torch.randn(2, columns, 5, generator=generator) * 2).to(device)
    norms = (r * r).sum(-1)
    norms[:, -3:] = math.inf
    q_norms = (q * q).sum(-1)
    chunk = triton_dense.chunk_size(columns, count)
    values, chosen = triton_dense.least_chunks(q, q_norms, r, norms, count, chunk, "ieee")
    stored = triton_dense.chunk_minima(q, r, norms, chunk, "ieee")
    want, want_chosen = torch.sort(stored, dim=-1, stable=True)
    want = want[..., :count] + q_norms[..., None]  # (integers: the sums exact, no new ties)
    assert torch.equal(chosen, want_chosen[..., :count])
    # The fused lists round the minima down to the bits the chunk numbers leave.
    kept = 23 - max(1, (-(-columns // chunk) - 1).bit_length())
    finite = torch.isfinite(want)
    assert torch.equal(values[~finite], want[~finite])
    values, want = values[finite], want[finite]
    assert (values <= want).all() and (want - values <= want.abs() * 2.0**-kept).all()


if HAVE_TRITON:
    import triton
    import triton.language as tl
    from fullgraph.ops.neighbors.dense.kernels.members import _key_ceiling, _key_floor

    @triton.jit
    def _key_bounds_kernel(keys_ptr, q_abs_ptr, reach_ptr, bound_ptr, floor_ptr, ceiling_ptr, n, DIM: tl.constexpr,
                           POSITION_BITS: tl.constexpr, BLOCK: tl.constexpr):
        """``_key_floor`` and ``_key_ceiling`` of n keys, each with its query's norm, its
        references' reach and the products' bound."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        keys = tl.load(keys_ptr + i, mask=ok, other=0)
        q_abs, reach = tl.load(q_abs_ptr + i, mask=ok, other=0.0), tl.load(reach_ptr + i, mask=ok, other=0.0)
        bound = tl.load(bound_ptr + i, mask=ok, other=0.0)
        tl.store(floor_ptr + i, _key_floor(keys, bound, q_abs, reach, DIM, POSITION_BITS), mask=ok)
        tl.store(ceiling_ptr + i, _key_ceiling(keys, bound, q_abs, reach, DIM, POSITION_BITS), mask=ok)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim", [16, 64])
def test_a_chunk_key_s_floor_and_ceiling_hold_its_members(dim, generator):
    """A chosen chunk's key bounds its members' squared distances as the reference measures
    them: ``_key_floor`` at or below every member's, ``_key_ceiling`` at or above the
    nearest's (the certified lists measure chunks up to the first whose floor lies above
    the k-th's ceiling). Products in three TF32 products (their bound: ``product_error``);
    normal points, near-duplicates of each query (ties to the last bit of the keys) and a
    far reference."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 40, dim, generator=generator)
    r = torch.randn(2, 600, dim, generator=generator)
    r[:, :40] = q + 1e-4 * torch.randn(2, 40, dim, generator=generator)
    r[:, 40:80] = q
    r[1, 100] = 30.0
    q, r = q.to(device), r.to(device)
    norms, q_norms = (r * r).sum(-1), (q * q).sum(-1)
    keys, bits = triton_dense.least_chunk_keys(q, q_norms, r, norms, 27, "tf32x3")
    chunk = triton_dense.products.FUSED_CHUNK
    members = ((keys & ((1 << bits) - 1)).long()[..., None] * chunk + torch.arange(chunk, device=device)).flatten(2)
    measured = triton_dense.squared_distances(q, r, members).view(*keys.shape, chunk)
    q_abs = q_norms.sqrt()[..., None].expand(keys.shape).contiguous()
    reach = r.norm(dim=-1).amax(-1)[:, None, None].expand(keys.shape).contiguous()
    bound = (triton_dense.product_error("tf32x3") * q_abs * reach).contiguous()
    floors, ceilings = torch.empty_like(bound), torch.empty_like(bound)
    _key_bounds_kernel[(triton.cdiv(keys.numel(), 256),)](keys.contiguous(), q_abs, reach, bound, floors, ceilings,
                                                           keys.numel(), DIM=dim, POSITION_BITS=bits, BLOCK=256)
    nearest = measured.amin(-1)
    assert (floors <= nearest).all() and (ceilings >= nearest).all()
    assert ((ceilings - floors)[0] < 1e-2 * (nearest[0] + 1)).all()  # (close where no reference is far)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("shares", [1, 10**6])
def test_a_floor_key_lies_under_every_chunk_the_halved_tiles_leave_out(shares, monkeypatch, generator):
    """``least_chunk_keys(floor=True)``: tiles offer half the list, so chunks may be left out
    where the nearest crowd into one tile (references ordered along the query's line); the
    count - 1 keys are chunks' own (their minima plus |q|^2, rounded down, ascending,
    distinct chunks) and the last lies at or below every chunk they leave out (above the
    others where the nearest spread over the tiles), with one share of the references or
    many (their floors merged)."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    monkeypatch.setattr(triton_dense.products, "FUSED_PROGRAMS_PER_SM", shares)
    monkeypatch.setattr(triton_dense.products, "FUSED_TILE_HALF", True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.round(torch.randn(2, 70, 5, generator=generator) * 2)
    r = torch.round(torch.randn(2, 1500, 5, generator=generator) * 2)
    r[0, :200] = q[0, :1] + torch.arange(200.0)[:, None] * 0.25  # item 0: the nearest in its first tiles
    r[0, 200:] += 50
    q, r = q.to(device), r.to(device)
    norms, q_norms = (r * r).sum(-1), (q * q).sum(-1)
    count = 27
    keys, bits = triton_dense.least_chunk_keys(q, q_norms, r, norms, count, "ieee", floor=True)
    chosen = (keys & ((1 << bits) - 1)).long()
    values = triton_dense.ordering._ordered_floats(keys & -(1 << bits))
    stored = triton_dense.chunk_minima(q, r, norms, triton_dense.products.FUSED_CHUNK, "ieee") + q_norms[..., None]
    mine = stored.gather(2, chosen[..., :-1])
    assert (values[..., :-1] <= mine).all() and (mine - values[..., :-1] <= mine.abs() * 2.0**-12).all()
    assert (values[..., 1:-1] >= values[..., :-2]).all()
    assert all(len(set(row.tolist())) == count - 1 for row in chosen[..., :-1].reshape(-1, count - 1))
    left_out = stored.scatter(2, chosen[..., :-1], math.inf).amin(-1)
    assert (values[..., -1] <= left_out).all()
    assert (values[1, :, -1] >= values[1, :, -2]).float().mean() > 0.9  # (item 1's nearest spread: a useful floor)
    exact = torch.sort(stored, dim=-1).values[..., count - 2]
    assert (mine.amax(-1) > exact)[0].any()  # (item 0's tiles left some of its nearest out)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("precision", ["tf32x3", "tf32"])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_chunk_minima_within_the_products_error(precision, dim, generator):
    """The tensor cores' chunk minima of ``|r|^2 - 2 q.r`` against float64, within
    ``triton_dense.product_error`` (each product's input rounding, summed: eps |q| |r|) plus
    the float32 sums of three products a coordinate: on coordinates of mixed magnitudes,
    near-duplicates and a far point. (Triton's interpreter multiplies in float32 whatever
    the precision.)"""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 70, dim, generator=generator) * 10.0 ** torch.randint(-2, 3, (1, 1, dim), generator=generator)
    r = torch.cat([torch.randn(2, 500, dim, generator=generator), q[:, :20] * (1 + 2**-20), q[:, 20:21] * 1e3], 1)
    norms = (r * r).sum(-1)
    got = triton_dense.chunk_minima(q.to(device), r.to(device), norms.to(device), 4, precision).cpu().double()
    values = norms.double()[:, None, :] - 2 * q.double() @ r.double().transpose(1, 2)
    want = torch.nn.functional.pad(values, (0, -r.shape[1] % 4), value=math.inf).unflatten(-1, (-1, 4)).amin(-1)
    q_abs, reach = q.double().norm(dim=-1)[..., None], r.double().norm(dim=-1).amax(-1)[:, None, None]
    u = 2.0**-24
    bound = 2 * (triton_dense.product_error(precision) + 3 * dim * u) * q_abs * reach + 4 * u * (
        norms.double().amax(-1)[:, None, None] + 2 * q_abs * reach)
    assert ((got - want).abs() <= bound).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim", [16, 64, 128])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**-40, 2.0**50])
def test_half_operands_multiply_within_their_bound(dim, magnitude, generator):
    """The first products (``dense._products``, "fp16"): operands times a power of two
    rounded to float16 (finite, each coordinate within 2^-11 of its own or of float16's
    subnormals, the GPU frames' as torch rounds theirs), and their chunk minima against
    float64 of the unrounded clouds within the stated bound plus the float32 sums:
    coordinates of mixed magnitudes (and clouds far from 1 in all), near-duplicates, a far
    point."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    query = torch.randn(2, 70, dim, generator=generator) * 10.0 ** torch.randint(-2, 3, (1, 1, dim), generator=generator)
    ref = torch.cat([torch.randn(2, 500, dim, generator=generator), query[:, :20] * (1 + 2**-20),
                     query[:, 20:21] * 1e3], 1)
    query, ref = query.to(device) * magnitude, ref.to(device) * magnitude
    lengths = (torch.tensor([70, 70], device=device), torch.tensor([521, 521], device=device))
    got = triton_dense.frames(query, ref, *lengths, halves=True)
    frames = dense.Frames(query, ref, None, None, torch.float32)
    qh, rh, q_lo, r_lo, twice = frames.halves()
    unit = frames.unit[:, None, None]
    for half, exact in ((qh, frames.qc), (rh, frames.rc)):
        assert half.dtype == torch.float16 and torch.isfinite(half).all()
        assert ((exact - half.float() / unit).abs() <= exact.abs() * 2.0**-11 + 2.0**-25 / unit).all()
    assert torch.equal(got["unit"], frames.unit)
    assert torch.equal(got["qh"], triton_dense.half_operands(got["qc"], got["unit"])[0])
    assert torch.equal(got["rh"], triton_dense.half_operands(got["rc"], got["unit"])[0])
    for name, lo in (("q_lo", lambda x: x), ("r_lo", lambda x: x.amax(-1, keepdim=True))):
        torch.testing.assert_close(got[name], lo(triton_dense.half_operands(got[name[0] + "c"], got["unit"])[1]))
    q_abs = frames.qc.norm(dim=-1)
    qc, rc, norms = frames.qc.cpu().double(), frames.rc.cpu().double(), frames.r_norms.cpu().double()
    values = norms[:, None, :] - 2 * qc @ rc.transpose(1, 2)
    want = torch.nn.functional.pad(values, (0, -rc.shape[1] % 4), value=math.inf).unflatten(-1, (-1, 4)).amin(-1)
    u, reach = 2.0**-24, frames.reach.cpu().double()[..., None]
    sums = 2 * 3 * dim * u * q_abs.cpu().double()[..., None] * reach + 4 * u * (
        norms.amax(-1)[:, None, None] + 2 * q_abs.cpu().double()[..., None] * reach)
    errors = {}
    for precision in ("fp16", "fp16x3"):  # (the second products of wide points: halves and lows)
        q, r, twice, error, lows = dense._products(frames, slice(None), precision, q_abs)
        assert (lows is None) == (precision == "fp16")
        minima = triton_dense.chunk_minima(q, r, frames.r_norms, 4, precision, twice=twice, lows=lows).cpu().double()
        assert ((minima - want).abs() <= 2 * error.cpu().double()[..., None] + sums).all()
        errors[precision] = error
    # the lows carry ~11 more bits: their bound is far below the halves' alone
    assert (errors["fp16x3"] <= errors["fp16"] * 2.0**-8).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_member_distances_of_the_needed_rows(generator):
    """``triton_dense.member_distances``: the squared distances to every member of the chosen
    chunks within (D + 2) u of float64 (a chunk past N and an invalid reference +inf); with
    ``needed``, those rows alike and the others +inf."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dim, chunk = 40, 8
    q = torch.randn(2, 5, dim, generator=generator)
    r = torch.randn(2, 60, dim, generator=generator)
    norms = (r * r).sum(-1)
    norms[1, 3] = math.inf
    chosen = torch.randint(0, 8, (2, 5, 3), generator=generator)  # chunk 7 holds references 56-63 of 60
    got = triton_dense.member_distances(q.to(device), r.to(device), norms.to(device), chosen.to(device), chunk).cpu()
    refs = (chosen[..., None] * chunk + torch.arange(chunk)).flatten(-2)
    padded = torch.cat([r, torch.zeros(2, 4, dim)], 1).double()
    want = ((q.double()[:, :, None] - padded.gather(1, refs.flatten(1)[..., None].expand(-1, -1, dim)
                                                     ).view(2, 5, -1, dim)) ** 2).sum(-1)
    invalid = (refs >= 60) | torch.isinf(norms.gather(1, refs.clamp(max=59).flatten(1)).view(refs.shape))
    assert torch.isinf(got[invalid]).all()
    assert ((got[~invalid] - want[~invalid]).abs() <= want[~invalid] * (dim + 2) * 2.0**-24).all()
    needed = torch.tensor([[True, False, False, True, False], [False] * 5])
    some = triton_dense.member_distances(q.to(device), r.to(device), norms.to(device), chosen.to(device), chunk,
                                         needed.to(device)).cpu()
    assert torch.equal(some[needed], got[needed]) and torch.isinf(some[~needed]).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
def test_only_the_needed_queries_tiles_are_multiplied(monkeypatch, generator):
    """``needed``: the stored chunk minima of the tiles holding a needed query equal those of
    the whole call (held queries and not); the other tiles are not written."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 300, 16, generator=generator).to(device)
    r = torch.randn(2, 600, 16, generator=generator).to(device)
    norms = (r * r).sum(-1)
    needed = torch.zeros(2, 300, dtype=torch.bool, device=device)
    needed[0, 5] = needed[1, 299] = True
    products = triton_dense.products
    for held, tile in ((0, products.MINIMA_TILES["tf32x3"][0]), (128, products.MINIMA_HELD_TILES[16][0])):
        held_max = dict.fromkeys(triton_dense.products.MINIMA_HELD_MAX_DIM, held)
        monkeypatch.setattr(triton_dense.products, "MINIMA_HELD_MAX_DIM", held_max)
        whole = triton_dense.chunk_minima(q, r, norms, 16, "tf32x3")
        some = triton_dense.chunk_minima(q, r, norms, 16, "tf32x3", needed)
        for b, rows in ((0, slice(0, tile)), (1, slice(300 // tile * tile, 300))):
            assert torch.equal(some[b, rows], whole[b, rows])


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim, radius", [(16, math.inf), (64, math.inf), (64, 2.5)])
@pytest.mark.interpreted(keep=1)
def test_the_fused_lists_finished_in_one_kernel_equal_the_operators(dim, radius, monkeypatch, generator):
    """``_fused_lists`` (every member measured, the certificate, the scale and the radius in one
    kernel a query; first products of halved tiles, at D = 64 of float16 operands, and the rows
    they leave unproven again)
    flags the rows that the operators' path (``_proven_lists``) flags (within a radius a
    subset: it certifies the k nearest before the radius drops some, the operators after)
    and ends in the same lists: ragged items, a NaN query, ties wider than the slack, a far
    item."""
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: query.dtype != torch.float64)
    monkeypatch.setattr(triton_dense.products, "FUSED_TILE_HALF", True)  # (halved tiles first here too)
    monkeypatch.setattr(triton_dense.products, "FUSED_TILE_HALF_MIN_COLUMNS", 0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, ref = (t.float() for t in _clouds("normal", dim, generator, rows=40, columns=500))
    query, ref = torch.stack([query, query * 1e-3 + 1000]), torch.stack([ref, ref * 1e-3 + 1000])
    tied_query, tied_ref = _tied(generator, rows=10, columns=200, dim=dim)
    query[0, :10], ref[0, :200] = tied_query, tied_ref
    query[1, 3] = math.nan
    query, ref = query.to(device), ref.to(device)
    lengths = torch.tensor([40, 33], device=device), torch.tensor([500, 321], device=device)
    failed, redo = [], dense._redo
    monkeypatch.setattr(dense, "_redo", lambda *args: failed.append(args[8].clone()) or redo(*args))
    fused = dense.nearest(query, ref, 9, radius, *lengths)
    _planned(monkeypatch, fused=False, whole=False)  # (whole: the fused lists' promise)
    operators = dense.nearest(query, ref, 9, radius, *lengths)
    assert 0 < int(failed[0].sum()) < 40
    assert torch.equal(failed[0], failed[1]) if radius == math.inf else not (failed[0] & ~failed[1]).any()
    for got, want in zip(fused, operators if radius < math.inf else operators[:2]):  # (kNN: no counts)
        assert torch.equal(got, want)
    want_dists, want_idx, _ = dense.reference.nearest(query, ref, 9, radius, *lengths)
    assert torch.equal(fused[1], want_idx) and torch.equal(fused[0], want_dists)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("second", ["tf32x3", "fp16x3"])
@pytest.mark.interpreted(keep=0)
def test_rows_the_first_products_leave_unproven_go_again(second, monkeypatch, generator):
    """The stored minima's first products of float16 operands: rows whose first bound is made useless
    (every third query) are proven by the second products (three TF32 products, or float16 halves
    and lows from HALF_SECOND_MIN_DIM), theirs only: the reference's lists, and no row left for
    the redo."""
    monkeypatch.setattr(dense, "_on_tensor_cores", lambda query: query.dtype != torch.float64)
    monkeypatch.setattr(dense.triton_dense.products, "FUSED_MAX_KEYS", 0)
    monkeypatch.setattr(dense, "HALF_FIRST_MIN_DIM", 16)
    monkeypatch.setattr(dense, "WIDE_SLACK_MIN_DIM", 16)
    monkeypatch.setattr(dense, "HALF_SECOND_MIN_DIM", 16 if second == "fp16x3" else 2**20)
    products, tiers = dense._products, []

    def loose_first(frames, rows, precision, q_abs):
        q, r, twice, error, lows = products(frames, rows, precision, q_abs)
        if precision == "fp16":
            error = torch.where(torch.arange(error.shape[-1], device=error.device) % 3 == 0, 1e30, error)
        return q, r, twice, error, lows

    def counted(frames, rows, ref_ok, k, radius, precision, chunk, slack, needed=None):
        tiers.append((precision, None if needed is None else needed.tolist(), slack))
        return proven(frames, rows, ref_ok, k, radius, precision, chunk, slack, needed)

    proven = dense._proven_lists
    monkeypatch.setattr(dense, "_products", loose_first)
    monkeypatch.setattr(dense, "_proven_lists", counted)
    redone, redo = [], dense._redo
    monkeypatch.setattr(dense, "_redo", lambda *args: redone.append(int(args[8].sum())) or redo(*args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    query, ref = (t.float().to(device) for t in _clouds("normal", 16, generator, rows=40, columns=3000))
    dists, idx = fullgraph.knn(query, ref, 7, backend="dense")
    assert [(precision, slack) for precision, _, slack in tiers] == [
        ("fp16", dense.CHUNK_SLACK), (second, dense.triton_dense.selection.WIDE_GROUPS - 1 - 7)]
    assert tiers[1][1] == [[i % 3 == 0 for i in range(40)]]
    assert redone == [0]
    want_dists, want_idx = fullgraph.knn(query, ref, 7, backend="torch")
    assert torch.equal(idx, want_idx) and torch.equal(dists, want_dists)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim", [3, 4, 5, 40, 64, 300, 129, 2049])
@pytest.mark.parametrize("chunk, n_chosen, take, count", [(4, 24, 28, 20), (1, 10, 10, 10), (4, 3, 28, 20),
                                                          (16, 5, 12, 7)])
@pytest.mark.interpreted(keep=1)
def test_nearest_members_re_measure_the_first_measures_least(dim, chunk, n_chosen, take, count, generator):
    """``triton_dense.nearest_members`` (one kernel a query: the chosen chunks' members
    measured by summed differences, the ``take`` least re-measured in the reference's
    arithmetic and ordered) against torch doing each step: the same members, bits and order,
    with duplicates (ties to the smaller index), invalid references, a missing chunk (-1),
    lists longer than the members (padding), and rows not ``needed`` left as they were."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, rows, columns = 2, 5, 200
    q = torch.randn(batch, rows, dim, generator=generator)
    r = torch.randn(batch, columns, dim, generator=generator)
    r[:, 7] = r[:, 3]
    ok = torch.rand(batch, columns, generator=generator) > 0.1
    chunks = -(-columns // chunk)
    chosen = torch.stack([torch.randperm(chunks, generator=generator)[:n_chosen].sort().values
                          for _ in range(batch * rows)]).reshape(batch, rows, n_chosen)
    chosen[0, 0, -1] = -1
    needed = torch.rand(batch, rows, generator=generator) > 0.3
    d, i, last = triton_dense.nearest_members(q.to(device), r.to(device), ok.to(device), chosen.to(device), chunk,
                                              take, count)
    kept, _, _ = triton_dense.nearest_members(q.to(device), r.to(device), ok.to(device), chosen.to(device), chunk,
                                              take, count, needed=needed.to(device))
    d, i, last, kept = d.cpu(), i.cpu(), last.cpu(), kept.cpu()

    members = (chosen[..., None] * chunk + torch.arange(chunk)).reshape(batch, rows, -1)
    valid = (chosen[..., None] >= 0).expand(-1, -1, -1, chunk).reshape(members.shape) & (members < columns)
    members = members.clamp(0, columns - 1)
    valid &= ok.gather(1, members.reshape(batch, -1)).reshape(members.shape)
    gathered = lambda at: torch.stack([r[b][at[b]] for b in range(batch)])
    first = ((q[:, :, None] - gathered(members)) ** 2).sum(-1).masked_fill(~valid, math.inf)
    width = members.shape[-1]
    power_of_two = lambda x: 1 << (max(x, 2) - 1).bit_length()
    if power_of_two(take) < power_of_two(width):  # (the kernel's rows are powers of two)
        least, position = torch.sort(first, dim=-1, stable=True)
        position = position[..., :take]
        assert torch.allclose(last, least[..., take - 1], rtol=1e-5)  # another summation order
    else:  # every member re-measured
        position = torch.arange(width).expand(batch, rows, width)
        assert torch.isinf(last).all()
    candidates, real = members.gather(2, position), valid.gather(2, position)
    squares = pairs.squared_difference(q[:, :, None], gathered(candidates))
    # (numpy's sqrt is correctly rounded, as CUDA's and the interpreter's; torch's CPU one may differ)
    exact = torch.from_numpy(np.sqrt(squares.numpy()))
    want_d, want_i = pairs.order_by_distance(exact.masked_fill(~real, math.inf), candidates.masked_fill(~real, -1))
    n = min(count, want_d.shape[-1])
    assert torch.equal(d[..., :n], want_d[..., :n]) and torch.equal(i[..., :n], want_i[..., :n])
    assert torch.isinf(d[..., n:]).all() and (i[..., n:] == -1).all()
    assert torch.equal(kept[needed], d[needed]) and torch.isinf(kept[~needed]).all()


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim, take", [(40, 264), (300, 264), (40, 1032), (3, 1032), (300, 520), (300, 512)])
@pytest.mark.interpreted(keep=2)
def test_nearest_members_order_long_candidate_lists(dim, take, generator):
    """The products path's candidate lists on GPUs (``nearest_members`` with chunk 1: every
    candidate re-measured, a warp a CANDIDATES_PER_WARP of them): the reference's distances
    in (distance, index) order, with duplicate points, invalid references and missing
    candidates (-1) among them."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, rows, columns = 2, 3, 1500
    if not triton_dense.orders_candidates(take, dim):  # (wide points: fewer; torch re-measures longer lists)
        assert dim >= triton_dense.members.WIDE_MIN_DIM and take > triton_dense.members.CANDIDATES_WIDE_MAX
        return
    q = torch.randn(batch, rows, dim, generator=generator)
    r = torch.randn(batch, columns, dim, generator=generator)
    r[:, 11] = r[:, 5]
    r[:, 12] = r[:, 5]
    ok = torch.rand(batch, columns, generator=generator) > 0.1
    candidates = torch.stack([torch.randperm(columns, generator=generator)[:take] for _ in range(batch * rows)])
    candidates = candidates.reshape(batch, rows, take)
    candidates[..., :3] = torch.tensor([12, 5, 11])
    candidates[0, 1, -5:] = -1
    d, i, _ = triton_dense.nearest_members(q.to(device), r.to(device), ok.to(device), candidates.to(device), 1, take,
                                           take)
    d, i = d.cpu(), i.cpu()
    real = (candidates >= 0) & ok.gather(1, candidates.clamp(min=0).reshape(batch, -1)).reshape(candidates.shape)
    gathered = torch.stack([r[b][candidates[b].clamp(min=0)] for b in range(batch)])
    exact = torch.from_numpy(np.sqrt(pairs.squared_difference(q[:, :, None], gathered).numpy()))
    want_d, want_i = pairs.order_by_distance(exact.masked_fill(~real, math.inf), candidates.masked_fill(~real, -1))
    assert torch.equal(d, want_d) and torch.equal(i, want_i)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim", [5, 64, 128, 129, 300, 1024, 4096])
@pytest.mark.interpreted(keep=5)  # (the stepped sum at 129 and 300 here; 1024 and 4096 on the GPU)
def test_squared_distances_have_the_references_bits(dim, generator):
    """The GPU re-measure in one Triton pass (gather, square, halving sum): bit for bit the
    reference's ``pairs.squared_difference`` of the gathered rows, on coordinates whose
    squares span many orders of magnitude (so any other summation order shows), with
    near-duplicates (tiny differences) and far points among them."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 7, dim, generator=generator) * 10.0 ** torch.randint(-6, 6, (1, 1, dim), generator=generator)
    r = torch.cat([torch.randn(2, 40, dim, generator=generator) * 1e3, q + 1e-30, q * (1 + 2**-23),
                   q + torch.randn(2, 7, dim, generator=generator)], 1)
    candidates = torch.randint(0, r.shape[1], (2, 7, 9), generator=generator)
    q, r, candidates = q.to(device), r.to(device), candidates.to(device)
    got = triton_dense.squared_distances(q, r, candidates)
    want = pairs.squared_difference(q[:, :, None, :], dense._gather_rows(r, candidates))
    assert torch.equal(got, want)
    assert not torch.equal(want, (q[:, :, None, :] - dense._gather_rows(r, candidates)).square().double().sum(-1).float())


@pytest.mark.parametrize("width", [1, 2, 3, 5, 8, 13, 64, 300])
def test_halving_sum_adds_in_its_stated_order(width, generator):
    """``halving_sum``: x[j] += x[j + h] for the largest power of two h below the width, down
    to one value: the same bits as that loop written out over a zero-padded copy, and within
    float rounding of the float64 sum."""
    from fullgraph.ops.neighbors import pairs

    x = torch.randn(50, width, generator=generator) * 10.0 ** torch.randint(-4, 4, (50, width), generator=generator)
    padded = torch.zeros(50, 1 << (width - 1).bit_length())
    padded[:, :width] = x
    while padded.shape[1] > 1:
        padded = padded[:, :padded.shape[1] // 2] + padded[:, padded.shape[1] // 2:]
    got = pairs.halving_sum(x.clone())
    assert torch.equal(got, padded[:, 0])
    torch.testing.assert_close(got.double(), x.double().sum(-1), rtol=width * 2**-23, atol=0)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [5, 64])
def test_frames_in_triton_equal_torchs(dtype, dim, generator):
    """The GPU frames (three Triton kernels) against the torch ones: validity (ragged lengths,
    NaN and inf coordinates, an empty item), the power-of-two scale (coordinates beyond its
    range, subnormal ones), the scaled clouds bit for bit, and the centred clouds, norms and reach to float
    rounding (the centre's sum runs in another order)."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # item 3: subnormal coordinates (bfloat16's on GPUs only: Triton's interpreter widens them wrong)
    tiny = 1e-40 if dtype == torch.float32 or device == "cuda" else 1e-30
    size = torch.tensor([1.0, 1e15, 1.0, tiny])[:, None, None]
    shift = torch.tensor([7.0, 7.0, 7.0, 0.0])[:, None, None]
    query = torch.randn(4, 40, dim, generator=generator) * size + shift
    ref = torch.randn(4, 70, dim, generator=generator) * size + shift
    query[0, 3, 1], ref[0, 5, 0], ref[2, 9, 2] = math.nan, math.inf, -math.inf
    query, ref = query.to(dtype).to(device), ref.to(dtype).to(device)
    query_lengths = torch.tensor([40, 17, 0, 40], device=device)
    ref_lengths = torch.tensor([70, 70, 33, 70], device=device)
    got = triton_dense.frames(query, ref, query_lengths, ref_lengths)
    query_ok, ref_ok = pairs.valid_points(query, query_lengths), pairs.valid_points(ref, ref_lengths)
    want = dense.Frames(query, ref, query_lengths, ref_lengths, torch.float32)
    assert torch.equal(want.query_ok, query_ok) and torch.equal(want.ref_ok, ref_ok)
    assert torch.equal(got["query_ok"], query_ok) and torch.equal(got["ref_ok"], ref_ok)
    assert torch.equal(got["scale"], want.scale) and want.scale[1].item() > 1 and 0 < want.scale[3].item() < 2**-30
    torch.testing.assert_close(got["q"], want.q, rtol=0, atol=0, equal_nan=True)  # NaN rows stay NaN
    torch.testing.assert_close(got["r"], want.r, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(torch.isinf(got["r_norms"]), ~ref_ok)
    for name in ("qc", "rc", "r_norms", "reach"):
        torch.testing.assert_close(got[name], getattr(want, name), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")
@pytest.mark.parametrize("dim", [5, 64, 200, 700])
@pytest.mark.parametrize("k", [1, 7, 40])
def test_brute_force_measures_every_pair_as_the_reference(dim, k, generator):
    """``triton_dense.brute_force``: the k nearest valid references by the reference's
    arithmetic (bits of the halving sums), ties to the smaller position, with duplicates,
    invalid references and fewer valid references than k in one item."""
    from fullgraph.ops.neighbors import pairs
    from fullgraph.ops.neighbors.dense import kernels as triton_dense

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(2, 9, dim, generator=generator) * 10.0 ** torch.randint(-3, 3, (1, 1, dim), generator=generator)
    r = torch.cat([torch.randn(2, 30, dim, generator=generator), q[:, :4], q[:, :4]], 1)  # exact duplicates
    ok = torch.ones(2, r.shape[1], dtype=torch.bool)
    ok[0, ::3] = False
    ok[1, 5:] = False  # item 1: 5 valid references
    found, position = triton_dense.brute_force(q.to(device), r.to(device), ok.to(device), k, sort_from=1 << 30)
    # (the kernel's square root is correctly rounded, as torch's is on CUDA; on CPUs numpy's is)
    squared = torch.from_numpy(np.sqrt(pairs.squared_difference(q[:, :, None, :], r[:, None, :, :]).numpy()))
    squared = squared.masked_fill(~ok[:, None, :], math.inf)
    want, want_position = pairs.order_by_distance(squared, torch.arange(r.shape[1]).expand_as(squared).clone())
    pad = max(0, k - want.shape[-1])  # (k beyond the references: +inf, -1)
    want = torch.nn.functional.pad(want, (0, pad), value=math.inf)[..., :k]
    want_position = torch.nn.functional.pad(want_position, (0, pad), value=-1)[..., :k].masked_fill(
        torch.isinf(want), -1)
    assert torch.equal(position.cpu(), want_position)
    assert torch.equal(found.cpu(), want)


def test_large_cpu_clouds_are_sized_and_normed_without_copies_to_the_same_values(monkeypatch, generator):
    """Large CPU clouds (``scaling.LARGE_CPU_VALUES``) take the least and greatest coordinate and a
    batched product for |x|^2: the same magnitudes as |x|'s maximum (NaN, inf, -0.0 and negative
    extremes among them), norms within float32's rounding, and the reference's lists."""
    from fullgraph.ops import scaling
    from fullgraph.ops.neighbors.dense import frames

    x = torch.randn(2, 300, 37, generator=generator) * 10.0 ** torch.randint(-3, 3, (2, 300, 1), generator=generator)
    x[0, 1, 5], x[0, 2, 7], x[1, 3] = math.nan, -math.inf, -0.0
    x[1, 4, 0] = -1e6
    small = (scaling.magnitude(x), frames._squared_norms(x))
    monkeypatch.setattr(scaling, "LARGE_CPU_VALUES", 1)
    assert scaling.large_on_cpu(x)
    large = (scaling.magnitude(x), frames._squared_norms(x))
    assert torch.equal(large[0].nan_to_num(-1.0), small[0].nan_to_num(-1.0))
    torch.testing.assert_close(large[1], small[1], rtol=37 * 2**-23, atol=0, equal_nan=True)
    query, ref = torch.randn(2, 40, 24, generator=generator), torch.randn(2, 500, 24, generator=generator)
    got, want = fullgraph.knn(query, ref, 9, backend="dense"), fullgraph.knn(query, ref, 9, backend="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("dim, k", [(4, 1), (64, 16), (300, 130)])
def test_the_torch_path_equals_the_reference(distribution, dim, k, generator):
    """What answers an eager GPU call while its kernels compile in the background: torch's own
    operators, the rows left unproven redone in float64 until proven (ties wider than the
    slack, duplicates): the reference's lists, ragged batches and radii included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if distribution == "duplicates":
        query, ref = _tied(generator, device, rows=50, columns=400, dim=dim)
    else:
        query, ref = (t.float().to(device) for t in _clouds(distribution, dim, generator, rows=50, columns=400))
    query, ref = torch.stack([query, query.flip(0)]), torch.stack([ref, ref.flip(0)])
    for lengths, radius in [(None, math.inf), ((torch.tensor([50, 31]), torch.tensor([400, 170])), 1.5)]:
        query_lengths, ref_lengths = (None, None) if lengths is None else (x.to(device) for x in lengths)
        got = dense._in_torch(query, ref, k, radius, query_lengths, ref_lengths)
        want = fullgraph.ops.neighbors.reference.nearest(query, ref, k, radius, query_lengths, ref_lengths)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0].to(got[0].dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("lengths", [False, True])
def test_cpu_lists_of_nearly_every_reference_are_measured_pair_by_pair(dtype, lengths, monkeypatch):
    """k + CANDIDATE_SLACK >= N on CPUs: every pair is measured anyway, so dense answers by the
    "cpu" backend's brute force (products would select nothing): the reference's lists bit for
    bit, with duplicates, a non-finite point, lengths and k beyond N."""
    if not dense.select.available():
        pytest.skip("the C++ extension did not build here")
    taken = []
    original = dense.cpu_backend.brute_force
    monkeypatch.setattr(dense.cpu_backend, "brute_force", lambda *a: taken.append(a[2]) or original(*a))
    generator = torch.Generator().manual_seed(3)
    query = torch.randn(3, 40, 70, generator=generator).to(dtype)
    ref = torch.randn(3, 20, 70, generator=generator).to(dtype)
    ref[:, 3] = ref[:, 2]
    ref[1, 5, 9] = math.nan
    extra = dict(query_lengths=torch.tensor([40, 17, 0]), ref_lengths=torch.tensor([20, 12, 5])) if lengths else {}
    for k in (14, 20, 26):
        got = fullgraph.knn(query, ref, k, backend="dense", **extra)
        want = fullgraph.knn(query, ref, k, backend="torch", **extra)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want))
    assert taken == [14, 20, 26]


@pytest.mark.parametrize("case", ["normal", "far", "ties", "wide ties", "non-finite", "huge", "one tiny item",
                                  "float64", "float16", "bfloat16"])
def test_small_plain_cpu_calls_by_one_uncentred_product(case):
    """dense._plain_on_cpu (small CPU calls on plain points): the reference's lists bit for bit
    where it proves every row; None, so the usual path answers, where it cannot (far from the
    origin: the uncentred bound is too wide; more duplicates at the cut than the slack;
    non-finite or huge points: not plain)."""
    if not dense.select.available():
        pytest.skip("the C++ extension did not build here")
    generator = torch.Generator().manual_seed(5)
    dtype = getattr(torch, case) if case.startswith(("float", "bfloat")) else torch.float32
    query = torch.randn(2, 30, 96, generator=generator).to(dtype)
    ref = torch.randn(2, 200, 96, generator=generator).to(dtype)
    if case == "far":
        query, ref = query + 1e5, ref + 1e5
    elif case in ("ties", "wide ties"):
        ref[:, 20:24 if case == "ties" else 60] = ref[:, :1]
        query[:, :3] = ref[:, :3]
    elif case == "non-finite":
        ref[0, 3, 5] = math.nan
    elif case == "huge":
        query, ref = query * 1e30, ref * 1e30
    elif case == "one tiny item":  # scaled by the reference, alone of the batch
        query[1], ref[1] = query[1] * 1e-12, ref[1] * 1e-12
    found = dense._plain_on_cpu(query, ref, 6, math.inf, None, None)
    want = fullgraph.knn(query, ref, 6, backend="torch")
    if case in ("far", "wide ties", "non-finite", "huge", "one tiny item"):
        assert found is None
    else:
        assert found is not None and torch.equal(found[0], want[0]) and torch.equal(found[1], want[1])
    got = fullgraph.knn(query, ref, 6, backend="dense")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if case == "normal":  # compiled: the lists' layout is the one the operator's fake declares
        compiled = torch.compile(lambda q, r: fullgraph.knn(q, r, 6, backend="dense"), fullgraph=True)
        got = compiled(query, ref)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
