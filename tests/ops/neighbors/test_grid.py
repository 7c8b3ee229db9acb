"""The uniform grid the Triton kernels walk: budget, keys, sorting and cell sizing."""

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
    from fullgraph.ops.neighbors import grid

    query, ref, query_lengths, ref_lengths = _clouds(distribution, dim)
    frame, queries, refs = grid.build(query, ref, query_lengths, ref_lengths)
    slots = frame.cells + 1
    assert frame.shape[:, :3].prod(1).le(frame.cells).all(), "cells beyond the static budget"
    for sorted_points, cloud, lengths in ((queries, query, query_lengths), (refs, ref, ref_lengths)):
        batch, size = cloud.shape[:2]
        assert torch.equal(sorted_points.order.sort().values.cpu(), torch.arange(batch * size))
        moved = cloud.reshape(-1, dim)[sorted_points.order].float()
        torch.testing.assert_close(sorted_points.points.cpu(), moved.cpu(), rtol=0, atol=0, equal_nan=True)
        starts = sorted_points.cell_start.long().cpu()
        assert (starts[1:] >= starts[:-1]).all() and starts[-1] == batch * size
        # Each item's live points (valid prefix, finite) come first in its block.
        live = (torch.arange(size)[None] < lengths.cpu()[:, None]) & torch.isfinite(cloud.cpu()).all(-1)
        for b in range(batch):
            assert starts[b * slots] == b * size
            assert starts[b * slots + frame.cells] - b * size == live[b].sum()
        # Within a cell, a cloud's points keep their order (one stable sort of both clouds).
        order = sorted_points.order.cpu()
        cell_of = torch.repeat_interleave(torch.arange(len(starts) - 1), starts[1:] - starts[:-1])
        same_cell = cell_of[1:] == cell_of[:-1]
        assert (order[1:][same_cell] > order[:-1][same_cell]).all()


@pytest.mark.parametrize("split", [None, 0, 7, 40])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_lower_bounds_equal_searchsorted(split, dtype):
    """grid.lower_bounds: per part, torch.searchsorted of arange(count), with duplicate
    values, gaps, values past count and empty parts."""
    from fullgraph.ops.neighbors import grid

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


@pytest.mark.parametrize("dim", [3, 5])
def test_a_saved_grid_restores_to_the_built_one(dim):
    """grid.save's int32 record gives back the frame and both sorted clouds, bit for bit."""
    from fullgraph.ops.neighbors import grid

    query, ref, query_lengths, ref_lengths = _clouds("clustered", dim)
    built = grid.build(query, ref, query_lengths, ref_lengths)
    record = grid.save(*built)
    assert record.dtype == torch.int32 and record.numel() == grid.saved_size(2, 50, 300, dim)
    frame, queries, refs = grid.restore(record, query, ref)
    assert torch.equal(frame.values, built[0].values) and torch.equal(frame.shape, built[0].shape)
    assert (frame.cells, frame.grid_dims) == (built[0].cells, built[0].grid_dims)
    for got, want in ((queries, built[1]), (refs, built[2])):
        assert torch.equal(got.order, want.order) and torch.equal(got.cell_start, want.cell_start)
        torch.testing.assert_close(got.points, want.points, rtol=0, atol=0, equal_nan=True)


def test_cells_follow_the_density_the_queries_see():
    """A normal cloud queried in its core gets cells that hold about CELL_POINTS references
    there, not the box average (which would put hundreds in each core cell)."""
    from fullgraph.ops.neighbors import grid

    generator = torch.Generator().manual_seed(1)
    ref = torch.randn(1, 20_000, 3, generator=generator).to(DEVICE)
    query = (torch.rand(1, 2_000, 3, generator=generator) * 2 - 1).to(DEVICE)
    frame, queries, refs = grid.build(query, ref, torch.tensor([2_000], device=DEVICE),
                                      torch.tensor([20_000], device=DEVICE))
    per_cell = (refs.cell_start[1:] - refs.cell_start[:-1]).long()
    keys = grid.cell_keys(query, torch.tensor([2_000], device=DEVICE), frame).long()
    load = per_cell[keys].float().mean().item()
    assert grid.CELL_POINTS / 3 <= load <= grid.CELL_POINTS * 3, load


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
