"""The grid the Triton kernels walk: budget, keys, sorting, buckets and cell sizing."""

from __future__ import annotations

import pytest
import torch
from conftest import DISTRIBUTIONS, HAVE_TRITON, points

pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _clouds(distribution: str, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ref = torch.stack([points(distribution, 300, dim, generator) for _ in range(2)])
    query = torch.stack([points(distribution, 50, dim, generator) for _ in range(2)])
    ref[1, 7] = float("nan")  # an invalid reference inside the valid prefix
    lengths = torch.tensor([300, 250])
    return query.to(DEVICE), ref.to(DEVICE), torch.tensor([50, 40]).to(DEVICE), lengths.to(DEVICE)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("dim", [1, 2, 3, 5])
def test_sorted_clouds_are_permutations_with_cell_ranges(distribution, dim):
    from fullgraph.ops.neighbors.triton import grid

    query, ref, query_lengths, ref_lengths = _clouds(distribution, dim)
    frame, queries, refs = grid.build(query, ref, query_lengths, ref_lengths)
    _check_sorted(grid, frame, queries, refs, query, ref, query_lengths, ref_lengths)


def _check_sorted(grid, frame, queries, refs, query, ref, query_lengths, ref_lengths):
    """Both sorted clouds are permutations in (item, cell) order, stable within a cell, with
    bucket starts and offsets within buckets that give back each point's cell."""
    dim = query.shape[-1]
    slots = frame.buckets + 1
    cells = frame.shape[:, :3].prod(1).cpu()
    shift = frame.values[:, grid.SHIFT_COLUMN].long().cpu()
    assert cells.le(frame.space).all(), "cells beyond the static bound"
    assert cells.le(frame.buckets * 2**shift).all() and shift.le(6).all(), "cells beyond the buckets"
    assert (shift == 0).logical_or(cells > frame.buckets * 2 ** (shift - 1)).all(), "a shift larger than needed"
    for sorted_points, cloud, lengths in ((queries, query, query_lengths), (refs, ref, ref_lengths)):
        batch, size = cloud.shape[:2]
        assert torch.equal(sorted_points.order.sort().values.cpu(), torch.arange(batch * size))
        moved = cloud.reshape(-1, dim)[sorted_points.order].float()
        torch.testing.assert_close(sorted_points.points.cpu() * frame.values[:, grid.SCALE_COLUMN].cpu().repeat_interleave(size)[:, None],
                                   moved.cpu(), rtol=0, atol=0, equal_nan=True)
        starts = sorted_points.bucket_start.long().cpu()
        assert (starts[1:] >= starts[:-1]).all() and starts[-1] == batch * size
        # Each item's live points (valid prefix, finite) come first in its block.
        live = (torch.arange(size)[None] < lengths.cpu()[:, None]) & torch.isfinite(cloud.cpu()).all(-1)
        for b in range(batch):
            assert starts[b * slots] == b * size
            assert starts[b * slots + frame.buckets] - b * size == live[b].sum()
        # Each point's cell, from its bucket and offset, is the cell of its coordinates.
        slot = torch.repeat_interleave(torch.arange(len(starts) - 1), starts[1:] - starts[:-1])
        item, bucket = slot // slots, slot % slots
        within = sorted_points.within.long().cpu()
        assert within.ge(0).all() and within.lt(2 ** shift[item]).all()
        cell = torch.where(bucket == frame.buckets, frame.space, (bucket << shift[item]) + within)
        unscaled = grid.Frame(frame.values.clone(), frame.shape, frame.buckets, frame.space, frame.grid_dims)
        unscaled.values[:, :9] *= frame.values[:, grid.SCALE_COLUMN:grid.SCALE_COLUMN + 1]
        unscaled.values[:, 7] /= frame.values[:, grid.SCALE_COLUMN] ** 2  # the inverse side: times scale
        keys = grid.cell_keys(cloud.contiguous(), lengths, unscaled).long().cpu()[sorted_points.order.cpu()]
        assert torch.equal(keys - item * (frame.space + 1), cell)
        # Within a cell, a cloud's points keep their order (one stable sort of both clouds).
        order = sorted_points.order.cpu()
        same_cell = (cell[1:] == cell[:-1]) & (item[1:] == item[:-1])
        assert (order[1:][same_cell] > order[:-1][same_cell]).all()


@pytest.fixture(params=["search", "histogram"])
def bounds_method(request, monkeypatch):
    """grid.lower_bounds' two ways, each forced."""
    from fullgraph.ops.neighbors.triton import grid

    monkeypatch.setattr(grid, "HISTOGRAM_FROM", 1 << 62 if request.param == "search" else 0)


@pytest.mark.parametrize("split", [None, 0, 1, 7, 40])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_lower_bounds_equal_searchsorted(split, dtype, bounds_method):
    """grid.lower_bounds: per part, torch.searchsorted of arange(count), with duplicate
    values, gaps, values past count and empty parts."""
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(3)
    values = torch.randint(0, 30, (40,), generator=generator, dtype=dtype)
    values[5:9] = 29  # a run of equal values
    parts = [values.sort().values] if split is None else [values[:split].sort().values, values[split:].sort().values]
    count = 34  # past the largest value: every bound there is the part's length
    bounds = grid.lower_bounds(torch.cat(parts).to(DEVICE), count, split).cpu()
    assert bounds.shape == (len(parts), count)
    for part, bound in zip(parts, bounds):
        assert torch.equal(bound.long(), torch.searchsorted(part, torch.arange(count, dtype=dtype)))
    assert grid.lower_bounds(values[:0].to(DEVICE), 5).cpu().eq(0).all()


@pytest.mark.parametrize("split", [None, 1500, 2100])
def test_lower_bounds_across_programs(split, bounds_method):
    """grid.lower_bounds over many programs' blocks (of bounds searched, or of values whose
    runs are summed a block at a time): runs longer than a block, across blocks and the
    split, long gaps, a clustered part, values past count."""
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(4)
    count = 5 * max(grid.HISTOGRAM_BLOCK, grid.LOWER_BOUNDS_BLOCK[0]) + 3
    values = torch.cat([torch.randint(0, count // 2, (1000,), generator=generator),
                        torch.full((2500,), 300), torch.randint(count // 2, count + 50, (300,), generator=generator)])
    values = values[torch.randperm(len(values), generator=generator)]
    parts = [values.sort().values] if split is None else [values[:split].sort().values, values[split:].sort().values]
    bounds = grid.lower_bounds(torch.cat(parts).to(DEVICE), count, split).cpu()
    for part, bound in zip(parts, bounds):
        assert torch.equal(bound.long(), torch.searchsorted(part, torch.arange(count)))


@pytest.mark.parametrize("dim", [3, 5])
def test_a_saved_grid_restores_to_the_built_one(dim):
    """grid.save's int32 record gives back the frame and both sorted clouds, bit for bit."""
    from fullgraph.ops.neighbors.triton import grid

    query, ref, query_lengths, ref_lengths = _clouds("clustered", dim)
    built = grid.build(query, ref, query_lengths, ref_lengths)
    record = grid.save(*built)
    assert record.dtype == torch.int32 and record.numel() == grid.saved_size(2, 50, 300, dim)
    frame, queries, refs = grid.restore(record, query, ref)
    assert torch.equal(frame.values, built[0].values) and torch.equal(frame.shape, built[0].shape)
    assert (frame.buckets, frame.space, frame.grid_dims) == (built[0].buckets, built[0].space, built[0].grid_dims)
    for got, want in ((queries, built[1]), (refs, built[2])):
        assert torch.equal(got.order, want.order) and torch.equal(got.bucket_start, want.bucket_start)
        assert torch.equal(got.within, want.within)
        torch.testing.assert_close(got.points, want.points, rtol=0, atol=0, equal_nan=True)


def test_cells_follow_the_density_the_queries_see():
    """A normal cloud queried in its core gets cells that hold about CELL_POINTS references
    there, not the box average (which would put hundreds in each core cell)."""
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(1)
    ref = torch.randn(1, 20_000, 3, generator=generator).to(DEVICE)
    query = (torch.rand(1, 2_000, 3, generator=generator) * 2 - 1).to(DEVICE)
    frame, queries, refs = grid.build(query, ref, torch.tensor([2_000], device=DEVICE),
                                      torch.tensor([20_000], device=DEVICE))
    ref_cells, per_cell = grid.cell_keys(ref, torch.tensor([20_000], device=DEVICE), frame).unique(return_counts=True)
    keys = grid.cell_keys(query, torch.tensor([2_000], device=DEVICE), frame)
    at = torch.searchsorted(ref_cells, keys).clamp(max=len(ref_cells) - 1)
    load = torch.where(ref_cells[at] == keys, per_cell[at], 0).float().mean().item()
    assert grid.CELL_POINTS / 3 <= load <= grid.CELL_POINTS * 3, load


@pytest.mark.parametrize("side, expected", [(0.04, 0.04), (0.1, (8 / 20_000) ** (1 / 3)),
                                            (0.005, (1 / 20_000) ** (1 / 3))])
@pytest.mark.interpreted(keep=1)
def test_cells_of_a_side_hold_between_one_and_cell_points_references(side, expected):
    """``side``: cells of that side (the radius aggregation's, from its radius) where a query's
    cell then holds 1 to ``cell_points`` references; else the side that holds the nearer bound."""
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(2)
    ref = torch.rand(1, 20_000, 3, generator=generator).to(DEVICE)
    query = torch.rand(1, 3_000, 3, generator=generator).to(DEVICE)
    lengths = (torch.tensor([3_000], device=DEVICE), torch.tensor([20_000], device=DEVICE))
    frame, _, _ = grid.build(query, ref, *lengths, cell_points=8.0, side=side)
    got = frame.values[0, 6].item() * frame.values[0, grid.SCALE_COLUMN].item()  # column 6: the cell side
    assert expected / 1.25 <= got <= expected * 1.25, (got, expected)


@pytest.mark.parametrize("k", [1, 7])
def test_search_is_exact_where_query_blocks_straddle_empty_space(k):
    """Queries scattered far around a dense core: blocks of sorted queries span distant
    cells (searched one by one) and need many rings; the results stay exact."""
    import fullgraph

    generator = torch.Generator().manual_seed(2)
    ref = torch.randn(600, 3, generator=generator).to(DEVICE)
    query = (torch.randn(64, 3, generator=generator) * 4).to(DEVICE)
    dists, idx = fullgraph.knn(query, ref, k, backend="triton")
    want_dists, want_idx = fullgraph.knn(query, ref, k, backend="torch")
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(dists, want_dists)
    dists, idx, counts = fullgraph.radius(query, ref, 1.5, max_neighbors=k, backend="triton")
    want = fullgraph.radius(query, ref, 1.5, max_neighbors=k, backend="torch")
    assert torch.equal(idx, want[1]) and torch.equal(counts, want[2])


def _tight_clusters(generator, *counts, spread=1e-3):
    """Clouds [2, count, 3] float32 around the same centres: per item, 90 % of the points in
    three balls of radius ~spread, the rest uniform over a unit box (clusters ~10^8 times
    denser than the box)."""
    centres = torch.rand(2, 3, 3, generator=generator, dtype=torch.float64)
    clouds = []
    for count in counts:
        which = torch.randint(0, 3, (2, count), generator=generator)
        clustered = centres.gather(1, which[..., None].expand(-1, -1, 3))
        clustered = clustered + spread * torch.randn(2, count, 3, generator=generator, dtype=torch.float64)
        uniform = torch.rand(2, count, 3, generator=generator, dtype=torch.float64)
        clouds.append(torch.where(torch.rand(2, count, 1, generator=generator) < 0.9, clustered, uniform).float())
    return clouds


def test_clustered_clouds_get_cells_finer_than_their_buckets():
    """Tight clusters: the cells follow the clusters' density (2^shift cells a bucket, found by
    a binary search within it) and the sorted clouds, buckets and offsets stay consistent."""
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(4)
    ref, query = (cloud.to(DEVICE) for cloud in _tight_clusters(generator, 1_500, 200))
    lengths = (torch.tensor([200, 170], device=DEVICE), torch.tensor([1_500, 1_411], device=DEVICE))
    frame, queries, refs = grid.build(query, ref, *lengths)
    assert frame.values[:, grid.SHIFT_COLUMN].gt(0).all(), frame.values[:, grid.SHIFT_COLUMN]
    _check_sorted(grid, frame, queries, refs, query, ref, *lengths)
    record = grid.save(frame, queries, refs)
    _, got_queries, got_refs = grid.restore(record, query, ref)
    assert torch.equal(got_refs.within, refs.within) and torch.equal(got_queries.within, queries.within)


@pytest.mark.interpreted(keep=0)
def test_search_and_aggregation_are_exact_on_sparse_cells():
    """Through buckets of many cells: kNN, radius search and radius_aggregate (forward and
    gradients) equal the torch reference on tightly clustered clouds."""
    import fullgraph
    from fullgraph.ops.neighbors.triton import grid

    generator = torch.Generator().manual_seed(5)
    ref, query = _tight_clusters(generator, 1_200, 16)  # (few queries: Triton's interpreter is slow here)
    ref, query = ref.to(DEVICE), torch.cat([query, torch.rand(2, 2, 3, generator=generator) * 3 - 1], 1).to(DEVICE)
    full = (torch.tensor([18, 18], device=DEVICE), torch.tensor([1_200, 1_200], device=DEVICE))
    assert grid.build(query, ref, *full)[0].values[:, grid.SHIFT_COLUMN].gt(0).all(), "not the sparse path"
    dists, idx = fullgraph.knn(query, ref, 5, backend="triton")
    want_dists, want_idx = fullgraph.knn(query, ref, 5, backend="torch")
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(dists, want_dists)
    got = fullgraph.radius(query, ref, 2e-3, max_neighbors=6, backend="triton")
    want = fullgraph.radius(query, ref, 2e-3, max_neighbors=6, backend="torch")
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    features = torch.randn(2, 1_200, 4, generator=generator).to(DEVICE)
    outputs = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in (query, ref, features)]
        out = fullgraph.radius_aggregate(*leaves, radius=2e-3, sigma=1e-3, backend=backend)
        out.square().sum().backward()
        outputs[backend] = [out.detach()] + [leaf.grad for leaf in leaves]
    for got, want in zip(outputs["triton"], outputs["torch"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cell_space_keeps_32_bit_keys_only_with_room_to_refine():
    """Cells may be FINER times the buckets; fewer (down to FINER_LEAST) where that keeps the
    sort's keys 32 bits; where even FINER_LEAST would not fit, the keys are 64-bit and the
    cells FINER times the buckets again (a 2 x 10^8-point cloud kept at one cell a bucket to
    save a sort pass searched its clusters 2x slower)."""
    from fullgraph.ops.neighbors.triton import grid

    for points, batch in ((1_000, 1), (10**6, 1), (10**7, 1), (3 * 10**7, 1), (4 * 10**7, 1), (2 * 10**8, 1),
                          (10**6, 64)):
        buckets = grid.cell_budget(points, 3)
        finer = grid.cell_space(batch, buckets) // buckets
        assert finer in (8, 16, 32, 64) and finer >= grid.FINER_LEAST
        if grid._keys_fit_32_bits(batch, buckets * grid.FINER_LEAST):
            assert grid._keys_fit_32_bits(batch, buckets * finer)
            assert finer == grid.FINER or not grid._keys_fit_32_bits(batch, buckets * finer * 2)
        else:
            assert finer == grid.FINER
    assert grid.cell_space(1, grid.cell_budget(2 * 10**8, 3)) == grid.FINER * grid.cell_budget(2 * 10**8, 3)
