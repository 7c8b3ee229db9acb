"""PyTorch3D's point-cloud operators on fullgraph's: ``from fullgraph.compat.pytorch3d import
knn_points, knn_gather, ball_query, sample_farthest_points`` in place of
``from pytorch3d.ops import ...``.

Same signatures, defaults and return types (``knn_points`` and ``ball_query`` return the
``KNN`` named tuple: dists, idx, knn), with PyTorch3D's padding: ``knn_points`` pads dists
and idx with 0 beyond an item's points, ``ball_query`` pads idx with -1 and dists with 0,
``sample_farthest_points`` pads idx with -1 and points with 0. Differences:

- ``knn_points(..., return_sorted=False)`` returns the K nearest in reference order (PyTorch3D:
  whatever order its kernel leaves); ``version`` is accepted and not used.
- ``norm=1`` runs a dense PyTorch search (memory B x P1 x P2); ``norm=2`` runs
  ``fullgraph.knn``, then the squared distances are recomputed from the points so that
  their gradients are PyTorch's own.
- ``sample_farthest_points`` never samples a point with a non-finite coordinate; it keeps the
  points' dtype (PyTorch3D converts to float32).
"""

from __future__ import annotations

import math
from collections import namedtuple

import torch

from ..ops.neighbors import api
from ..ops.neighbors import ball_query as _fullgraph_ball_query
from ..ops.sampling import api as _sampling

__all__ = ["KNN", "ball_query", "knn_gather", "knn_points", "sample_farthest_points"]

KNN = namedtuple("KNN", "dists idx knn")
_KNN = KNN  # PyTorch3D's own name


def _full_lengths(points: torch.Tensor, lengths, name: str) -> torch.Tensor:
    batch, size = points.shape[:2]
    if lengths is None:
        return torch.full((batch,), size, dtype=torch.int64, device=points.device)
    if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name}: expected [{batch}] lengths (one per cloud), got "
                         f"{tuple(lengths.shape) if isinstance(lengths, torch.Tensor) else type(lengths).__name__}")
    return lengths.to(device=points.device, dtype=torch.int64)


def _gathered(points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """points [B, P, D] at idx [B, L, K] (-1 read as 0): [B, L, K, D], differentiable."""
    batch, rows, k = idx.shape
    flat = idx.clamp(min=0).reshape(batch, rows * k, 1).expand(-1, -1, points.shape[2])
    return points.gather(1, flat).reshape(batch, rows, k, points.shape[2])


def _nearest_l1(p1, p2, lengths1, lengths2, K):
    gaps = (p1[:, :, None, :] - p2[:, None, :, :]).abs().sum(-1)
    outside = torch.arange(p2.shape[1], device=p2.device)[None, None, :] >= lengths2[:, None, None]
    order = gaps.detach().masked_fill(outside, torch.inf).sort(dim=-1, stable=True).indices[..., :K]
    return torch.where(order < lengths2[:, None, None], order, -1)


def knn_points(p1, p2, lengths1=None, lengths2=None, norm: int = 2, K: int = 1, version: int = -1,
               return_nn: bool = False, return_sorted: bool = True) -> KNN:
    """The K nearest points of p2 [B, P2, D] to each point of p1 [B, P1, D].

    Returns ``KNN(dists, idx, knn)``: dists [B, P1, K] squared Euclidean (``norm=2``) or L1
    (``norm=1``) distances, ascending, differentiable w.r.t. p1 and p2; idx [B, P1, K]
    int64; both 0 beyond an item's ``lengths2`` points and at queries beyond ``lengths1``;
    knn [B, P1, K, D] the neighbours (``return_nn``; zeros where padded) or None.
    """
    if norm not in (1, 2):
        raise ValueError("Support for 1 or 2 norm.")
    if not isinstance(p1, torch.Tensor) or not isinstance(p2, torch.Tensor) or p1.dim() != 3 or p2.dim() != 3:
        raise ValueError("p1, p2: expected [B, P, D] tensors")
    if p1.shape[0] != p2.shape[0] or p1.shape[2] != p2.shape[2]:
        raise ValueError(f"pts1 and pts2 must have the same batch dimension and point dimension, got "
                         f"{tuple(p1.shape)} and {tuple(p2.shape)}")
    if isinstance(K, bool) or not isinstance(K, int) or K < 1:
        raise ValueError(f"K: expected an int >= 1, got {K!r}")
    lengths1 = _full_lengths(p1, lengths1, "lengths1")
    lengths2 = _full_lengths(p2, lengths2, "lengths2")
    width = min(K, max(p2.shape[1], 1))
    if norm == 2:
        _, idx = api.knn(p1.detach(), p2.detach(), width, query_lengths=lengths1, ref_lengths=lengths2)
    else:
        idx = _nearest_l1(p1, p2, lengths1, lengths2, width)
    queries = torch.arange(p1.shape[1], device=p1.device)[None, :, None] < lengths1[:, None, None]
    found = (idx >= 0) & queries
    if not return_sorted and width > 1:  # reference order, padding last
        key = torch.where(found, idx, p2.shape[1])
        idx = key.sort(-1).values
        found = idx < p2.shape[1]
    idx = torch.where(found, idx, 0)
    diff = p1[:, :, None, :] - _gathered(p2, idx)
    dists = diff.square().sum(-1) if norm == 2 else diff.abs().sum(-1)
    dists = torch.where(found, dists, 0)
    if width < K:
        dists = torch.nn.functional.pad(dists, (0, K - width))
        idx = torch.nn.functional.pad(idx, (0, K - width))
    nn = knn_gather(p2, idx, lengths2) if return_nn else None
    return KNN(dists=dists, idx=idx, knn=nn)


def knn_gather(x, idx, lengths=None):
    """x [B, M, U] at idx [B, L, K]: [B, L, K, U], zeros at slots k >= lengths[b]."""
    out = _gathered(x, idx)
    if lengths is not None:
        outside = torch.arange(idx.shape[2], device=idx.device)[None, :] >= lengths.to(idx.device)[:, None]
        out = out.masked_fill(outside[:, None, :, None], 0.0)
    return out


def ball_query(p1, p2, lengths1=None, lengths2=None, K: int = 500, radius: float = 0.2,
               return_nn: bool = True) -> KNN:
    """The first K points of p2 closer than ``radius`` to each point of p1, in index
    order: ``KNN(dists, idx, knn)`` with squared distances (0 padded), idx (-1 padded) and
    the neighbours (zeros padded; None without ``return_nn``). See ``fullgraph.ball_query``."""
    if isinstance(radius, (int, float)) and not isinstance(radius, bool) and radius > 0:
        radius = math.nextafter(float(radius), 0.0)  # PyTorch3D's d < radius (fullgraph's: d <= radius)
    dists, idx, nn = _fullgraph_ball_query(p1, p2, lengths1, lengths2, K, radius, return_nn)
    return KNN(dists=dists, idx=idx, knn=nn)


def sample_farthest_points(points, lengths=None, K=50, random_start_point: bool = False):
    """Farthest-point sampling of each cloud of points [N, P, D] (its first ``lengths[i]``
    points): K samples (an int, or one per cloud as a list or [N] tensor).

    Returns (selected_points [N, max K, D], selected_indices [N, max K] int64), padded with
    0.0 / -1 beyond a cloud's K or its points. Starts at each cloud's first point, or a
    random one with ``random_start_point``.
    """
    if not isinstance(points, torch.Tensor) or points.dim() != 3:
        raise ValueError("points: expected a [N, P, D] tensor")
    batch, size, _ = points.shape
    if lengths is not None:  # (its values are checked by the operator)
        if not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (batch,):
            raise ValueError("points and lengths must have same batch dimension.")
        lengths = lengths.to(device=points.device, dtype=torch.int64)
    counts = None
    if isinstance(K, int) and not isinstance(K, bool):
        count = K
    elif isinstance(K, (list, tuple, torch.Tensor)):
        counts = torch.as_tensor(K, dtype=torch.int64, device=points.device).reshape(-1)
        if counts.shape[0] != batch:
            raise ValueError("K and points must have the same batch dimension")
        count = max(K) if isinstance(K, (list, tuple)) else int(counts.max())  # a tensor K: one host read
    else:
        raise TypeError(f"K: expected an int, a list or a tensor, got {type(K).__name__}")
    if count < 1:
        raise ValueError(f"K: expected at least one sample, got {K!r}")
    idx = _sampling.farthest_points(points.detach(), lengths, count, random_start_point, None)
    if counts is not None:
        idx = torch.where(torch.arange(count, device=points.device)[None, :] < counts[:, None], idx, -1)
    selected = _gathered(points, idx[:, :, None])[:, :, 0]
    return selected.masked_fill((idx < 0)[..., None], 0.0), idx
