"""Property-based tests: every neighbour op and backend against a float64 oracle, values and
gradients, over shapes, dtypes, ragged batches and the placement of NaN / inf / duplicates.

The "ci" profile (the default) is derandomized with a fixed number of examples, so CI is
repeatable and bounded; HYPOTHESIS_PROFILE=thorough draws many more, randomly.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fullgraph
from conftest import DEVICES, backends_for, oracle_distances, oracle_nearest

settings.register_profile("ci", derandomize=True, max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

SIGMA, RADIUS = 0.3, 0.6


@st.composite
def clouds(draw, dtypes=(torch.float32, torch.float64)):
    """(query [B, M, D], ref [B, N, D], features [B, N, C], lengths or None, dtype)."""
    batch = draw(st.integers(1, 2))
    rows, columns = draw(st.integers(0, 9)), draw(st.integers(0, 14))
    dim = draw(st.sampled_from([1, 2, 3, 5]))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    generator = torch.Generator().manual_seed(seed)
    query = torch.rand(batch, rows, dim, generator=generator, dtype=torch.float64)
    ref = torch.rand(batch, columns, dim, generator=generator, dtype=torch.float64)
    features = torch.randn(batch, columns, 3, generator=generator, dtype=torch.float64)
    if columns > 1 and draw(st.booleans()):  # duplicated references: exact ties
        ref[:, columns // 2] = ref[:, 0]
    if rows and columns and draw(st.booleans()):  # a query sitting on a reference
        query[:, 0] = ref[:, columns - 1]
    for cloud in (query, ref):
        if cloud.shape[1] and draw(st.booleans()):
            row = draw(st.integers(0, cloud.shape[1] - 1))
            cloud[:, row, draw(st.integers(0, dim - 1))] = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
    lengths = None
    if draw(st.booleans()):
        lengths = (torch.tensor([draw(st.integers(0, rows)) for _ in range(batch)]),
                   torch.tensor([draw(st.integers(0, columns)) for _ in range(batch)]))
    return query.to(dtype), ref.to(dtype), features.to(dtype), lengths, dtype


def _backends(device, dtype, op):
    names = backends_for(device, dtype)
    if op.startswith("knn"):
        names.append("dense")
    return names


def _oracle_lists(query, ref, lengths, k, radius=math.inf):
    """Per item: (dists [M, k], idx [M, k], counts [M]) of the float64 oracle."""
    out = []
    for b in range(query.shape[0]):
        ql, rl = (None, None) if lengths is None else (int(lengths[0][b]), int(lengths[1][b]))
        d = oracle_distances(query[b], ref[b], ql, rl)
        out.append((d, *oracle_nearest(d, k, radius)))
    return out


def _differentiable_oracle(op, query, ref, features, lengths, k):
    """The op's output in float64 torch arithmetic on the oracle's neighbour sets (so that
    autograd gives the oracle's gradients)."""
    q, r, f = (t.detach().double().requires_grad_() for t in (query, ref, features))
    rows = []
    for b, (d, dists, idx, _) in enumerate(_oracle_lists(query, ref, lengths, k, RADIUS if "radius" in op else math.inf)):
        if op.startswith("radius"):
            mask = torch.from_numpy(np.isfinite(d) & (d <= RADIUS))
        else:
            mask = torch.zeros(d.shape, dtype=torch.bool)
            for i, chosen in enumerate(idx):
                mask[i, torch.from_numpy(chosen[chosen >= 0])] = True
        safe_q = torch.where(torch.isfinite(q[b]), q[b], 0)
        safe_r = torch.where(torch.isfinite(r[b]), r[b], 0)
        diff = safe_q[:, None, :] - safe_r[None, :, :]
        squared = (diff * diff).sum(-1)
        dist = torch.sqrt(torch.where(mask & (squared > 0), squared, 1)) * (squared > 0)
        if op in ("knn", "radius"):
            found = torch.from_numpy(idx >= 0)
            padded = torch.cat([dist, dist.new_zeros(dist.shape[0], 1)], 1)  # column N: the missing slots
            lists = padded.gather(1, torch.from_numpy(np.where(idx >= 0, idx, d.shape[1])))
            rows.append(torch.where(found, lists, 0))
        else:
            # One extra column that no query uses keeps every reduction defined when N = 0.
            mask = torch.cat([mask, mask.new_zeros(mask.shape[0], 1)], 1)
            dist = torch.cat([dist, dist.new_zeros(dist.shape[0], 1)], 1)
            feats = torch.cat([f[b], f.new_zeros(1, f.shape[-1])])
            low = torch.where(mask, dist, math.inf).amin(1, keepdim=True)
            low = torch.where(torch.isfinite(low), low, 0)
            w = torch.where(mask, torch.exp(-(torch.where(mask, dist, 0) - low) / SIGMA), 0)
            total = w.sum(1, keepdim=True)
            rows.append((w @ torch.where(mask.any(0)[:, None], feats, 0)) / torch.where(total > 0, total, 1))
    return torch.stack(rows), (q, r, f)


def _ours(op, backend, query, ref, features, lengths, k):
    q, r, f = (t.detach().clone().requires_grad_() for t in (query, ref, features))
    kw = {} if lengths is None else dict(query_lengths=lengths[0], ref_lengths=lengths[1])
    if op == "knn":
        d, idx = fullgraph.knn(q, r, k, backend=backend, **kw)
        out = torch.where(idx >= 0, d, 0)
    elif op == "radius":
        d, idx, _ = fullgraph.radius(q, r, RADIUS, k, backend=backend, **kw)
        out = torch.where(idx >= 0, d, 0)
    elif op == "knn_aggregate":
        out = fullgraph.knn_aggregate(q, r, f, k, sigma=SIGMA, backend=backend, **kw)
    else:
        out = fullgraph.radius_aggregate(q, r, f, RADIUS, sigma=SIGMA, backend=backend, **kw)
    return out, (q, r, f)


def _grads(out, leaves):
    weights = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).reshape(out.shape).to(out.device)
    grads = torch.autograd.grad((out * weights).sum(), leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]


TOL = {torch.float64: dict(rtol=1e-9, atol=1e-9), torch.float32: dict(rtol=2e-4, atol=2e-4)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["knn", "radius", "knn_aggregate", "radius_aggregate"])
@given(data=clouds(), k=st.integers(1, 6), pick=st.integers(0, 3))
def test_matches_the_float64_oracle(device, op, data, k, pick):
    query, ref, features, lengths, dtype = data
    names = _backends(device, dtype, op)
    backend = names[pick % len(names)]
    if lengths is not None:
        lengths = tuple(t.to(device) for t in lengths)
    expected, oracle_leaves = _differentiable_oracle(op, query, ref, features, lengths, k)
    moved = [t.to(device) for t in (query, ref, features)]
    out, leaves = _ours(op, backend, *moved, lengths, k)
    tol = TOL[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), expected.detach(), **tol)
    if not query.numel() or not ref.numel():
        return
    got = _grads(out, leaves)
    want = _grads(expected, oracle_leaves)
    for name, g, w in zip(("query", "ref", "features"), got, want):
        # Where a coordinate is not finite the point takes no part: its gradient is 0 in the oracle too.
        assert torch.isfinite(g).all(), f"{backend}: grad of {name} is not finite"
        torch.testing.assert_close(g.cpu().double(), w, **tol, msg=lambda m: f"{backend} grad {name}: {m}")
