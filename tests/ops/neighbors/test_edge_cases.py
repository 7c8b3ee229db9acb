"""Edge cases: references exactly on the radius, tiny sigma, huge radii, argument names."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from conftest import backend_cases
from fullgraph.ops.neighbors import pairs


@pytest.mark.parametrize("backend, device", backend_cases())
def test_counts_agree_with_the_list_on_the_radius(backend, device, generator):
    """Inclusivity is one comparison (d <= radius, on the distances the backend returns) in
    the list and in the counts; radii are set to distances the backend's own kNN returns, so
    points lie exactly on them."""
    # Triton's interpreter takes ~20 s a trial on the 2-core CPU: 2 trials there, 12 elsewhere.
    for trial in range(2 if backend == "triton" and device == "cpu" else 12):
        query = torch.rand(30, 3, generator=generator).to(device)
        ref = torch.rand(200, 3, generator=generator).to(device)
        d, _ = fullgraph.knn(query, ref, 64, backend=backend)
        radius = float(d[trial, trial * 5])
        dists, idx, counts = fullgraph.radius(query, ref, radius, 64, backend=backend)
        listed = d[:, -1] > radius  # rows whose kNN list holds every point within the radius
        assert torch.equal(counts[listed].cpu(), (d <= radius).sum(-1)[listed].cpu())
        assert (counts[~listed] >= 64).all()
        assert torch.equal((idx >= 0).sum(-1).cpu(), counts.clamp(max=64).cpu())
        assert (dists[idx >= 0] <= radius).all()
    if backend != "triton":  # and those distances are the pair arithmetic's (Triton sums in its own order)
        exact = pairs.pair_distances(query[:, None, :], ref[None, :, :])
        torch.testing.assert_close(d, exact.sort(-1).values[:, :64], rtol=0, atol=0)


def test_sigma_below_the_arithmetic_is_refused():
    q, r, f = torch.rand(5, 3), torch.rand(9, 3), torch.rand(9, 2)
    with pytest.raises(ValueError, match="sigma: expected >= 1.18e-38 .*float32.*got 1e-46"):
        fullgraph.knn_aggregate(q, r, f, 2, sigma=1e-46)
    with pytest.raises(ValueError, match="sigma: expected >= "):
        torch.ops.fullgraph.radius_aggregate(q[None], r[None], f[None], 0.3, 1e-46, None, None, "torch")
    out = fullgraph.knn_aggregate(q.double(), r.double(), f.double(), 2, sigma=1e-300)  # fine in float64
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend, device", backend_cases())
def test_huge_radius_takes_everything(backend, device):
    query, ref = torch.rand(7, 3, device=device), torch.rand(40, 3, device=device)
    features = torch.randn(40, 2, device=device)
    dists, idx, counts = fullgraph.radius(query, ref, 1.3e200, 40, backend=backend)
    assert (counts == 40).all() and (idx >= 0).all()
    want = fullgraph.radius_aggregate(query, ref, features, 1e3, backend="torch")
    torch.testing.assert_close(fullgraph.radius_aggregate(query, ref, features, 1e200, backend=backend), want)


def test_the_cap_is_named_as_the_caller_names_it():
    from fullgraph.ops.neighbors.registration import BACKENDS

    with pytest.raises(ValueError, match='max_neighbors: backend="triton" supports up to 64 neighbours, got 65'):
        BACKENDS.get("triton").check("radius", "cuda", torch.float32, 3, 65, "query", "max_neighbors")


@pytest.mark.parametrize("backend, device", backend_cases())
def test_gradients_of_near_coincident_points_keep_their_precision(backend, device, generator):
    """Queries 1e-4 from their references, far from the origin: a gradient summed as
    r * sum(c) - sum(c q) (c ~ 1 / d) cancels to a few digits; each pair's own offset must
    be used. Compared with the float64 "torch" backend."""
    ref = 3 + torch.rand(40, 3, generator=generator, dtype=torch.float64)
    query = ref[:20] + 1e-4 * torch.randn(20, 3, generator=generator, dtype=torch.float64)
    features = torch.randn(40, 2, generator=generator, dtype=torch.float64)
    query, ref, features = (t.float().double() for t in (query, ref, features))  # exact in float32
    ops = {
        "knn": lambda q, r, f, b: fullgraph.knn(q, r, 3, backend=b)[0],
        "radius_aggregate": lambda q, r, f, b: fullgraph.radius_aggregate(q, r, f, 0.3, sigma=0.05, backend=b),
    }
    for name, op in ops.items():
        grads = []
        for dtype, chosen in ((torch.float64, "torch"), (torch.float32, backend)):
            leaves = [t.to(device, dtype).requires_grad_() for t in (query, ref, features)]
            out = op(*leaves, chosen)
            weights = torch.linspace(0.5, 1.5, out.numel(), dtype=dtype, device=device).reshape(out.shape)
            grads.append(torch.autograd.grad((out * weights).sum(), leaves[:2]))
        for want, got in zip(*grads):
            torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3, msg=lambda m: f"{name}: {m}")


def test_list_width_is_bounded_and_named():
    """k may exceed N (padding) up to max(N, 1024): k = 10**9 would allocate [M, 10**9]."""
    query, ref, features = torch.rand(6, 3), torch.rand(10, 3), torch.rand(10, 2)
    assert fullgraph.knn(query, ref, 1024)[1].shape == (6, 1024)
    for huge in (10**9, 2**62):
        with pytest.raises(ValueError, match=rf"k: expected at most max\(N, 1024\) = 1024 .* got {huge}"):
            fullgraph.knn(query, ref, huge)
        with pytest.raises(ValueError, match=r"k: expected at most"):
            fullgraph.knn_aggregate(query, ref, features, huge)
        with pytest.raises(ValueError, match=r"max_neighbors: expected at most"):
            fullgraph.radius(query, ref, 0.3, huge)
        with pytest.raises(ValueError, match=r"k: expected at most"):
            torch.ops.fullgraph.knn(query[None], ref[None], huge, None, None, "torch")


@pytest.mark.parametrize("backend, device", backend_cases())
def test_zero_feature_channels(backend, device):
    query = torch.rand(6, 3, device=device, requires_grad=True)
    ref = torch.rand(10, 3, device=device, requires_grad=True)
    features = torch.rand(10, 0, device=device, requires_grad=True)
    for out in (fullgraph.knn_aggregate(query, ref, features, 3, backend=backend),
                fullgraph.radius_aggregate(query, ref, features, 0.5, backend=backend)):
        assert out.shape == (6, 0)
        out.sum().backward()
        assert features.grad.shape == (10, 0) and torch.equal(query.grad, torch.zeros_like(query))


@pytest.mark.parametrize("backend, device", backend_cases())
@pytest.mark.parametrize("scale", [1e20, 1e-25, 1e36])
def test_far_apart_and_tiny_clouds_keep_their_order(backend, device, scale, generator):
    """Squares of float32 differences overflow beyond ~1.8e19 (every distance +inf, ties
    broken by index) and underflow below ~1e-19: the points are scaled by a power of two."""
    query = torch.randn(30, 3, generator=generator) * scale
    ref = torch.randn(200, 3, generator=generator) * scale
    want_dists, want_idx = torch.cdist(query.double(), ref.double()).topk(4, largest=False)
    dists, idx = fullgraph.knn(query.to(device), ref.to(device), 4, backend=backend)
    assert torch.equal(idx.cpu(), want_idx)
    torch.testing.assert_close(dists.cpu().double(), want_dists, rtol=1e-5, atol=0)
    features = torch.randn(200, 2, generator=generator).to(device)
    out = fullgraph.knn_aggregate(query.to(device), ref.to(device), features, 4, sigma=scale, backend=backend)
    assert torch.isfinite(out).all() and out.abs().sum() > 0
