"""The batch-vector forms (PyG's flat clouds [N, D] with sorted item ids) as operators.

A flat call pads its items (one host read of the item sizes), runs the padded operator and
unpads. Wrapped in one operator each, with outputs sized by the flat inputs ([M, k], [M, C]),
``torch.compile(fullgraph=True, dynamic=True)`` sees no data-dependent size and compiles once
for all sizes. The lists they return hold global rows of the flat reference cloud, so their
gradients are the padded operators' backward ops on one item of N rows.
"""

from __future__ import annotations

import torch

from . import registration
from .api import _query_items, batch_vectors

Tensor = torch.Tensor
OptionalTensor = torch.Tensor | None


def _padded(query, ref, batch_query, batch_ref):
    padded_query, padded_ref, queries, refs = batch_vectors(query, ref, batch_query, batch_ref, None, None)
    return padded_query, padded_ref, queries, refs, _query_items(batch_query, queries)


@torch.library.custom_op("fullgraph::knn_flat", mutates_args=())
def knn_flat(query: Tensor, ref: Tensor, k: int, batch_query: OptionalTensor, batch_ref: OptionalTensor,
             backend: str) -> tuple[Tensor, Tensor]:
    """(dists [M, k], idx [M, k] rows of ref) of flat clouds with batch vectors."""
    from .api import knn

    padded_query, padded_ref, queries, refs, items = _padded(query, ref, batch_query, batch_ref)
    dists, idx = knn(padded_query, padded_ref, k, query_lengths=queries.lengths, ref_lengths=refs.lengths,
                     backend=backend)
    return queries.unpad(dists), refs.global_index(queries.unpad(idx), items)


@knn_flat.register_fake
def _(query, ref, k, batch_query, batch_ref, backend):
    return query.new_empty((query.shape[0], k)), query.new_empty((query.shape[0], k), dtype=torch.int64)


@torch.library.custom_op("fullgraph::radius_flat", mutates_args=())
def radius_flat(query: Tensor, ref: Tensor, radius: float, max_neighbors: int, batch_query: OptionalTensor,
                batch_ref: OptionalTensor, backend: str, radius_tensor: OptionalTensor = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """(dists [M, cap], idx [M, cap] rows of ref, counts [M]) of flat clouds."""
    from .api import radius as padded_radius

    padded_query, padded_ref, queries, refs, items = _padded(query, ref, batch_query, batch_ref)
    dists, idx, counts = padded_radius(padded_query, padded_ref, radius if radius_tensor is None else radius_tensor,
                                       max_neighbors, query_lengths=queries.lengths, ref_lengths=refs.lengths,
                                       backend=backend)
    return queries.unpad(dists), refs.global_index(queries.unpad(idx), items), queries.unpad(counts)


@radius_flat.register_fake
def _(query, ref, radius, max_neighbors, batch_query, batch_ref, backend, radius_tensor=None):
    shape = (query.shape[0], max_neighbors)
    return (query.new_empty(shape), query.new_empty(shape, dtype=torch.int64),
            query.new_empty(query.shape[:1], dtype=torch.int64))


def _search_backward(input_count: int):
    """The padded search's backward on one item of N rows (the lists hold rows of ref)."""
    def backward(ctx, grad_dists, *unused):
        query, ref, idx, dists = ctx.saved_tensors
        grad_query, grad_ref = registration.distances_backward_op(
            grad_dists[None], query[None], ref[None], idx[None], dists[None], ctx.backend)
        return (grad_query[0], grad_ref[0], *(None,) * (input_count - 2))
    return backward


knn_flat.register_autograd(_search_backward(6), setup_context=registration._save_search(5))
radius_flat.register_autograd(_search_backward(8), setup_context=registration._save_search(6))


def _aggregated(op: str, query, ref, features, size, sigma, batch_query, batch_ref, backend):
    """knn_aggregate or radius_aggregate (``op``; ``size`` its k or radius, a number or a 0-d
    tensor, as ``sigma``) of flat clouds, through the padded layout: out [M, C]."""
    from . import api

    padded_query, padded_ref, queries, refs, _ = _padded(query, ref, batch_query, batch_ref)
    out = getattr(api, op)(padded_query, padded_ref, refs.pad(features), size, sigma=sigma,
                           query_lengths=queries.lengths, ref_lengths=refs.lengths, backend=backend)
    return queries.unpad(out)


def _size(op: str, size: float, size_tensor):
    if size_tensor is not None:
        return size_tensor
    return int(size) if op == "knn_aggregate" else size


@torch.library.custom_op("fullgraph::aggregate_flat", mutates_args=())
def aggregate_flat(op: str, query: Tensor, ref: Tensor, features: Tensor, size: float, sigma: float,
                   batch_query: OptionalTensor, batch_ref: OptionalTensor, backend: str,
                   size_tensor: OptionalTensor = None, sigma_tensor: OptionalTensor = None) -> Tensor:
    """out [M, C] of knn_aggregate / radius_aggregate (``op``) of flat clouds; ``size`` is k
    or the radius, ``size_tensor`` / ``sigma_tensor`` (0-d) replace the numbers where given."""
    return _aggregated(op, query, ref, features, _size(op, size, size_tensor),
                       sigma if sigma_tensor is None else sigma_tensor, batch_query, batch_ref, backend)


@aggregate_flat.register_fake
def _(op, query, ref, features, size, sigma, batch_query, batch_ref, backend, size_tensor=None, sigma_tensor=None):
    return features.new_empty((query.shape[0], features.shape[-1]))


@torch.library.custom_op("fullgraph::aggregate_flat_backward", mutates_args=())
def aggregate_flat_backward(grad_out: Tensor, op: str, query: Tensor, ref: Tensor, features: Tensor, size: float,
                            sigma: float, batch_query: OptionalTensor, batch_ref: OptionalTensor, backend: str,
                            size_tensor: OptionalTensor = None, sigma_tensor: OptionalTensor = None,
                            points_grad: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_query, grad_ref, grad_features) of ``aggregate_flat``: the padded forward again,
    then the padded operator's backward ops (zeros for the points without ``points_grad``)."""
    from . import api

    padded_query, padded_ref, queries, refs, _ = _padded(query, ref, batch_query, batch_ref)
    padded_features = refs.pad(features)
    lengths = (queries.lengths, refs.lengths)
    k = int(size) if op == "knn_aggregate" else 1
    padded_query, padded_ref, padded_features, _, chosen, _ = api._aggregate_inputs(
        padded_query, padded_ref, padded_features, sigma if sigma_tensor is None else sigma_tensor, *lengths,
        backend, op, k)
    padded_grad = queries.pad(grad_out)
    if op == "knn_aggregate":
        out, dists, idx = registration.knn_aggregate_op(padded_query, padded_ref, padded_features, k, sigma, *lengths,
                                                        chosen, sigma_tensor)
        grad_dists, grad_features = registration.knn_aggregate_backward_op(
            padded_grad, padded_features, out, dists, idx, sigma, chosen, sigma_tensor, points_grad)
        if points_grad:
            grad_query, grad_ref = registration.distances_backward_op(grad_dists, padded_query, padded_ref, idx,
                                                                      dists, chosen)
        else:
            grad_query, grad_ref = torch.zeros_like(padded_query), torch.zeros_like(padded_ref)
    else:
        out, stats, grid = registration.radius_aggregate_op(padded_query, padded_ref, padded_features, size, sigma,
                                                            *lengths, chosen, size_tensor, sigma_tensor)
        grad_query, grad_ref, grad_features = registration.radius_aggregate_backward_op(
            padded_grad, padded_query, padded_ref, padded_features, out, size, sigma, *lengths, chosen, size_tensor,
            sigma_tensor, points_grad, points_grad, stats, grid)
    return queries.unpad(grad_query), refs.unpad(grad_ref), refs.unpad(grad_features)


@aggregate_flat_backward.register_fake
def _(grad_out, op, query, ref, features, size, sigma, batch_query, batch_ref, backend, size_tensor=None,
      sigma_tensor=None, points_grad=True):
    return torch.empty_like(query), torch.empty_like(ref), torch.empty_like(features)


def _save_aggregate(ctx, inputs, output):
    ctx.arguments = (inputs[0], *inputs[4:6], inputs[8])  # op, size, sigma, backend
    ctx.save_for_backward(*inputs[1:4], inputs[6], inputs[7], *(*inputs[9:], None, None)[:2])


def _aggregate_backward(ctx, grad_out):
    query, ref, features, batch_query, batch_ref, size_tensor, sigma_tensor = ctx.saved_tensors
    op, size, sigma, backend = ctx.arguments
    points_grad = any(ctx.needs_input_grad[1:3])
    grads = aggregate_flat_backward(grad_out, op, query, ref, features, size, sigma, batch_query, batch_ref, backend,
                                    size_tensor, sigma_tensor, points_grad)
    return (None, *grads, *(None,) * 7)


aggregate_flat.register_autograd(_aggregate_backward, setup_context=_save_aggregate)
