"""The operators as torch.ops: opcheck, and torch.compile(fullgraph=True, dynamic=True)."""

from __future__ import annotations

import pytest
import torch

import fullgraph
from conftest import assert_compiled_model_trains, backend_cases, points


def _inputs(generator, batch=2, rows=9, columns=20, dim=3, channels=4, dtype=torch.float64):
    query = torch.stack([points("uniform", rows, dim, generator) for _ in range(batch)]).to(dtype)
    ref = torch.stack([points("uniform", columns, dim, generator) for _ in range(batch)]).to(dtype)
    features = torch.randn(batch, columns, channels, generator=generator, dtype=dtype)
    lengths = torch.tensor([rows, rows - 3]), torch.tensor([columns - 2, columns])
    return query, ref, features, lengths


@pytest.mark.parametrize("backend, device", backend_cases())
def test_opcheck(backend, device, generator):
    dtype = torch.float32 if backend == "triton" else torch.float64
    tensors = _inputs(generator, dtype=dtype)
    query, ref, features = (t.to(device) for t in tensors[:3])
    query_lengths, ref_lengths = (t.to(device) for t in tensors[3])
    q, r, f = (t.clone().requires_grad_() for t in (query, ref, features))
    ops = torch.ops.fullgraph
    cases = [
        (ops.knn.default, (q, r, 4, query_lengths, ref_lengths, backend)),
        (ops.knn.default, (q, r, 4, None, None, backend)),
        (ops.radius.default, (q, r, 0.4, 3, query_lengths, ref_lengths, backend)),
        (ops.knn_aggregate.default, (q, r, f, 4, 0.2, query_lengths, ref_lengths, backend)),
        (ops.radius_aggregate.default, (q, r, f, 0.4, 0.2, None, ref_lengths, backend)),
    ]
    dists, idx = ops.knn(query, ref, 4, None, None, backend)
    out, kd, kidx = ops.knn_aggregate(query, ref, features, 4, 0.2, None, None, backend)
    cases += [
        (ops.distances_backward.default, (torch.randn_like(dists), query, ref, idx, dists, backend)),
        (ops.knn_aggregate_backward.default, (torch.randn_like(out), features, out, kd, kidx, 0.2, backend)),
        (ops.radius_aggregate_backward.default,
         (torch.randn_like(out), query, ref, features, out, 0.4, 0.2, None, None, backend)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.slow
def test_compile_dynamic_compiles_once(generator):
    """One graph, no break, for several sizes; matches eager, with gradients."""
    from torch._dynamo.testing import CompileCounter

    def step(query, ref, features):
        out = fullgraph.knn_aggregate(query, ref, features, 5) + fullgraph.radius_aggregate(query, ref, features, 0.3)
        dists, idx = fullgraph.knn(query, ref, 3)
        rd, ridx, counts = fullgraph.radius(query, ref, 0.3, 4)
        return out.sum(-1) + dists.sum(-1) + counts + rd.masked_fill(ridx < 0, 0).sum(-1)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for rows, columns in [(30, 100), (41, 77), (17, 230)]:
        query = points("uniform", rows, 3, generator).float().requires_grad_()
        ref = points("uniform", columns, 3, generator).float().requires_grad_()
        features = torch.randn(columns, 6, generator=generator, requires_grad=True)
        got = compiled(query, ref, features)
        want = step(query, ref, features)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.sum(), (query, ref, features))
        expected = torch.autograd.grad(want.sum(), (query, ref, features))
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e)
    assert counter.frame_count == 1


@pytest.mark.slow
def test_inductor_train_step(generator):
    """A real inductor compile of a train step through the operators."""
    model = fullgraph.models.KNNProjector(k=4, hidden_dim=8)
    compiled = torch.compile(model, fullgraph=True)
    query = points("uniform", 64, 3, generator).float()
    ref = points("normal", 200, 3, generator).float()
    target = torch.randn(64, 1, generator=generator)
    assert_compiled_model_trains(model, compiled, query, ref, target)


def test_kd_tree_extern_ops_pass_opcheck(generator):
    """The CPU backend's SciPy calls are fullgraph.extern ops: each one opchecks and compiles."""
    pytest.importorskip("scipy")
    import math

    from fullgraph import extern
    from fullgraph.ops.neighbors import cpu

    ref, points_ = points("uniform", 50, 3, generator), points("uniform", 7, 3, generator)
    extern.check(cpu._kdtree_knn, ref, points_, 4, math.inf)
    extern.check(cpu._kdtree_ball_counts, ref, points_, 0.4)
    total = int(cpu._kdtree_ball_counts(ref, points_, 0.4).sum())
    extern.check(cpu._kdtree_ball, ref, points_, 0.4, total)
    with pytest.raises(extern.ExternError, match="output 0 came back as"):
        cpu._kdtree_ball(ref, points_, 0.4, total + 1)
