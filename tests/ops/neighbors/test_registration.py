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
@pytest.mark.interpreted(keep=0)
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
    # radius and sigma as 0-d tensors, read when the operator runs (the same kernels after
    # the read: checked on every backend but interpreted Triton, ~15 s more on a CPU)
    scalar = torch.tensor(0.4, dtype=torch.float64), torch.tensor(0.2, dtype=torch.float64)
    cases += [] if (backend, device) == ("triton", "cpu") else [
        (ops.radius.default, (q, r, 0.0, 3, query_lengths, ref_lengths, backend, scalar[0])),
        (ops.knn_aggregate.default, (q, r, f, 4, 0.0, query_lengths, ref_lengths, backend, scalar[1])),
        (ops.radius_aggregate.default, (q, r, f, 0.0, 0.0, None, ref_lengths, backend, *scalar)),
        (ops.knn_aggregate_backward.default, (torch.randn_like(out), features, out, kd, kidx, 0.0, backend,
                                              scalar[1])),
        (ops.radius_aggregate_backward.default,
         (torch.randn_like(out), query, ref, features, out, 0.0, 0.0, None, None, backend, *scalar)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_radius_and_sigma_as_tensors_take_new_values_without_recompiling(generator):
    """A multi-scale model or a radius schedule: radius and sigma passed as 0-d tensors reach
    the compiled graph as inputs (one frame for every value); values and gradients equal the
    calls with Python numbers, which are constants of the graph (a new number recompiles)."""
    from torch._dynamo.testing import CompileCounter

    def step(query, ref, features, radius, sigma):
        out = fullgraph.knn_aggregate(query, ref, features, 5, sigma=sigma)
        out = out + fullgraph.radius_aggregate(query, ref, features, radius, sigma=sigma)
        rd, ridx, counts = fullgraph.radius(query, ref, radius, 6)
        return out.sum(-1) + counts + rd.masked_fill(ridx < 0, 0).sum(-1)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    query = points("uniform", 40, 3, generator).double().requires_grad_()
    ref = points("uniform", 150, 3, generator).double().requires_grad_()
    features = torch.randn(150, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    for radius, sigma in [(0.2, 0.1), (0.35, 0.05), (0.5, 0.3)]:
        got = compiled(query, ref, features, torch.tensor(radius, dtype=torch.float64),
                       torch.tensor(sigma, dtype=torch.float64))
        want = step(query, ref, features, radius, sigma)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        for g, w in zip(torch.autograd.grad(got.sum(), (query, ref, features)),
                        torch.autograd.grad(want.sum(), (query, ref, features))):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert counter.frame_count == 1
    numbers = CompileCounter()
    by_number = torch.compile(step, backend=numbers, fullgraph=True, dynamic=True)
    for radius in (0.2, 0.35):
        by_number(query, ref, features, radius, 0.1)
    assert numbers.frame_count == 2  # what the README says still recompiles


@pytest.mark.parametrize("compiled", [False, True])
def test_radius_and_sigma_tensors_are_checked(compiled, generator):
    query, ref = points("uniform", 10, 3, generator).float(), points("uniform", 30, 3, generator).float()
    features = torch.randn(30, 2, generator=generator)
    call = (lambda f: torch.compile(f, backend="eager", fullgraph=True)) if compiled else (lambda f: f)
    cases = [
        (lambda: fullgraph.radius(query, ref, torch.tensor([0.1, 0.2]), 4), ValueError,
         r"radius: expected a number or a 0-d tensor, got a tensor of shape \[2\]"),
        (lambda: fullgraph.radius(query, ref, torch.tensor(1), 4), TypeError,
         "radius: expected a floating-point 0-d tensor, got torch.int64"),
        (lambda: fullgraph.radius(query, ref, torch.tensor(-0.5), 4), ValueError, "radius"),
        (lambda: fullgraph.knn_aggregate(query, ref, features, 3, sigma=torch.tensor(1e-45)), ValueError,
         "sigma: expected >= "),
        (lambda: fullgraph.radius_aggregate(query, ref, features, 0.2, sigma=torch.tensor(float("nan"))), ValueError,
         "sigma"),
    ]
    for fn, error, message in cases:
        with pytest.raises(error, match=message):
            call(fn)()


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
    from fullgraph.ops.neighbors.cpu import backend as cpu

    ref, points_ = points("uniform", 50, 3, generator), points("uniform", 7, 3, generator)
    extern.check(cpu._kdtree_knn, ref, points_, 4, math.inf)
    extern.check(cpu._kdtree_ball_counts, ref, points_, 0.4)
    total = int(cpu._kdtree_ball_counts(ref, points_, 0.4).sum())
    extern.check(cpu._kdtree_ball, ref, points_, 0.4, total)
    with pytest.raises(extern.ExternError, match="output 0 came back as"):
        cpu._kdtree_ball(ref, points_, 0.4, total + 1)
