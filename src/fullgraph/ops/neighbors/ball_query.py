"""PyTorch3D's ``ball_query``: up to K points of p2 within a radius of each point of p1.

PyTorch3D returns the *first* K points found (in index order, unsorted by distance), with
squared distances; ``fullgraph.radius`` returns the *nearest* K with distances. Both are
here: ``order="first"`` gives PyTorch3D's lists, ``order="nearest"`` fullgraph's, in
PyTorch3D's output format. Differences: inclusion is ``d <= radius`` (PyTorch3D compares
``d^2 < radius^2``), and points with non-finite coordinates are never neighbours.
"""

from __future__ import annotations

import torch

from ... import _contract, _validate
from . import api, reference, registration
from .registration import check_clouds


@torch.library.custom_op("fullgraph::first_within", mutates_args=())
def _first_within(p1: torch.Tensor, p2: torch.Tensor, K: int, radius: float, lengths1: torch.Tensor | None,
                  lengths2: torch.Tensor | None) -> torch.Tensor:
    """idx [B, P1, K]: the K smallest indices of p2 within the radius (-1 padded), no host
    read. An operator: its blocks follow the sizes, which compiled code need not see."""
    batch, rows, _ = p1.shape
    columns = p2.shape[1]
    idx = torch.full((batch, rows, K), -1, dtype=torch.int64, device=p1.device)
    take = min(K, columns)
    column = torch.arange(columns, device=p1.device)
    with torch.no_grad():
        for items, chunk, _, ok, _ in reference.distance_blocks(p1, p2, radius, lengths1, lengths2):
            _, order = torch.topk(torch.where(ok, column, column + columns), take, dim=-1, largest=False, sorted=True)
            idx[items, chunk, :take] = order.masked_fill(~ok.gather(-1, order), -1)
    return idx


@_first_within.register_fake
def _(p1, p2, K, radius, lengths1, lengths2):
    return p1.new_empty((*p1.shape[:2], K), dtype=torch.int64)


def _check_ball_query(p1, p2, lengths1=None, lengths2=None, K=500, radius=0.2, return_nn=True, *, order="first",
                      backend="auto") -> None:
    check_clouds(p1, p2, lengths1, lengths2)
    registration.check_list_width("K", _validate.integer("K", K, minimum=1), p2.shape[1])
    _validate.real("radius", radius, minimum=0.0, strict=False)
    _validate.choice("order", order, ("first", "nearest"))
    if not isinstance(return_nn, bool):
        raise TypeError(f"return_nn: expected a bool, got {_validate._describe(return_nn)}")
    if order == "nearest":
        registration.BACKENDS.resolve(backend, "radius", p1.device, p1.dtype, p1.shape[-1], K, "p1", "K")


@_contract.checked(_check_ball_query, outputs=3)
def ball_query(p1, p2, lengths1=None, lengths2=None, K=500, radius=0.2, return_nn=True, *, order="first",
               backend="auto"):
    """Neighbours within ``radius``: PyTorch3D's ``ball_query`` arguments and outputs.

    Args:
        p1: [B, P1, D] queries; p2: [B, P2, D] points searched (same dtype and device).
        lengths1, lengths2: [B] int64 valid prefixes (None: all). K: neighbours per query, >= 1.
        radius: finite float >= 0 (inclusive). return_nn: also return the neighbours' coordinates.
        order: "first" (PyTorch3D: the K smallest indices within the radius, in index order)
            or "nearest" (fullgraph.radius: the K nearest, ascending; backend as there).

    Returns:
        dists [B, P1, K] squared distances (0 padded; differentiable w.r.t. p1 and p2),
        idx [B, P1, K] int64 (-1 padded), nn [B, P1, K, D] (zeros padded) or None.
    """
    if order == "nearest":
        _, idx, _ = api.radius(p1, p2, radius, K, query_lengths=lengths1, ref_lengths=lengths2, backend=backend)
    else:
        idx = _first_within(p1, p2, K, radius, lengths1, lengths2)
    nn = api.knn_gather(p2, idx)
    found = idx >= 0
    dists = torch.where(found, (p1[:, :, None, :] - nn).square().sum(-1), 0)
    return dists, idx, (nn if return_nn else None)

