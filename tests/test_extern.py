"""fullgraph.extern: NumPy/SciPy functions (and CuPy on GPUs) as compile-safe operators."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from fullgraph import extern


def _norm_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad[:, None] * x / torch.linalg.norm(x, dim=1, keepdim=True) * ctx.inputs[1], None


@extern.op("fgtest::scaled_norms", "(Tensor x, float scale) -> Tensor",
           outputs=lambda x, scale: [(x.shape[:1], x.dtype)], backward=_norm_backward)
def scaled_norms(x, scale):
    return np.linalg.norm(x, axis=1) * scale


@extern.op("fgtest::nearest", "(Tensor query, Tensor ref) -> (Tensor, Tensor)",
           outputs=lambda q, r: [(q.shape[:1], q.dtype), (q.shape[:1], torch.int64)])
def nearest(query, ref):
    """SciPy's k-d tree on the arrays torch handed over."""
    from scipy.spatial import cKDTree

    distances, index = cKDTree(ref).query(query, k=1)
    return distances.astype(query.dtype), index.astype(np.int64)


@extern.op("fgtest::bad_shape", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)])
def bad_shape(x):
    return x[:-1] * 2


@extern.op("fgtest::bad_dtype", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)])
def bad_dtype(x):
    return (x * 2).astype(np.float32)


@extern.op("fgtest::passthrough", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)])
def passthrough(x):
    return x


def test_numpy_function_as_an_operator():
    x = torch.rand(6, 3, dtype=torch.float64)
    torch.testing.assert_close(scaled_norms(x, 2.0), torch.linalg.norm(x, dim=1) * 2)
    extern.check(scaled_norms, x, 2.0)
    assert torch.autograd.gradcheck(lambda t: scaled_norms(t, 2.0), (x.clone().requires_grad_(),))


@pytest.mark.slow
def test_compiles_once_for_all_sizes():
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(lambda x: scaled_norms(x, 3.0).sum(), backend=counter, fullgraph=True, dynamic=True)
    for rows in (4, 7, 9):
        x = torch.rand(rows, 3, dtype=torch.float64)
        torch.testing.assert_close(compiled(x), (torch.linalg.norm(x, dim=1) * 3).sum())
    assert counter.frame_count == 1


def test_scipy_with_two_outputs():
    pytest.importorskip("scipy")
    query, ref = torch.rand(20, 3, dtype=torch.float64), torch.rand(50, 3, dtype=torch.float64)
    distances, index = nearest(query, ref)
    want = torch.cdist(query, ref).min(1)
    torch.testing.assert_close(distances, want.values)
    assert torch.equal(index, want.indices)
    extern.check(nearest, query, ref)


def test_outputs_that_break_the_spec_are_named():
    x = torch.rand(4, dtype=torch.float64)
    with pytest.raises(extern.ExternError, match=r"output 0 came back as \(3,\) torch.float64, .* declares \(4,\)"):
        bad_shape(x)
    with pytest.raises(extern.ExternError, match="came back as .*torch.float32"):
        bad_dtype(x)


def test_outputs_never_alias_inputs():
    x = torch.rand(4)
    out = passthrough(x)
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()


def test_bad_declarations_and_devices():
    with pytest.raises(ValueError, match="library: expected one of"):
        extern.op("fgtest::nope", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)], library="fortran")(abs)
    wrong = extern.op("fgtest::garbage_spec", "(Tensor x) -> Tensor", outputs=lambda x: x.shape)(lambda x: x)
    with pytest.raises(TypeError, match="outputs: expected a function returning a list of"):
        wrong(torch.rand(3))
    on_gpu = extern.op("fgtest::cupy_double", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)],
                       library="cupy")(lambda x: x * 2)
    with pytest.raises(ValueError, match="library='cupy' runs on cuda tensors, got argument 0 on cpu"):
        on_gpu(torch.rand(3))


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="cupy is installed here")
def test_a_missing_library_names_the_package():
    with pytest.raises(ImportError, match="pip install cupy"):
        extern._module("cupy")


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("cupy") is None,
                    reason="needs CUDA and CuPy")
def test_cupy_runs_on_the_current_stream_inside_a_compiled_graph():
    @extern.op("fgtest::cupy_softplus", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)],
               library="cupy")
    def softplus(x):
        import cupy

        return cupy.log1p(cupy.exp(x))

    x = torch.randn(1000, 64, device="cuda")
    torch.testing.assert_close(softplus(x), torch.nn.functional.softplus(x))
    extern.check(softplus, x)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # work ordered on a side stream, no device-wide sync
        y = softplus(x)
    stream.synchronize()
    torch.testing.assert_close(y, torch.nn.functional.softplus(x))
