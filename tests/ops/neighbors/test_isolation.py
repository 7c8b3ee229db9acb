"""Non-finite values stay where they belong: the isolation matrix.

For every op, backend, place of the bad value (a query coordinate, a reference coordinate,
a feature) and value (NaN, +inf): the results and gradients of every query that does not
use the bad point equal those of the clean run, nothing else turns non-finite, and the
bad point's own results are the documented ones (no neighbours, not a neighbour).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import fullgraph
from conftest import DEVICES, backends_for

RADIUS, K, CAP, SIGMA = 0.3, 5, 8, 0.2
BAD = 0  # padded slots point at row 0: the most exposed row
OPS = {
    "knn": lambda q, r, f, b: _finite_dists(fullgraph.knn(q, r, K, backend=b)[0]),
    "knn_padded": lambda q, r, f, b: _finite_dists(fullgraph.knn(q, r, r.shape[0] + 3, backend=b)[0]),
    "radius": lambda q, r, f, b: _finite_dists(fullgraph.radius(q, r, RADIUS, CAP, backend=b)[0]),
    "knn_aggregate": lambda q, r, f, b: fullgraph.knn_aggregate(q, r, f, K, sigma=SIGMA, backend=b),
    "radius_aggregate": lambda q, r, f, b: fullgraph.radius_aggregate(q, r, f, RADIUS, sigma=SIGMA, backend=b),
}
SEARCH_OPS = ("knn", "knn_padded", "radius")


def _finite_dists(dists):
    return torch.where(torch.isfinite(dists), dists, 0)


def _backends(device: str, op: str) -> list[str]:
    names = backends_for(device)
    if op.startswith("knn"):
        names.append("dense")
    if device == "cuda" and op.startswith("radius") and importlib.util.find_spec("warp") is not None:
        names.append("warp")
    return names


def _cases():
    for device in DEVICES:
        for op in OPS:
            places = ("query", "ref", "features") if "aggregate" in op else ("query", "ref")
            for backend in _backends(device, op):
                for place in places:
                    for value in (math.nan, math.inf):
                        yield pytest.param(op, backend, device, place, value,
                                           id=f"{op}-{backend}-{device}-{place}-{value}")


def _inputs(device):
    generator = torch.Generator().manual_seed(7)
    query = torch.rand(12, 3, generator=generator)
    ref = torch.rand(20, 3, generator=generator)
    ref[BAD] = query[BAD] + 0.01  # the bad reference is somebody's nearest neighbour
    features = torch.randn(20, 4, generator=generator)
    return [t.to(device) for t in (query, ref, features)]


def _run(op, backend, query, ref, features):
    """Output and gradients of query, ref, features for a loss that weighs every output."""
    leaves = [t.detach().clone().requires_grad_() for t in (query, ref, features)]
    out = OPS[op](*leaves, backend)
    weights = torch.linspace(0.5, 1.5, out.numel(), device=out.device).reshape(out.shape)
    grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return out.detach(), grads


def _users(op, query, ref, place):
    """Boolean [M]: the queries whose results use the bad point (from the clean clouds)."""
    if place == "query":
        return torch.arange(query.shape[0], device=query.device) == BAD
    d = torch.cdist(query.double(), ref.double())
    if op.startswith("radius"):
        return d[:, BAD] <= RADIUS
    width = ref.shape[0] if op == "knn_padded" else K
    return (d.argsort(dim=1)[:, :width] == BAD).any(1)


@pytest.mark.parametrize("op, backend, device, place, value", list(_cases()))
def test_a_non_finite_value_touches_only_its_users(op, backend, device, place, value):
    query, ref, features = _inputs(device)
    clean_out, clean_grads = _run(op, backend, query, ref, features)
    bad = {"query": query, "ref": ref, "features": features}[place].clone()
    if place == "features":
        bad[BAD, 1] = value  # one channel of one feature row
    else:
        bad[BAD, 0] = value
    inputs = {"query": query, "ref": ref, "features": features, place: bad}
    out, grads = _run(op, backend, inputs["query"], inputs["ref"], inputs["features"])

    users = _users(op, query, ref, place)
    others = ~users
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[others], clean_out[others], **tol)
    torch.testing.assert_close(grads[0][others], clean_grads[0][others], **tol)
    if place == "features":
        assert not torch.isfinite(out[users][:, 1]).any(), "a user of a bad feature must see it"
        torch.testing.assert_close(out[users][:, [0, 2, 3]], clean_out[users][:, [0, 2, 3]], **tol)
        assert torch.isfinite(grads[2]).all(), "feature gradients are weights times finite output gradients"
    else:
        assert torch.isfinite(out).all(), f"{place} {value}: a bad point must drop out, not spread"
        for name, grad in zip(("query", "ref", "features"), grads):
            assert torch.isfinite(grad).all(), f"grad of {name} turned non-finite"
    if place == "query":
        assert (out[BAD] == 0).all(), "a bad query has no neighbours"
