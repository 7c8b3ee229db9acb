"""The neighbour operators under ``torch.ops.fullgraph``: schemas, fake kernels, autograd.

Each op takes a resolved backend name and runs that backend's search; the maths that
turns neighbours into aggregated features and gradients lives in ``reference`` and is
shared. Backward functions are themselves operators, so they compile too.
"""

from __future__ import annotations

import math

import torch

from . import cpu, hashgrid, reference
from . import triton as triton_backend

# Each backend provides `nearest` (search) and either `radius_pairs` (the pair-based
# aggregation below does the rest) or a fused `radius_aggregate` with its backward.
# ("cuml" composes its own extern op with torch code in `rapids`, outside these ops.)
BACKENDS = {"torch": reference, "cpu": cpu, "triton": triton_backend, "warp": hashgrid}

Tensor = torch.Tensor
OptionalTensor = torch.Tensor | None


def _flat(points: Tensor) -> Tensor:
    """[B, L, W] -> [B*L, W], with one zero row when empty: missing neighbour slots point
    at row 0 (with zero weight), so it must exist."""
    flat = points.reshape(-1, points.shape[-1])
    return flat if flat.shape[0] > 0 else points.new_zeros((1, points.shape[-1]))


def _unflat(flat: Tensor, like: Tensor) -> Tensor:
    """Inverse of ``_flat``: drop the padding row, take the shape and dtype of ``like``."""
    return flat[: like.shape[0] * like.shape[1]].reshape(like.shape).to(like.dtype)


# --------------------------------------------------------------------------- search


@torch.library.custom_op("fullgraph::knn", mutates_args=())
def knn_op(
    query: Tensor, ref: Tensor, k: int, query_lengths: OptionalTensor, ref_lengths: OptionalTensor,
    backend: str,
) -> tuple[Tensor, Tensor]:
    dists, idx, _ = BACKENDS[backend].nearest(
        query.contiguous(), ref.contiguous(), k, math.inf, query_lengths, ref_lengths
    )
    return dists, idx


@knn_op.register_fake
def _(query, ref, k, query_lengths, ref_lengths, backend):
    batch, rows = query.shape[:2]
    return query.new_empty((batch, rows, k)), query.new_empty((batch, rows, k), dtype=torch.int64)


@torch.library.custom_op("fullgraph::radius", mutates_args=())
def radius_op(
    query: Tensor, ref: Tensor, radius: float, max_neighbors: int, query_lengths: OptionalTensor,
    ref_lengths: OptionalTensor, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    return BACKENDS[backend].nearest(
        query.contiguous(), ref.contiguous(), max_neighbors, radius, query_lengths, ref_lengths
    )


@radius_op.register_fake
def _(query, ref, radius, max_neighbors, query_lengths, ref_lengths, backend):
    batch, rows = query.shape[:2]
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
    module = BACKENDS[backend]
    if hasattr(module, "distances_backward"):
        return module.distances_backward(grad_dists, query.contiguous(), ref.contiguous(), idx, dists)
    qi, rj, found = reference.neighbor_pairs(idx, ref.shape[1])
    acc = reference.accumulation_dtype(query.dtype)
    # Recomputed in full precision: the saved distances may be rounded to bf16/fp16.
    exact = reference.pair_distances(_flat(query)[qi], _flat(ref)[rj])
    d = torch.where(found & torch.isfinite(dists.reshape(-1)), exact, math.inf).to(acc)
    flat_query, flat_ref = _flat(query), _flat(ref)
    grad_query = torch.zeros(flat_query.shape, dtype=acc, device=query.device)
    grad_ref = torch.zeros(flat_ref.shape, dtype=acc, device=ref.device)
    reference.distances_backward_pairs(grad_dists.reshape(-1), flat_query, flat_ref, qi, rj, d, grad_query, grad_ref)
    return _unflat(grad_query, query), _unflat(grad_ref, ref)


@distances_backward_op.register_fake
def _(grad_dists, query, ref, idx, dists, backend):
    return torch.empty_like(query), torch.empty_like(ref)


def _save_search(ctx, inputs, output):
    ctx.backend = inputs[-1]
    ctx.save_for_backward(inputs[0], inputs[1], output[1], output[0])


def _search_backward(input_count: int):
    """Backward of a search op with ``input_count`` inputs; only dists carry a gradient."""

    def backward(ctx, grad_dists, *non_differentiable):
        query, ref, idx, dists = ctx.saved_tensors
        grads = distances_backward_op(grad_dists, query, ref, idx, dists, ctx.backend)
        return (*grads, *(None,) * (input_count - 2))

    return backward


knn_op.register_autograd(_search_backward(6), setup_context=_save_search)
radius_op.register_autograd(_search_backward(7), setup_context=_save_search)


# ----------------------------------------------------------------------- aggregation


def _knn_chunks(idx: Tensor, dists: Tensor, columns: int, width: int):
    """Bounded chunks of the [B*M] query rows of neighbour lists idx [B, M, k].

    Yields (rows, qi, rj, d, slots): qi local to the chunk, rj rows of the flat [B*N]
    reference, d the slots' distances (+inf where missing), slots the flat entries.
    """
    k = idx.shape[-1]
    qi, rj, found = reference.neighbor_pairs(idx, columns)
    d = torch.where(found, dists.reshape(-1).to(reference.accumulation_dtype(dists.dtype)), math.inf)
    for chunk in reference.query_chunks(qi.numel() // max(k, 1), k, width, idx.device):
        slots = slice(chunk.start * k, chunk.stop * k)
        yield chunk, qi[slots] - chunk.start, rj[slots], d[slots], slots


@torch.library.custom_op("fullgraph::knn_aggregate", mutates_args=())
def knn_aggregate_op(
    query: Tensor, ref: Tensor, features: Tensor, k: int, sigma: float, query_lengths: OptionalTensor,
    ref_lengths: OptionalTensor, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (out [B, M, C], dists [B, M, k], idx [B, M, k]); the last two feed backward."""
    module = BACKENDS[backend]
    if hasattr(module, "knn_aggregate"):
        return module.knn_aggregate(
            query.contiguous(), ref.contiguous(), features.contiguous(), k, sigma, query_lengths, ref_lengths)
    dists, idx, _ = module.nearest(
        query.contiguous(), ref.contiguous(), k, math.inf, query_lengths, ref_lengths
    )
    acc = reference.accumulation_dtype(query.dtype)
    flat_features = _flat(features)
    out = torch.empty((idx.shape[0] * idx.shape[1], features.shape[-1]), dtype=acc, device=query.device)
    for rows, qi, rj, d, _ in _knn_chunks(idx, dists, ref.shape[1], features.shape[-1]):
        out[rows] = reference.aggregate_pairs(flat_features, qi, rj, d, sigma, rows.stop - rows.start)
    return out.reshape(*query.shape[:2], features.shape[-1]).to(features.dtype), dists, idx


@knn_aggregate_op.register_fake
def _(query, ref, features, k, sigma, query_lengths, ref_lengths, backend):
    batch, rows = query.shape[:2]
    return (
        features.new_empty((batch, rows, features.shape[-1])),
        query.new_empty((batch, rows, k)),
        query.new_empty((batch, rows, k), dtype=torch.int64),
    )


@torch.library.custom_op("fullgraph::knn_aggregate_backward", mutates_args=())
def knn_aggregate_backward_op(
    grad_out: Tensor, features: Tensor, out: Tensor, dists: Tensor, idx: Tensor, sigma: float, backend: str
) -> tuple[Tensor, Tensor]:
    """(grad_dists [B, M, k], grad_features [B, N, C]) of the softmax-weighted sum."""
    module = BACKENDS[backend]
    if hasattr(module, "knn_aggregate_backward"):
        return module.knn_aggregate_backward(grad_out, features.contiguous(), out.contiguous(), dists, idx, sigma)
    acc = reference.accumulation_dtype(features.dtype)
    flat_features, flat_grad, flat_out = _flat(features), _flat(grad_out), _flat(out)
    grad_dists = torch.zeros(dists.numel(), dtype=acc, device=dists.device)
    grad_features = torch.zeros(flat_features.shape, dtype=acc, device=features.device)
    for rows, qi, rj, d, slots in _knn_chunks(idx, dists, features.shape[1], features.shape[-1]):
        grad_dists[slots] = reference.aggregate_pairs_backward(
            flat_grad[rows], flat_features, flat_out[rows], qi, rj, d, sigma, grad_features
        )
    return grad_dists.reshape(dists.shape).to(dists.dtype), _unflat(grad_features, features)


@knn_aggregate_backward_op.register_fake
def _(grad_out, features, out, dists, idx, sigma, backend):
    return torch.empty_like(dists), torch.empty_like(features)


def _knn_aggregate_setup(ctx, inputs, output):
    query, ref, features, k, sigma = inputs[:5]
    out, dists, idx = output
    ctx.sigma, ctx.backend = sigma, inputs[7]
    ctx.save_for_backward(query, ref, features, out, dists, idx)


def _knn_aggregate_backward(ctx, grad_out, grad_dists_unused, grad_idx_unused):
    query, ref, features, out, dists, idx = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 8
    grad_dists, grad_features = knn_aggregate_backward_op(grad_out, features, out, dists, idx, ctx.sigma, ctx.backend)
    grad_query, grad_ref = distances_backward_op(grad_dists, query, ref, idx, dists, ctx.backend)
    return grad_query, grad_ref, grad_features, None, None, None, None, None


knn_aggregate_op.register_autograd(_knn_aggregate_backward, setup_context=_knn_aggregate_setup)


@torch.library.custom_op("fullgraph::radius_aggregate", mutates_args=())
def radius_aggregate_op(
    query: Tensor, ref: Tensor, features: Tensor, radius: float, sigma: float,
    query_lengths: OptionalTensor, ref_lengths: OptionalTensor, backend: str,
) -> Tensor:
    query, ref, features = query.contiguous(), ref.contiguous(), features.contiguous()
    module = BACKENDS[backend]
    if hasattr(module, "radius_aggregate"):
        return module.radius_aggregate(query, ref, features, radius, sigma, query_lengths, ref_lengths)
    acc = reference.accumulation_dtype(query.dtype)
    out = torch.zeros((*query.shape[:2], features.shape[-1]), dtype=acc, device=query.device)
    pairs = module.radius_pairs(query, ref, radius, query_lengths, ref_lengths)
    for b, rows, qi, rj, d in pairs:
        block = out[b, rows]
        block += reference.aggregate_pairs(features[b], qi, rj, d, sigma, block.shape[0])
    return out.to(features.dtype)


@radius_aggregate_op.register_fake
def _(query, ref, features, radius, sigma, query_lengths, ref_lengths, backend):
    return features.new_empty((*query.shape[:2], features.shape[-1]))


@torch.library.custom_op("fullgraph::radius_aggregate_backward", mutates_args=())
def radius_aggregate_backward_op(
    grad_out: Tensor, query: Tensor, ref: Tensor, features: Tensor, out: Tensor, radius: float,
    sigma: float, query_lengths: OptionalTensor, ref_lengths: OptionalTensor, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_query, grad_ref, grad_features), recomputing the pairs chunk by chunk."""
    query, ref, features = query.contiguous(), ref.contiguous(), features.contiguous()
    module = BACKENDS[backend]
    if hasattr(module, "radius_aggregate_backward"):
        return module.radius_aggregate_backward(
            grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths)
    acc = reference.accumulation_dtype(query.dtype)
    grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (query, ref, features)]
    grad_query, grad_ref, grad_features = grads
    for b, rows, qi, rj, d in module.radius_pairs(query, ref, radius, query_lengths, ref_lengths):
        grad_d = reference.aggregate_pairs_backward(
            grad_out[b, rows], features[b], out[b, rows], qi, rj, d, sigma, grad_features[b]
        )
        reference.distances_backward_pairs(grad_d, query[b, rows], ref[b], qi, rj, d, grad_query[b, rows], grad_ref[b])
    return tuple(g.to(t.dtype) for g, t in zip(grads, (query, ref, features)))


@radius_aggregate_backward_op.register_fake
def _(grad_out, query, ref, features, out, radius, sigma, query_lengths, ref_lengths, backend):
    return torch.empty_like(query), torch.empty_like(ref), torch.empty_like(features)


def _radius_aggregate_setup(ctx, inputs, output):
    query, ref, features, radius, sigma, query_lengths, ref_lengths, backend = inputs
    ctx.params = (radius, sigma)
    ctx.backend = backend
    ctx.save_for_backward(query, ref, features, output, query_lengths, ref_lengths)


def _radius_aggregate_backward(ctx, grad_out):
    query, ref, features, out, query_lengths, ref_lengths = ctx.saved_tensors
    grads = radius_aggregate_backward_op(
        grad_out, query, ref, features, out, *ctx.params, query_lengths, ref_lengths, ctx.backend
    )
    return (*grads, None, None, None, None, None)


radius_aggregate_op.register_autograd(_radius_aggregate_backward, setup_context=_radius_aggregate_setup)
