"""The neighbour operators under ``torch.ops.fullgraph``: schemas, contract checks, fakes, autograd.

Each op takes a backend name ("auto" or one of ``BACKENDS``), checks its inputs (batched
[B, M, D] layout; the same checks whether called through ``fullgraph.knn`` or directly),
resolves the backend and calls its ``pairs.Kernels`` interface. Backward functions are
operators too, so they compile.

The backends, most preferred first for "auto"; a new backend is one folder (or module) declaring its
``Backend`` and one entry here.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ... import _validate, backends
from . import cpu, cuml, dense, pairs, reference, triton, warp
from .cpu import threads

BACKENDS = backends.family(
    "neighbors",
    dense.BACKEND,  # first where its measured crossovers say (feature space), else the grid
    triton.BACKEND,
    cpu.BACKEND,
    reference.BACKEND,
    warp.BACKEND,
    cuml.BACKEND,
)

Tensor = torch.Tensor
OptionalTensor = torch.Tensor | None


@contextlib.contextmanager
def trying(*extra: backends.Backend):
    """Within the block, the family holds ``extra`` after its own backends: a backend under
    development runs through the operators (``backend=its name``, or "auto" where it fits
    and no listed backend does) before its line is added above."""
    global BACKENDS
    listed = BACKENDS
    BACKENDS = backends.family(listed.name, *listed.backends, *extra)
    try:
        yield BACKENDS
    finally:
        BACKENDS = listed


# ------------------------------------------------------------------- contract checks


def check_clouds(query: Tensor, ref: Tensor, query_lengths, ref_lengths, batched_only: bool = True) -> None:
    """query [B, M, D] (or [M, D] unless ``batched_only``), ref like it, floating, one dtype
    and device; lengths [B] int64 with values in [0, M] / [0, N], batched inputs only."""
    _validate.floating("query", query)
    _validate.floating("ref", ref)
    _validate.rank("query", query, (3,) if batched_only else (2, 3), "[B, M, D]" if batched_only else
                   "[M, D] or [B, M, D]")
    _validate.rank("ref", ref, (query.dim(),), f"{'[B, N, D]' if query.dim() == 3 else '[N, D]'} like query")
    _validate.same_dtype_and_device("ref", ref, "query", query)
    if query.shape[-1] < 1:
        raise ValueError(f"query: expected at least one coordinate (D >= 1), got shape {tuple(query.shape)}")
    if ref.shape[-1] != query.shape[-1]:
        raise ValueError(f"ref: expected D = {query.shape[-1]} coordinates like query, got shape {tuple(ref.shape)}")
    for name, lengths, points in (("query_lengths", query_lengths, query), ("ref_lengths", ref_lengths, ref)):
        if lengths is None:
            continue
        if points.dim() == 2:
            raise ValueError(f"{name}: only for batched inputs [B, M, D], got query of shape {tuple(query.shape)}")
        _validate.lengths(name, lengths, query.shape[0], points.shape[1], query.device)
    if query.dim() == 3 and ref.shape[0] != query.shape[0]:
        raise ValueError(f"ref: expected batch size {query.shape[0]} like query, got shape {tuple(ref.shape)}")


def check_features(features: Tensor, ref: Tensor) -> None:
    """features [B, N, C] (or [N, C] for ref [N, D]): one row per reference point, the
    dtype and device of ref."""
    _validate.floating("features", features)
    _validate.rank("features", features, (ref.dim(),), "[N, C]" if ref.dim() == 2 else "[B, N, C]")
    _validate.same_dtype_and_device("features", features, "ref", ref)
    if features.shape[:-1] != ref.shape[:-1]:
        raise ValueError(f"features: expected one row per reference point, {tuple(ref.shape[:-1])}, "
                         f"got shape {tuple(features.shape)}")


def check_sigma(sigma, dtype: torch.dtype) -> float:
    """A finite sigma > 0 that the aggregation's arithmetic (float32, float64 for float64
    inputs) can divide by: at least that dtype's smallest normal number."""
    sigma = _validate.real("sigma", sigma, minimum=0.0, strict=True)
    tiny = torch.finfo(pairs.accumulation_dtype(dtype)).tiny
    if sigma < tiny:
        raise ValueError(f"sigma: expected >= {tiny:.3g} (the smallest normal "
                         f"{str(pairs.accumulation_dtype(dtype)).removeprefix('torch.')}, the precision the "
                         f"aggregation computes in for {dtype} inputs), got {sigma!r}")
    return sigma


def check_scalar_tensor(name: str, value: Tensor) -> None:
    """A radius or sigma given as a tensor: 0-d and floating (its value is checked when the
    operator reads it)."""
    if value.dim() != 0:
        raise ValueError(f"{name}: expected a number or a 0-d tensor, got a tensor of shape {list(value.shape)}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point 0-d tensor, got {value.dtype}")


def scalar(name: str, number: float, tensor: OptionalTensor) -> float:
    """The radius or sigma an operator uses: ``number``, or the value of ``tensor`` where one
    was passed, read here, when the operator runs (one host read; a CUDA tensor waits for
    the GPU). Passed as a tensor, new values reach a compiled graph without recompiling."""
    if tensor is None:
        return number
    check_scalar_tensor(name, tensor)
    return float(tensor)


# Lists longer than N hold padding (-1 / +inf); this much padding is allowed beyond N, so
# that k = 10**9 is an error naming k instead of a [M, 10**9] allocation whatever N is.
MAX_PADDED_K = 1024


def check_list_width(name: str, k: int, columns: int) -> None:
    """k (or max_neighbors) of lists over N = ``columns`` references: at most max(N, MAX_PADDED_K)."""
    limit = max(columns, MAX_PADDED_K)
    if k > limit:
        raise ValueError(f"{name}: expected at most max(N, {MAX_PADDED_K}) = {limit} neighbours per query "
                         f"(N = {columns} references exist; slots beyond N are padding), got {k}")


def pairs_per_item(query: Tensor, ref: Tensor) -> int:
    """Query-reference pairs of one batch item of query [B, M, D] and ref [B, N, D]: the
    size by which "auto" chooses between backends (``backends.Backend.auto_when``)."""
    return query.shape[1] * ref.shape[1]


def kernels(backend: str, op: str, like: Tensor, dim, k: int = 1, size=None):
    """The ``pairs.Kernels`` of the backend resolved for ``op`` on tensors like ``like``
    with D = dim (None: not known to this op), lists of k, ``size`` pairs per item (None:
    not known)."""
    chosen = BACKENDS.resolve(backend, op, like.device, like.dtype, dim, k,
                              k_argument="max_neighbors" if op == "radius" else "k", size=size)
    chosen.check_capture(like.device, op, like.dtype, dim, k)
    return chosen.implementation


def _check_search(query, ref, k, query_lengths, ref_lengths, backend, op, radius=math.inf):
    check_clouds(query, ref, query_lengths, ref_lengths)
    name = "max_neighbors" if op == "radius" else "k"
    _validate.integer(name, k, minimum=1)
    check_list_width(name, k, ref.shape[1])
    if op == "radius":
        _validate.real("radius", radius, minimum=0.0, strict=False)


def _check_aggregate(query, ref, features, sigma, query_lengths, ref_lengths, backend):
    check_clouds(query, ref, query_lengths, ref_lengths)
    check_features(features, ref)
    check_sigma(sigma, query.dtype)


def _check_lists(idx: Tensor, dists: Tensor, query: Tensor | None, columns: int) -> None:
    """Neighbour lists idx [B, M, k] int64 and dists like them (floating), of ``query``."""
    _validate.tensor("idx", idx)
    _validate.floating("dists", dists)
    if idx.dtype != torch.int64 or idx.dim() != 3:
        raise TypeError(f"idx: expected [B, M, k] int64 neighbour lists, got {idx.dtype} of shape {tuple(idx.shape)}")
    if dists.shape != idx.shape or dists.device != idx.device:
        raise ValueError(f"dists: expected the shape and device of idx {tuple(idx.shape)} on {idx.device}, "
                         f"got {tuple(dists.shape)} on {dists.device}")
    if query is not None and tuple(idx.shape[:2]) != tuple(query.shape[:2]):
        raise ValueError(f"idx: expected lists for the queries {tuple(query.shape[:2])}, got {tuple(idx.shape)}")
    if idx.numel() and idx.device.type == "cpu" and int(idx.max()) >= columns:
        raise ValueError(f"idx: expected indices in [-1, {columns}), got {int(idx.max())}")


def _check_grad(name: str, grad: Tensor, like: Tensor) -> None:
    _validate.floating(name, grad)
    if grad.shape != like.shape or grad.device != like.device:
        raise ValueError(f"{name}: expected {tuple(like.shape)} on {like.device}, got {tuple(grad.shape)} on "
                         f"{grad.device}")


# --------------------------------------------------------------------------- search


def knn_lists(
    query: Tensor, ref: Tensor, k: int, query_lengths: OptionalTensor, ref_lengths: OptionalTensor,
    backend: str,
) -> tuple[Tensor, Tensor]:
    """``torch.ops.fullgraph.knn``'s function."""
    _check_search(query, ref, k, query_lengths, ref_lengths, backend, "knn")
    if backend == "auto" and cpu.backend.tiny(query, ref, query_lengths, ref_lengths):
        found = cpu.backend.tiny_knn(query, ref, k)  # (what "auto" runs there)
        if found is not None:
            return found
    chosen = BACKENDS.resolve(backend, "knn", query.device, query.dtype, query.shape[-1], k,
                              size=pairs_per_item(query, ref))
    return knn_checked(query, ref, k, query_lengths, ref_lengths, chosen)


def knn_checked(query: Tensor, ref: Tensor, k: int, query_lengths: OptionalTensor, ref_lengths: OptionalTensor,
                chosen: backends.Backend) -> tuple[Tensor, Tensor]:
    """``knn_lists`` of clouds and lengths already checked (``check_clouds``, k an int >= 1)
    on the ``chosen`` backend: what ``api.direct`` calls without the operator."""
    check_list_width("k", k, ref.shape[1])
    chosen.check_capture(query.device, "knn", query.dtype, query.shape[-1], k)
    with threads.fitted(query):
        dists, idx, _ = chosen.implementation.nearest(query.contiguous(), ref.contiguous(), k, math.inf,
                                                      query_lengths, ref_lengths)
    return dists, idx


knn_op = torch.library.custom_op("fullgraph::knn", mutates_args=())(knn_lists)


def _rows(query: Tensor) -> tuple:
    """(B, M) of a [B, M, D] query, for fake outputs. Fakes do not check: the operator raises
    its documented error when it runs (an error while tracing would not be a ValueError)."""
    return tuple(query.shape[:2]) if query.dim() == 3 else (1, 0)


@knn_op.register_fake
def _(query, ref, k, query_lengths, ref_lengths, backend):
    batch, rows = _rows(query)
    return query.new_empty((batch, rows, k)), query.new_empty((batch, rows, k), dtype=torch.int64)


def radius_lists(
    query: Tensor, ref: Tensor, radius: float, max_neighbors: int, query_lengths: OptionalTensor,
    ref_lengths: OptionalTensor, backend: str, radius_tensor: OptionalTensor = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``torch.ops.fullgraph.radius``'s function (``api.direct`` calls it without the operator).
    ``radius_tensor`` (0-d), where given, replaces ``radius`` (see ``scalar``)."""
    radius = scalar("radius", radius, radius_tensor)
    _check_search(query, ref, max_neighbors, query_lengths, ref_lengths, backend, "radius", radius)
    with threads.fitted(query):
        return kernels(backend, "radius", query, query.shape[-1], max_neighbors, pairs_per_item(query, ref)).nearest(
            query.contiguous(), ref.contiguous(), max_neighbors, radius, query_lengths, ref_lengths)


radius_op = torch.library.custom_op("fullgraph::radius", mutates_args=())(radius_lists)


@radius_op.register_fake
def _(query, ref, radius, max_neighbors, query_lengths, ref_lengths, backend, radius_tensor=None):
    batch, rows = _rows(query)
    shape = (batch, rows, max_neighbors)
    return (
        query.new_empty(shape),
        query.new_empty(shape, dtype=torch.int64),
        query.new_empty((batch, rows), dtype=torch.int64),
    )


@torch.library.custom_op("fullgraph::distances_backward", mutates_args=())
def distances_backward_op(
    grad_dists: Tensor, query: Tensor, ref: Tensor, idx: Tensor, dists: Tensor, backend: str
) -> tuple[Tensor, Tensor]:
    """Gradient of neighbour distances [B, M, k] with respect to query and ref."""
    check_clouds(query, ref, None, None)
    _check_lists(idx, dists, query, ref.shape[1])
    _check_grad("grad_dists", grad_dists, dists)
    return kernels(backend, _search_op(backend), query, query.shape[-1], idx.shape[-1],
                   pairs_per_item(query, ref)).distances_backward(
        grad_dists, query.contiguous(), ref.contiguous(), idx, dists)


def _search_op(backend: str) -> str:
    """The search op whose lists a backend's backward differentiates (warp has no knn)."""
    return "knn" if backend == "auto" or "knn" in BACKENDS.get(backend).ops else "radius"


@distances_backward_op.register_fake
def _(grad_dists, query, ref, idx, dists, backend):
    return torch.empty_like(query), torch.empty_like(ref)


def _save_search(backend_at: int):
    """setup_context of a search op whose ``backend`` argument is input ``backend_at``."""
    def setup(ctx, inputs, output):
        ctx.backend = inputs[backend_at]
        ctx.save_for_backward(inputs[0], inputs[1], output[1], output[0])
    return setup


def _search_backward(input_count: int):
    """Backward of a search op with ``input_count`` inputs; only dists carry a gradient."""

    def backward(ctx, grad_dists, *non_differentiable):
        query, ref, idx, dists = ctx.saved_tensors
        grads = distances_backward_op(grad_dists, query, ref, idx, dists, ctx.backend)
        return (*grads, *(None,) * (input_count - 2))

    return backward


knn_op.register_autograd(_search_backward(6), setup_context=_save_search(5))
radius_op.register_autograd(_search_backward(8), setup_context=_save_search(6))


# ----------------------------------------------------------------------- aggregation


@torch.library.custom_op("fullgraph::knn_aggregate", mutates_args=())
def knn_aggregate_op(
    query: Tensor, ref: Tensor, features: Tensor, k: int, sigma: float, query_lengths: OptionalTensor,
    ref_lengths: OptionalTensor, backend: str, sigma_tensor: OptionalTensor = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out [B, M, C], dists [B, M, k], idx [B, M, k]); the last two feed backward.
    ``sigma_tensor`` (0-d), where given, replaces ``sigma`` (see ``scalar``)."""
    sigma = scalar("sigma", sigma, sigma_tensor)
    _check_aggregate(query, ref, features, sigma, query_lengths, ref_lengths, backend)
    _validate.integer("k", k, minimum=1)
    check_list_width("k", k, ref.shape[1])
    return kernels(backend, "knn_aggregate", query, query.shape[-1], k, pairs_per_item(query, ref)).knn_aggregate(
        query.contiguous(), ref.contiguous(), features.contiguous(), k, sigma, query_lengths, ref_lengths)


@knn_aggregate_op.register_fake
def _(query, ref, features, k, sigma, query_lengths, ref_lengths, backend, sigma_tensor=None):
    batch, rows = _rows(query)
    return (
        features.new_empty((batch, rows, features.shape[-1])),
        query.new_empty((batch, rows, k)),
        query.new_empty((batch, rows, k), dtype=torch.int64),
    )


@torch.library.custom_op("fullgraph::knn_aggregate_backward", mutates_args=())
def knn_aggregate_backward_op(
    grad_out: Tensor, features: Tensor, out: Tensor, dists: Tensor, idx: Tensor, sigma: float, backend: str,
    sigma_tensor: OptionalTensor = None, dists_grad: bool = True,
) -> tuple[Tensor, Tensor]:
    """(grad_dists [B, M, k], grad_features [B, N, C]) of the softmax-weighted sum; without
    ``dists_grad``, grad_dists is zeros (the points are data: a backend may skip its work)."""
    sigma = scalar("sigma", sigma, sigma_tensor)
    _validate.floating("features", features)
    _validate.rank("features", features, (3,), "[B, N, C]")
    _check_lists(idx, dists, out, features.shape[1])
    _check_grad("grad_out", grad_out, out)
    check_sigma(sigma, features.dtype)
    return kernels(backend, "knn_aggregate", dists, None, idx.shape[-1]).knn_aggregate_backward(
        grad_out, features.contiguous(), out.contiguous(), dists, idx, sigma, dists_grad)


@knn_aggregate_backward_op.register_fake
def _(grad_out, features, out, dists, idx, sigma, backend, sigma_tensor=None, dists_grad=True):
    return torch.empty_like(dists), torch.empty_like(features)


def _knn_aggregate_setup(ctx, inputs, output):
    query, ref, features, k, sigma = inputs[:5]
    out, dists, idx = output
    ctx.sigma, ctx.backend = (sigma, (*inputs, None)[8]), inputs[7]  # (number, tensor or None)
    ctx.save_for_backward(query, ref, features, out, dists, idx)


def _knn_aggregate_backward(ctx, grad_out, grad_dists_unused, grad_idx_unused):
    query, ref, features, out, dists, idx = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 9
    points_grad = any(ctx.needs_input_grad[:2])  # points are often data: then their gradients are never computed
    grad_dists, grad_features = knn_aggregate_backward_op(grad_out, features, out, dists, idx, ctx.sigma[0],
                                                          ctx.backend, ctx.sigma[1], points_grad)
    grad_query = grad_ref = None
    if points_grad:
        grad_query, grad_ref = distances_backward_op(grad_dists, query, ref, idx, dists, ctx.backend)
    return grad_query, grad_ref, grad_features, None, None, None, None, None, None


knn_aggregate_op.register_autograd(_knn_aggregate_backward, setup_context=_knn_aggregate_setup)


@torch.library.custom_op("fullgraph::radius_aggregate", mutates_args=())
def radius_aggregate_op(
    query: Tensor, ref: Tensor, features: Tensor, radius: float, sigma: float,
    query_lengths: OptionalTensor, ref_lengths: OptionalTensor, backend: str,
    radius_tensor: OptionalTensor = None, sigma_tensor: OptionalTensor = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out [B, M, C], stats [B, M, 2] float32, grid [G] int32); stats and grid feed
    the backward. stats: per query the least distance within the radius (+inf without
    neighbours) and the sum of the weights exp(-(d - least) / sigma), where the backend's
    forward computes them ("triton"), else -1 (no weight sum is negative; that backward
    recomputes the pairs). grid: the search structure the forward built ("triton": the cell
    grid and both clouds' sorted orders), which spares the backward building it again; G = 0
    for backends that keep none. ``radius_tensor`` / ``sigma_tensor`` (0-d), where given,
    replace the numbers (see ``scalar``)."""
    radius, sigma = scalar("radius", radius, radius_tensor), scalar("sigma", sigma, sigma_tensor)
    _check_aggregate(query, ref, features, sigma, query_lengths, ref_lengths, backend)
    _validate.real("radius", radius, minimum=0.0, strict=False)
    implementation = kernels(backend, "radius_aggregate", query, query.shape[-1], size=pairs_per_item(query, ref))
    out, stats, grid = implementation.radius_aggregate(
        query.contiguous(), ref.contiguous(), features.contiguous(), radius, sigma, query_lengths, ref_lengths)
    if stats is None:
        stats = torch.full((*query.shape[:2], 2), -1.0, dtype=torch.float32, device=query.device)
    if grid is None:
        grid = torch.empty((0,), dtype=torch.int32, device=query.device)
    return out, stats, grid


def _saved_grid_size(backend: str, query: Tensor, ref: Tensor, features: Tensor) -> int:
    """G of radius_aggregate's grid output for these inputs (0 where the op would raise: it
    says why when it runs)."""
    if query.dim() != 3 or ref.dim() != 3 or features.dim() != 3:
        return 0
    try:
        implementation = kernels(backend, "radius_aggregate", query, query.shape[-1], size=pairs_per_item(query, ref))
    except (TypeError, ValueError):
        return 0
    return implementation.saved_grid_size(*query.shape[:2], ref.shape[1], features.shape[-1], query.shape[-1])


@radius_aggregate_op.register_fake
def _(query, ref, features, radius, sigma, query_lengths, ref_lengths, backend, radius_tensor=None,
      sigma_tensor=None):
    rows = _rows(query)
    return (features.new_empty((*rows, features.shape[-1])), query.new_empty((*rows, 2), dtype=torch.float32),
            query.new_empty((_saved_grid_size(backend, query, ref, features),), dtype=torch.int32))


@torch.library.custom_op("fullgraph::radius_aggregate_backward", mutates_args=())
def radius_aggregate_backward_op(
    grad_out: Tensor, query: Tensor, ref: Tensor, features: Tensor, out: Tensor, radius: float,
    sigma: float, query_lengths: OptionalTensor, ref_lengths: OptionalTensor, backend: str,
    radius_tensor: OptionalTensor = None, sigma_tensor: OptionalTensor = None, query_grad: bool = True,
    ref_grad: bool = True, stats: OptionalTensor = None, grid: OptionalTensor = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_query, grad_ref, grad_features), recomputing the pairs. With ``query_grad``
    (``ref_grad``) False that gradient is not wanted: a backend may skip it and return zeros.
    ``stats`` and ``grid``: the forward's (see radius_aggregate) for the same inputs, which
    spare a backend that made them recomputing them."""
    radius, sigma = scalar("radius", radius, radius_tensor), scalar("sigma", sigma, sigma_tensor)
    _check_aggregate(query, ref, features, sigma, query_lengths, ref_lengths, backend)
    _validate.real("radius", radius, minimum=0.0, strict=False)
    expected = (*query.shape[:2], features.shape[-1])
    for name, value in (("grad_out", grad_out), ("out", out)):
        _validate.floating(name, value)
        if tuple(value.shape) != expected:
            raise ValueError(f"{name}: expected [B, M, C] = {list(expected)}, got {list(value.shape)}")
    if stats is not None and (stats.dtype != torch.float32 or tuple(stats.shape) != (*query.shape[:2], 2)
                              or stats.device != query.device):
        raise ValueError(f"stats: expected float32 [B, M, 2] = {[*query.shape[:2], 2]} on {query.device}, got "
                         f"{stats.dtype} {list(stats.shape)} on {stats.device}")
    implementation = kernels(backend, "radius_aggregate", query, query.shape[-1], size=pairs_per_item(query, ref))
    if grid is not None:
        size = implementation.saved_grid_size(*query.shape[:2], ref.shape[1], features.shape[-1], query.shape[-1])
        if grid.dtype != torch.int32 or tuple(grid.shape) != (size,) or grid.device != query.device:
            raise ValueError(f"grid: expected the forward's int32 [{size}] on {query.device} for these inputs, got "
                             f"{grid.dtype} {list(grid.shape)} on {grid.device}")
    return implementation.radius_aggregate_backward(
        grad_out, query.contiguous(), ref.contiguous(), features.contiguous(), out, radius, sigma,
        query_lengths, ref_lengths, query_grad, ref_grad, stats, grid)


@radius_aggregate_backward_op.register_fake
def _(grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths, backend, radius_tensor=None,
      sigma_tensor=None, query_grad=True, ref_grad=True, stats=None, grid=None):
    return torch.empty_like(query), torch.empty_like(ref), torch.empty_like(features)


def _radius_aggregate_setup(ctx, inputs, output):
    query, ref, features, radius, sigma, query_lengths, ref_lengths, backend = inputs[:8]
    radius_tensor, sigma_tensor = (*inputs[8:], None, None)[:2]
    ctx.params = (radius, sigma)
    ctx.tensors = (radius_tensor, sigma_tensor)
    ctx.backend = backend
    ctx.save_for_backward(query, ref, features, *output, query_lengths, ref_lengths)


def _radius_aggregate_backward(ctx, grad_out, grad_stats_unused, grad_grid_unused):
    query, ref, features, out, stats, grid, query_lengths, ref_lengths = ctx.saved_tensors
    query_grad, ref_grad = ctx.needs_input_grad[:2]
    grads = radius_aggregate_backward_op(
        grad_out, query, ref, features, out, *ctx.params, query_lengths, ref_lengths, ctx.backend, *ctx.tensors,
        query_grad, ref_grad, stats, grid)
    return (grads[0] if query_grad else None, grads[1] if ref_grad else None, grads[2], *(None,) * 7)


radius_aggregate_op.register_autograd(_radius_aggregate_backward, setup_context=_radius_aggregate_setup)
