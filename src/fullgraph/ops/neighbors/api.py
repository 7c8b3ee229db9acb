"""Public neighbour functions: validation, backend choice, docstrings."""

from __future__ import annotations

import importlib.util
import os

import torch

from ... import _validate
from . import ops  # noqa: F401  (importing registers torch.ops.fullgraph.*)
from . import rapids
from . import triton as triton_backend

BACKEND_NAMES = ("auto", "torch", "cpu", "triton", "warp", "cuml")
# The external backends each cover one family of operators, on CUDA.
EXTERNAL = {"warp": ("radius", "radius_aggregate"), "cuml": ("knn", "knn_aggregate")}
_PACKAGES = {"scipy": '"fullgraph[cpu]"', "warp": '"fullgraph[warp]" (NVIDIA Warp)',
             "cuml": '"fullgraph[rapids]" (RAPIDS cuML)'}
# Probed once, without importing them, so that `import fullgraph` stays light and the
# choice below needs no import machinery while torch.compile traces it.
_HAVE = {name: importlib.util.find_spec(name) is not None for name in _PACKAGES}
# Triton's interpreter runs the kernels on CPU tensors (slowly): used by the CPU tests.
_TRITON_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def _external(backend: str, query: torch.Tensor, operation: str) -> None:
    """Checks for the Warp and cuML backends."""
    if operation not in EXTERNAL[backend]:
        raise ValueError(f'backend: "{backend}" provides {" and ".join(EXTERNAL[backend])}, not {operation}')
    if query.device.type != "cuda":
        raise ValueError(f'backend: "{backend}" needs CUDA tensors, got tensors on {query.device}')
    if not _HAVE[backend]:
        raise ImportError(f'backend="{backend}" needs {backend}: pip install {_PACKAGES[backend]}')
    if backend == "warp":
        if query.shape[-1] != 3:
            raise ValueError(f'query: backend="warp" (a 3-D HashGrid) needs D = 3, got shape {tuple(query.shape)}')
        if query.dtype != torch.float32:
            raise TypeError(f'query: backend="warp" computes in float32, got {query.dtype} (convert, or use "triton")')
    elif query.dtype not in (torch.float32, torch.float64):
        raise TypeError(f'query: backend="cuml" needs float32 or float64, got {query.dtype}')


def _backend(backend: str, query: torch.Tensor, k: int = 1, operation: str = "knn") -> str:
    """Resolve ``backend`` for tensors like ``query`` running ``operation``; k is the list
    length it must hold."""
    _validate.choice("backend", backend, BACKEND_NAMES)
    device = query.device
    if backend in EXTERNAL:
        _external(backend, query, operation)
        return backend
    if backend == "auto":
        if device.type == "cpu":
            return "cpu" if _HAVE["scipy"] else "torch"
        triton_fits = k <= triton_backend.MAX_K and query.dtype != torch.float64
        return "triton" if device.type == "cuda" and triton_backend.available() and triton_fits else "torch"
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f'backend: "cpu" needs CPU tensors, got tensors on {device}')
        if not _HAVE["scipy"]:
            raise ImportError('backend="cpu" needs scipy: pip install "fullgraph[cpu]"')
    if backend == "triton":
        if not triton_backend.available():
            raise ImportError('backend="triton" needs triton: pip install triton (it comes with CUDA builds of torch)')
        if device.type != "cuda" and not (device.type == "cpu" and _TRITON_ON_CPU):
            raise ValueError(f'backend: "triton" needs CUDA tensors, got tensors on {device}')
        if k > triton_backend.MAX_K:
            raise ValueError(f'k: backend="triton" supports up to {triton_backend.MAX_K} neighbours, got {k}')
        if query.dtype == torch.float64:
            raise TypeError('query: backend="triton" computes in float32, got torch.float64 (use backend="torch")')
    return backend


def _points(query, ref, query_lengths, ref_lengths):
    """Check the point clouds; return them batched [B, M, D], [B, N, D] and whether to unbatch."""
    _validate.floating("query", query)
    _validate.floating("ref", ref)
    _validate.rank("query", query, (2, 3), "[M, D] or [B, M, D]")
    _validate.rank("ref", ref, (query.dim(),), f"{'[B, N, D]' if query.dim() == 3 else '[N, D]'} like query")
    _validate.same_dtype_and_device("ref", ref, "query", query)
    if query.shape[-1] < 1:
        raise ValueError(f"query: expected at least one coordinate (D >= 1), got shape {tuple(query.shape)}")
    if ref.shape[-1] != query.shape[-1]:
        raise ValueError(f"ref: expected D = {query.shape[-1]} coordinates like query, got shape {tuple(ref.shape)}")
    unbatched = query.dim() == 2
    if unbatched:
        for name, lengths in (("query_lengths", query_lengths), ("ref_lengths", ref_lengths)):
            if lengths is not None:
                raise ValueError(f"{name}: only for batched inputs [B, M, D], got query of shape {tuple(query.shape)}")
        return query[None], ref[None], unbatched
    if ref.shape[0] != query.shape[0]:
        raise ValueError(f"ref: expected batch size {query.shape[0]} like query, got shape {tuple(ref.shape)}")
    if query_lengths is not None:
        _validate.lengths("query_lengths", query_lengths, query.shape[0], query.shape[1], query.device)
    if ref_lengths is not None:
        _validate.lengths("ref_lengths", ref_lengths, ref.shape[0], ref.shape[1], ref.device)
    return query, ref, unbatched


def _features(features, ref: torch.Tensor, unbatched: bool) -> torch.Tensor:
    _validate.floating("features", features)
    _validate.rank("features", features, (ref.dim() - unbatched,), "[N, C]" if unbatched else "[B, N, C]")
    _validate.same_dtype_and_device("features", features, "ref", ref)
    features = features[None] if unbatched else features
    if features.shape[:2] != ref.shape[:2]:
        raise ValueError(
            f"features: expected one row per reference point, {tuple(ref.shape[:2])[unbatched:]}, "
            f"got shape {tuple(features.shape)[unbatched:]}"
        )
    return features


def _aggregate_inputs(query, ref, features, sigma, query_lengths, ref_lengths, backend, operation, k=1):
    """Checks shared by the aggregations; returns batched tensors and resolved options."""
    query, ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    features = _features(features, ref, unbatched)
    sigma = _validate.real("sigma", sigma, minimum=0.0, strict=True)
    return query, ref, features, sigma, _backend(backend, query, k, operation), unbatched


def _unbatch(tensors, unbatched: bool):
    return tuple(t[0] for t in tensors) if unbatched else tuple(tensors)


def knn(query, ref, k, *, query_lengths=None, ref_lengths=None, backend="auto"):
    """The k nearest reference points of every query point.

    Args:
        query: [M, D] or [B, M, D] float16/bfloat16/float32/float64, any device.
        ref: [N, D] or [B, N, D], same dtype and device as ``query``.
        k: number of neighbours, >= 1; may exceed N (missing slots are padded).
        query_lengths, ref_lengths: [B] int64, the valid prefix of each padded batch
            item (batched inputs only); padded queries get no neighbours.
        backend: "auto" (the fastest available for the device), "torch", "cpu" (scipy),
            "triton" (CUDA), "cuml" (CUDA, RAPIDS cuML candidates re-ranked exactly; knn
            and knn_aggregate) or "warp" (CUDA, float32, D = 3, NVIDIA Warp HashGrid;
            radius and radius_aggregate).

    Returns:
        dists: [..., M, k] Euclidean distances, ascending, in the input dtype, +inf where
            fewer than k valid references exist. Differentiable w.r.t. query and ref (the
            gradient of a zero distance is 0).
        idx: [..., M, k] int64 indices into ``ref`` (per batch item), -1 where missing.
            Ties go to the smaller index.

    Points with a non-finite coordinate are never neighbours and have none.

    Raises:
        TypeError: non-tensor or non-floating inputs, mixed dtypes, k not an int.
        ValueError: wrong ranks, mismatched D or batch, mixed devices, k < 1, bad lengths.

    Example:
        >>> ref = torch.randn(1000, 3)
        >>> dists, idx = fullgraph.knn(torch.randn(10, 3), ref, k=4)
        >>> dists.shape, idx.shape
        (torch.Size([10, 4]), torch.Size([10, 4]))
    """
    query, ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    k = _validate.integer("k", k, minimum=1)
    backend = _backend(backend, query, k, "knn")
    if backend == "cuml":
        return _unbatch(rapids.knn(query, ref, k, query_lengths, ref_lengths), unbatched)
    dists, idx = torch.ops.fullgraph.knn(query, ref, k, query_lengths, ref_lengths, backend)
    return _unbatch((dists, idx), unbatched)


def radius(query, ref, radius, max_neighbors, *, query_lengths=None, ref_lengths=None, backend="auto"):
    """The nearest ``max_neighbors`` reference points within ``radius`` of every query.

    Args:
        query: [M, D] or [B, M, D] floating, any device.
        ref: [N, D] or [B, N, D], same dtype and device.
        radius: finite float >= 0, inclusive (distance <= radius), in coordinate units.
        max_neighbors: the cap, >= 1. The *nearest* ones are kept, never the first found.
        query_lengths, ref_lengths, backend: as in :func:`knn`.

    Returns:
        dists: [..., M, max_neighbors] ascending, +inf padded; differentiable.
        idx: [..., M, max_neighbors] int64, -1 padded; ties to the smaller index.
        counts: [..., M] int64, the number of references within the radius before the cap
            (counts > max_neighbors means the list was truncated).

    Raises:
        TypeError, ValueError: as in :func:`knn`; radius negative or non-finite.

    Example:
        >>> ref = torch.rand(1000, 3)
        >>> dists, idx, counts = fullgraph.radius(torch.rand(10, 3), ref, 0.1, max_neighbors=16)
        >>> bool((counts >= (idx >= 0).sum(-1)).all())
        True
    """
    query, ref, unbatched = _points(query, ref, query_lengths, ref_lengths)
    radius = _validate.real("radius", radius, minimum=0.0, strict=False)
    max_neighbors = _validate.integer("max_neighbors", max_neighbors, minimum=1)
    backend = _backend(backend, query, max_neighbors, "radius")
    result = torch.ops.fullgraph.radius(query, ref, radius, max_neighbors, query_lengths, ref_lengths, backend)
    return _unbatch(result, unbatched)


def knn_aggregate(query, ref, features, k, *, sigma=0.1, query_lengths=None, ref_lengths=None, backend="auto"):
    """Features of the k nearest references, softmax-weighted by distance.

    ``out[m] = sum_j softmax_j(-d_mj / sigma) * features[idx_mj]`` over the k nearest
    valid references (fewer if fewer exist; a query with none gets 0).

    Args:
        query: [M, D] or [B, M, D] floating; ref: [N, D] or [B, N, D].
        features: [N, C] or [B, N, C], same dtype and device as ref.
        k: >= 1. sigma: temperature in coordinate units, > 0.
        query_lengths, ref_lengths, backend: as in :func:`knn`.

    Returns:
        [..., M, C] in the input dtype, differentiable w.r.t. query, ref and features.

    Example:
        >>> ref, feats = torch.randn(500, 3), torch.randn(500, 8)
        >>> fullgraph.knn_aggregate(torch.randn(20, 3), ref, feats, k=7).shape
        torch.Size([20, 8])
    """
    k = _validate.integer("k", k, minimum=1)
    query, ref, features, sigma, backend, unbatched = _aggregate_inputs(
        query, ref, features, sigma, query_lengths, ref_lengths, backend, "knn_aggregate", k)
    if backend == "cuml":
        out = rapids.knn_aggregate(query, ref, features, k, sigma, query_lengths, ref_lengths)
        return out[0] if unbatched else out
    out, _, _ = torch.ops.fullgraph.knn_aggregate(
        query, ref, features, k, sigma, query_lengths, ref_lengths, backend
    )
    return out[0] if unbatched else out


def radius_aggregate(query, ref, features, radius, *, sigma=0.1, query_lengths=None, ref_lengths=None,
                     backend="auto"):
    """Features of **all** references within ``radius``, weighted by exp(-d / sigma).

    ``out[m] = sum_{d_mj <= radius} w_mj features[j] / sum w_mj`` with
    ``w_mj = exp(-(d_mj - min_j d_mj) / sigma)`` (the shift cancels; it keeps the sum
    from underflowing). No cap on the neighbour count; a query with none gets 0.

    Args:
        query: [M, D] or [B, M, D] floating; ref: [N, D] or [B, N, D].
        features: [N, C] or [B, N, C], same dtype and device as ref.
        radius: finite float >= 0 (inclusive). sigma: > 0, coordinate units.
        query_lengths, ref_lengths, backend: as in :func:`knn`.

    Returns:
        [..., M, C] in the input dtype, differentiable w.r.t. query, ref and features.

    Example:
        >>> ref, feats = torch.rand(500, 3), torch.randn(500, 8)
        >>> fullgraph.radius_aggregate(torch.rand(20, 3), ref, feats, radius=0.2).shape
        torch.Size([20, 8])
    """
    query, ref, features, sigma, backend, unbatched = _aggregate_inputs(
        query, ref, features, sigma, query_lengths, ref_lengths, backend, "radius_aggregate")
    radius = _validate.real("radius", radius, minimum=0.0, strict=False)
    out = torch.ops.fullgraph.radius_aggregate(
        query, ref, features, radius, sigma, query_lengths, ref_lengths, backend
    )
    return out[0] if unbatched else out
