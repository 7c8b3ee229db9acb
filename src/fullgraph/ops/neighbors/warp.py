"""Warp backend: radius search and radius aggregation on NVIDIA Warp's HashGrid.

Float32 points in 3-D on CUDA. Each batch item is one group of a grouped HashGrid (invalid
points get group -1, which no query asks for), so a batch needs no per-item loop and no
host sync. The kernels are fullgraph.extern ops (library="warp"): they run on PyTorch's
current stream and write only into tensors PyTorch allocated (the grid itself is created,
and its memory reserved, outside any capture). The backend is declared not capturable:
on the H100 (torch 2.11, Warp 1.19) a torch.compile(mode="reduce-overhead") step cycling
through three cloud sizes replayed wrong results (98% of outputs off, cause not yet found),
though one graph per call of ``fullgraph.graphs.graphed`` replayed correctly; until that is
understood a capture gets GraphCaptureError instead of a silently wrong graph.

Search keeps, per query, the ``k`` nearest candidates within the radius in its output row,
ordered by (distance, index) by insertion: the nearest, never the first found. The
aggregation writes its weighted sums with per-row accumulation (``+=`` on array rows) and
normalizes in a second kernel; its backward is Warp's adjoint launch of those two kernels
(reference and feature gradients use atomics, so their summation order may vary).
"""

from __future__ import annotations

import functools
import importlib.util
from collections import OrderedDict

import torch

from ... import extern
from ...backends import Backend
from . import pairs

# Cells per axis of the hash table: cells of width ``radius`` hash into 128^3 buckets.
GRID_CELLS = 128
CACHED_GRIDS = 8
_grids: OrderedDict = OrderedDict()  # (device, point count) -> HashGrid, least recently used first
_pinned: dict = {}  # grids some CUDA graph replays builds into: kept for the process


@functools.cache
def _kernels():
    import warp as wp

    @wp.kernel(enable_backward=False)
    def search(query: wp.array(dtype=wp.vec3), query_group: wp.array(dtype=wp.int32),
               ref: wp.array(dtype=wp.vec3), grid: wp.uint64, radius: float, columns: wp.int64,
               dists: wp.array2d(dtype=float), idx: wp.array2d(dtype=wp.int64), counts: wp.array(dtype=wp.int64)):
        q = wp.tid()
        k = dists.shape[1]
        for s in range(k):
            dists[q, s] = wp.inf
            idx[q, s] = wp.int64(-1)
        group = query_group[q]
        count = wp.int64(0)
        found = int(0)
        if group >= 0:
            pos = query[q]
            for j in wp.hash_grid_query(grid, pos, radius, group):
                d = wp.length(pos - ref[j])
                if d <= radius:
                    count += wp.int64(1)
                    local = wp.int64(j) - wp.int64(group) * columns
                    slot = int(k - 1)
                    keep = found < k
                    if keep:
                        slot = found
                        found += 1
                    else:
                        last = dists[q, k - 1]
                        keep = d < last or (d == last and local < idx[q, k - 1])
                    if keep:
                        while slot > 0:
                            before = dists[q, slot - 1]
                            if before < d or (before == d and idx[q, slot - 1] < local):
                                break
                            dists[q, slot] = before
                            idx[q, slot] = idx[q, slot - 1]
                            slot -= 1
                        dists[q, slot] = d
                        idx[q, slot] = local
        counts[q] = count

    @wp.kernel(enable_backward=False)
    def nearest_distance(query: wp.array(dtype=wp.vec3), query_group: wp.array(dtype=wp.int32),
                         ref: wp.array(dtype=wp.vec3), grid: wp.uint64, radius: float,
                         shift: wp.array(dtype=float)):
        q = wp.tid()
        best = float(0.0)
        group = query_group[q]
        if group >= 0:
            pos = query[q]
            best = float(wp.inf)
            for j in wp.hash_grid_query(grid, pos, radius, group):
                d = wp.length(pos - ref[j])
                if d <= radius:
                    best = wp.min(best, d)
        shift[q] = best

    @wp.kernel
    def weighted_sums(query: wp.array(dtype=wp.vec3), query_group: wp.array(dtype=wp.int32),
                      ref: wp.array(dtype=wp.vec3), features: wp.array2d(dtype=float), grid: wp.uint64,
                      radius: float, sigma: float, shift: wp.array(dtype=float),
                      numerator: wp.array2d(dtype=float), denominator: wp.array(dtype=float)):
        q = wp.tid()
        group = query_group[q]
        if group >= 0:
            pos = query[q]
            for j in wp.hash_grid_query(grid, pos, radius, group):
                d = wp.length(pos - ref[j])
                if d <= radius:
                    # exp(-(d - min d) / sigma): the shift cancels in the ratio and keeps it from underflowing
                    w = wp.exp((shift[q] - d) / sigma)
                    denominator[q] += w
                    for c in range(features.shape[1]):
                        numerator[q, c] += w * features[j, c]

    @wp.kernel
    def normalize(numerator: wp.array2d(dtype=float), denominator: wp.array(dtype=float),
                  out: wp.array2d(dtype=float)):
        q, c = wp.tid()
        total = denominator[q]
        value = float(0.0)
        if total > 0.0:
            value = numerator[q, c] / total
        out[q, c] = value

    return search, nearest_distance, weighted_sums, normalize


def _vec3(wp, array):
    """A [P, 3] float32 Warp array seen as [P] vec3, no copy."""
    return wp.array(ptr=array.ptr, shape=(array.shape[0],), dtype=wp.vec3, device=array.device)


def _grid(wp, ref, ref_group, radius: float):
    """A HashGrid over ``ref`` grouped by ``ref_group`` with cells of width ``radius``.

    Grids are kept per (device, point count), so a rebuild never reallocates: a CUDA graph
    that captured a build keeps valid pointers, and its grid is pinned (never evicted).
    Creating a grid allocates synchronously, so it must happen outside a capture."""
    key = (torch.cuda.current_device(), ref.shape[0])
    capturing = torch.cuda.is_current_stream_capturing()
    grid = _pinned.get(key) or _grids.get(key)
    if grid is None:
        if capturing:
            raise extern.ExternError(
                f"backend='warp': no HashGrid for {ref.shape[0]} points exists to capture; call the op once outside "
                "the CUDA graph capture first (fullgraph.graphs.graphed and torch.compile's CUDA graphs warm up "
                "before capturing)")
        grid = _grids[key] = wp.HashGrid(GRID_CELLS, GRID_CELLS, GRID_CELLS, device=ref.device)
        grid.reserve(ref.shape[0], with_groups=True)
        while len(_grids) > CACHED_GRIDS:
            _grids.popitem(last=False)
    elif key in _grids:
        _grids.move_to_end(key)
    if capturing and key not in _pinned:
        _pinned[key] = _grids.pop(key)
    grid.build(ref, radius if radius > 0 else 1.0, groups=ref_group)
    grid.groups = None  # the build consumed the ids; their memory goes back to PyTorch
    return grid


def _search_shapes(rows, k):
    """dists [rows, k] float32, idx [rows, k] int64, counts [rows] int64."""
    return [((rows, k), torch.float32), ((rows, k), torch.int64), ((rows,), torch.int64)]


def _new(wp, like, shape, dtype=torch.float32):
    """A zeroed PyTorch tensor on ``like``'s device and its Warp view: PyTorch allocates
    everything the kernels write, so the launches stay capturable in CUDA graphs."""
    tensor = torch.zeros(shape, dtype=dtype, device=wp.device_to_torch(like.device))
    return tensor, wp.from_torch(tensor)


@extern.op("fullgraph::warp_radius_search",
           "(Tensor query, Tensor query_group, Tensor ref, Tensor ref_group, float radius, int k, int columns)"
           " -> (Tensor, Tensor, Tensor)",
           outputs=lambda query, qg, ref, rg, radius, k, columns: _search_shapes(query.shape[0], k), library="warp")
def _search(query, query_group, ref, ref_group, radius, k, columns):
    import warp as wp

    search = _kernels()[0]
    query, ref = _vec3(wp, query), _vec3(wp, ref)
    grid = _grid(wp, ref, ref_group, radius)
    outputs = [_new(wp, query, shape, dtype) for shape, dtype in _search_shapes(query.shape[0], k)]
    wp.launch(search, dim=query.shape[0], inputs=[query, query_group, ref, grid.id, radius, columns],
              outputs=[array for _, array in outputs])
    return tuple(tensor for tensor, _ in outputs)


def _forward_arrays(wp, query, query_group, ref, ref_group, features, radius, sigma):
    """Launch the aggregation's forward kernels; return (inputs, outputs) of ``weighted_sums``."""
    _, nearest_distance, weighted_sums, _ = _kernels()
    rows, channels = query.shape[0], features.shape[1]
    grid = _grid(wp, ref, ref_group, radius)
    _, shift = _new(wp, query, rows)
    wp.launch(nearest_distance, dim=rows, inputs=[query, query_group, ref, grid.id, radius], outputs=[shift])
    (_, numerator), (_, denominator) = _new(wp, query, (rows, channels)), _new(wp, query, rows)
    inputs = [query, query_group, ref, features, grid.id, radius, sigma, shift]
    wp.launch(weighted_sums, dim=rows, inputs=inputs, outputs=[numerator, denominator])
    return inputs, [numerator, denominator]


@extern.op("fullgraph::warp_radius_aggregate",
           "(Tensor query, Tensor query_group, Tensor ref, Tensor ref_group, Tensor features, float radius, "
           "float sigma) -> Tensor",
           outputs=lambda query, qg, ref, rg, features, radius, sigma: [
               ((query.shape[0], features.shape[1]), torch.float32)],
           library="warp")
def _aggregate(query, query_group, ref, ref_group, features, radius, sigma):
    import warp as wp

    normalize = _kernels()[3]
    query, ref = _vec3(wp, query), _vec3(wp, ref)
    _, (numerator, denominator) = _forward_arrays(wp, query, query_group, ref, ref_group, features, radius, sigma)
    out, out_array = _new(wp, query, numerator.shape)
    if out.numel():
        wp.launch(normalize, dim=numerator.shape, inputs=[numerator, denominator], outputs=[out_array])
    return out


@extern.op("fullgraph::warp_radius_aggregate_backward",
           "(Tensor grad_out, Tensor query, Tensor query_group, Tensor ref, Tensor ref_group, Tensor features, "
           "float radius, float sigma) -> (Tensor, Tensor, Tensor)",
           outputs=lambda grad_out, query, qg, ref, rg, features, radius, sigma: [
               (query.shape, torch.float32), (ref.shape, torch.float32), (features.shape, torch.float32)],
           library="warp")
def _aggregate_backward(grad_out, query, query_group, ref, ref_group, features, radius, sigma):
    """Warp's adjoint launches of ``normalize`` and ``weighted_sums``, in reverse order."""
    import warp as wp

    _, _, weighted_sums, normalize = _kernels()
    grads = [_new(wp, query, a.shape) for a in (query, ref, features)]
    query, ref = _vec3(wp, query), _vec3(wp, ref)
    inputs, (numerator, denominator) = _forward_arrays(wp, query, query_group, ref, ref_group, features, radius, sigma)
    (_, numerator_grad), (_, denominator_grad) = _new(wp, query, numerator.shape), _new(wp, query, denominator.shape)
    if numerator.size:
        _, out = _new(wp, query, numerator.shape)
        wp.launch(normalize, dim=numerator.shape, inputs=[numerator, denominator], outputs=[out],
                  adj_inputs=[numerator_grad, denominator_grad], adj_outputs=[grad_out], adjoint=True)
    adj_inputs = [_vec3(wp, grads[0][1]), None, _vec3(wp, grads[1][1]), grads[2][1], None, None, None, None]
    wp.launch(weighted_sums, dim=query.shape[0], inputs=inputs, outputs=[numerator, denominator],
              adj_inputs=adj_inputs, adj_outputs=[numerator_grad, denominator_grad], adjoint=True)
    return tuple(tensor for tensor, _ in grads)


# ----------------------------------------------------------------- backend contract


def _flat(query, ref, query_lengths, ref_lengths):
    """[B*M, 3] queries and [B*N, 3] references with int32 group ids (batch item, -1 invalid)."""
    groups = []
    for points, lengths in ((query, query_lengths), (ref, ref_lengths)):
        valid = pairs.valid_points(points, lengths)
        item = torch.arange(points.shape[0], dtype=torch.int32, device=points.device)[:, None]
        groups.append(torch.where(valid, item, -1).reshape(-1))
    # Non-finite coordinates are never looked up (group -1), but must hash harmlessly.
    flat = [torch.nan_to_num(p.reshape(-1, 3), nan=0.0, posinf=0.0, neginf=0.0) for p in (query, ref)]
    return flat[0], groups[0], flat[1], groups[1]


def nearest(query, ref, k, radius, query_lengths, ref_lengths):
    """``pairs.Kernels.nearest`` for a finite radius."""
    batch, rows, _ = query.shape
    if query.numel() == 0 or ref.numel() == 0:
        return pairs.no_neighbors(query, k)
    flat_query, query_group, flat_ref, ref_group = _flat(query, ref, query_lengths, ref_lengths)
    dists, idx, counts = _search(flat_query, query_group, flat_ref, ref_group, radius, k, ref.shape[1])
    return dists.reshape(batch, rows, k).to(query.dtype), idx.reshape(batch, rows, k), counts.reshape(batch, rows)


def radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths):
    batch, rows, _ = query.shape
    channels = features.shape[-1]
    if query.numel() == 0 or ref.numel() == 0 or channels == 0:
        return features.new_zeros((batch, rows, channels)), None, None
    flat_query, query_group, flat_ref, ref_group = _flat(query, ref, query_lengths, ref_lengths)
    out = _aggregate(flat_query, query_group, flat_ref, ref_group, features.reshape(-1, channels), radius, sigma)
    return out.reshape(batch, rows, channels), None, None


def radius_aggregate_backward(grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths,
                              query_grad=True, ref_grad=True, stats=None, saved_grid=None):
    """``pairs.Kernels.radius_aggregate_backward``: Warp's kernel computes all three gradients."""
    if query.numel() == 0 or ref.numel() == 0 or features.shape[-1] == 0:
        return torch.zeros_like(query), torch.zeros_like(ref), torch.zeros_like(features)
    flat_query, query_group, flat_ref, ref_group = _flat(query, ref, query_lengths, ref_lengths)
    grads = _aggregate_backward(grad_out.reshape(-1, features.shape[-1]).contiguous(), flat_query, query_group,
                                flat_ref, ref_group, features.reshape(-1, features.shape[-1]), radius, sigma)
    return tuple(g.reshape(t.shape) for g, t in zip(grads, (query, ref, features)))


class HashGridKernels(pairs.Kernels):
    nearest = staticmethod(nearest)
    radius_aggregate = staticmethod(radius_aggregate)
    radius_aggregate_backward = staticmethod(radius_aggregate_backward)


_HAVE_WARP = importlib.util.find_spec("warp") is not None
BACKEND = Backend(
    "warp", ops=("radius", "radius_aggregate"), devices=("cuda",), dtypes=(torch.float32,), dims=(3,),
    install='warp: pip install "fullgraph[warp]" (NVIDIA Warp)', available=lambda device: _HAVE_WARP,
    implementation=HashGridKernels(), note='computes in float32 (convert, or use "triton")', capturable=False,
)
