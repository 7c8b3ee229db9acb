"""fullgraph.extern: NumPy/SciPy functions (and CuPy on GPUs) as compile-safe operators."""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np
import pytest
import torch

from fullgraph import extern, libraries


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


@extern.op("fgtest::flipped", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)])
def flipped(x):
    return np.flip(x * 2, 0)  # negative strides: torch.from_dlpack aborts the process on them


@extern.op("fgtest::transposed", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape[::-1], x.dtype)])
def transposed(x):
    return np.asfortranarray(x * 2).T  # a view with the strides LAPACK results have


def test_negative_strided_and_transposed_outputs_come_back_as_contiguous_tensors():
    x = torch.rand(4, 3, dtype=torch.float64)
    compiled_flip = torch.compile(flipped, fullgraph=True, backend="aot_eager")
    compiled_transpose = torch.compile(transposed, fullgraph=True, backend="aot_eager")
    for got in (flipped(x), compiled_flip(x)):
        torch.testing.assert_close(got, (x * 2).flip(0))
        assert got.is_contiguous()
    for got in (transposed(x), compiled_transpose(x)):
        torch.testing.assert_close(got, (x * 2).T)
        assert got.is_contiguous()


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


MISSING = [name for name, library in libraries.LIBRARIES.items()
           if importlib.util.find_spec(library.module.split(".")[0]) is None]


@pytest.mark.skipif(not MISSING, reason="every extern library is installed here")
@pytest.mark.parametrize("name", MISSING)
def test_a_missing_library_names_the_package(name):
    with pytest.raises(ImportError, match=f"library='{name}' needs .*: pip install "):
        libraries.LIBRARIES[name].load()


def test_cuda_graph_policies():
    outputs = lambda x: [(x.shape, x.dtype)]  # noqa: E731
    tagged = extern.op("fgtest::tagged", "(Tensor x) -> Tensor", outputs=outputs, cuda_graphs="tag")(np.sin)
    assert torch.Tag.cudagraph_unsafe in tagged.op._opoverload.tags
    assert torch.Tag.cudagraph_unsafe not in scaled_norms.op._opoverload.tags
    assert extern.op("fgtest::jax_default", "(Tensor x) -> Tensor", outputs=outputs,
                     library="jax")(np.sin).cuda_graphs == "tag"
    x = torch.rand(5, dtype=torch.float64)
    torch.testing.assert_close(torch.compile(tagged, fullgraph=True)(x), torch.sin(x))  # tagged: still one graph
    broken = extern.op("fgtest::broken", "(Tensor x) -> Tensor", outputs=outputs, cuda_graphs="break")(np.cos)
    with pytest.raises(Exception, match="(?i)skip|disable|graph break"):
        torch.compile(lambda t: broken(t) + 1, fullgraph=True)(x)
    torch.testing.assert_close(torch.compile(lambda t: broken(t) + 1)(x), torch.cos(x) + 1)
    with pytest.raises(ValueError, match="cuda_graphs: expected one of"):
        extern.op("fgtest::bad_policy", "(Tensor x) -> Tensor", outputs=outputs, cuda_graphs="maybe")(np.sin)


def test_current_stream_only_inside_an_op():
    with pytest.raises(RuntimeError, match="only valid inside an extern op"):
        extern.current_stream()


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


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_numba_kernel_on_the_current_stream_and_in_a_cuda_graph():
    pytest.importorskip("numba.cuda")
    from numba import cuda

    @cuda.jit
    def axpy_kernel(out, x, y, a):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = a * x[i] + y[i]

    @extern.op("fgtest::numba_axpy", "(Tensor x, Tensor y, float a) -> Tensor",
               outputs=lambda x, y, a: [(x.shape, x.dtype)], library="numba")
    def axpy(x, y, a):
        out = cuda.device_array_like(x, stream=extern.current_stream())
        if x.size:
            axpy_kernel[(x.size + 255) // 256, 256, extern.current_stream()](out, x, y, a)
        return out

    x, y = torch.randn(10_000, device="cuda"), torch.randn(10_000, device="cuda")
    torch.testing.assert_close(axpy(x, y, 3.0), 3 * x + y)
    extern.check(axpy, x, y, 3.0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        z = axpy(x, y, -1.0)
    stream.synchronize()
    torch.testing.assert_close(z, y - x)
    # Numba allocates outside PyTorch: inside a CUDA graph only with the shared pool.
    from fullgraph import graphs, memory

    with memory.torch_pool("numba"):
        graphed = graphs.graphed(lambda a, b: axpy(a, b, 2.0))
        for _ in range(3):
            x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
            torch.testing.assert_close(graphed(x, y), 2 * x + y)


@needs_cuda
def test_warp_function_with_adjoint_backward_example():
    pytest.importorskip("warp")
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "examples" / "wrap_a_warp_kernel.py"), run_name="__main__")


@needs_cuda
def test_jax_is_kept_out_of_cuda_graphs():
    pytest.importorskip("jax")

    @extern.op("fgtest::jax_tanh", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)], library="jax")
    def jax_tanh(x):
        import jax.numpy as jnp

        return jnp.tanh(x) * 2

    x = torch.randn(1000, device="cuda")
    torch.testing.assert_close(jax_tanh(x), torch.tanh(x) * 2)
    compiled = torch.compile(lambda t: jax_tanh(t.sin()).cos(), fullgraph=True, mode="reduce-overhead")
    for _ in range(3):
        x = torch.randn(1000, device="cuda")
        torch.testing.assert_close(compiled(x), (torch.tanh(x.sin()) * 2).cos())
    with pytest.raises(extern.ExternError, match="cannot run inside a CUDA graph capture"):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            jax_tanh(x)


@needs_cuda
def test_cupy_op_is_captured_by_graphs():
    pytest.importorskip("cupy")
    from fullgraph import graphs

    @extern.op("fgtest::cupy_square", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)], library="cupy")
    def square(x):
        return x * x

    from fullgraph import memory

    with memory.torch_pool("cupy"):  # CuPy's result buffer then comes from the graph's pool
        graphed = graphs.graphed(square)
        for _ in range(3):
            x = torch.randn(512, device="cuda")
            torch.testing.assert_close(graphed(x), x * x)


def test_a_taken_name_is_refused():
    outputs = lambda x: [(x.shape, x.dtype)]  # noqa: E731
    first = extern.op("fgtest::twice", "(Tensor x) -> Tensor", outputs=outputs)(np.sin)
    with pytest.raises(ValueError, match="'fgtest::twice' is already a registered operator; pass replace=True"):
        extern.op("fgtest::twice", "(Tensor x) -> Tensor", outputs=outputs)(np.cos)
    x = torch.rand(4, dtype=torch.float64)
    torch.testing.assert_close(first(x), torch.sin(x))  # the first kernel still stands
    second = extern.op("fgtest::twice", "(Tensor x) -> Tensor", outputs=outputs, replace=True)(np.cos)
    torch.testing.assert_close(second(x), torch.cos(x))
    with pytest.raises(ValueError, match="fullgraph's own operators and cannot be replaced"):
        extern.op("fullgraph::knn", "(Tensor x) -> Tensor", outputs=outputs, replace=True)(np.sin)
    with pytest.raises(ValueError, match="not an extern op of this process"):
        extern.op("aten::sin", "(Tensor x) -> Tensor", outputs=outputs, replace=True)(np.sin)
    with pytest.raises(ValueError, match='name: expected "namespace::op_name"'):
        extern.op("no_namespace", "(Tensor x) -> Tensor", outputs=outputs)(np.sin)


def test_outputs_never_share_memory_with_inputs():
    tail = extern.op("fgtest::tail", "(Tensor x) -> Tensor",
                     outputs=lambda x: [((x.shape[0] - 1,), x.dtype)])(lambda x: x[1:])
    pair = extern.op("fgtest::pair", "(Tensor x) -> (Tensor, Tensor)",
                     outputs=lambda x: [(x.shape, x.dtype)] * 2)(lambda x: (np.sin(x),) * 2)
    x = torch.rand(6, dtype=torch.float64)
    out = tail(x)
    out.fill_(0)
    assert (x != 0).all(), "writing the output wrote the input"
    first, second = pair(x)
    assert not extern.overlaps(first, second)
    extern.check(tail, x)
    extern.check(pair, x)


@pytest.mark.parametrize("returned, what", [(None, "NoneType"), ("text", "str"),
                                            (np.array([object(), object()]), "ndarray")])
def test_non_array_outputs_are_named(returned, what):
    bad = extern.op(f"fgtest::returns_{what.lower()}", "(Tensor x) -> Tensor",
                    outputs=lambda x: [(x.shape, x.dtype)])(lambda x: returned)
    with pytest.raises(extern.ExternError, match=f"fgtest::returns_{what.lower()}: output 0 is {what}"):
        bad(torch.rand(2))


def _doubling(library, body):
    """``body`` (x -> 2x in ``library``) as the extern op fgtest::soak_<library>."""
    return extern.op(f"fgtest::soak_{library}", "(Tensor x) -> Tensor", outputs=lambda x: [(x.shape, x.dtype)],
                     library=library, replace=True)(body)


def _numba_doubling():
    from numba import cuda

    @cuda.jit
    def double(out, x):
        i = cuda.grid(1)
        if i < x.size:
            out[i] = 2 * x[i]

    def body(x):
        out = cuda.device_array_like(x, stream=extern.current_stream())
        if x.size:
            double[(x.size + 255) // 256, 256, extern.current_stream()](out, x)
        return out

    return _doubling("numba", body)


def _warp_doubling():
    import warp as wp

    @wp.kernel
    def double(x: wp.array(dtype=float), out: wp.array(dtype=float)):
        i = wp.tid()
        out[i] = 2.0 * x[i]

    def body(x):
        out = wp.empty_like(x)
        wp.launch(double, dim=x.shape, inputs=[x, out])
        return out

    return _doubling("warp", body)


def _soak_ops():
    """(library, op factory) for each GPU array library installed here: an op that doubles
    its input in that library, allocating the result there."""
    factories = {"cupy": lambda: _doubling("cupy", lambda x: x * 2), "numba": _numba_doubling,
                 "jax": lambda: _doubling("jax", lambda x: x * 2), "warp": _warp_doubling}
    found = [pytest.param(name, factory, id=name) for name, factory in factories.items()
             if importlib.util.find_spec(name) is not None]
    return found or [pytest.param(None, None, marks=pytest.mark.skip(reason="no GPU array library here"))]


@needs_cuda
@pytest.mark.parametrize("library, factory", _soak_ops())
def test_a_thousand_reduce_overhead_replays_with_changing_shapes(library, factory):
    """The cudagraph-trees failure mode of external kernels: a launch keeping a graph-pool
    block alive ("tensor(s) in the cudagraph pool not tracked as outputs"). 1,000 calls, the
    size changing between them, results equal eager, allocated memory back where it began."""
    from fullgraph import memory

    twice = factory()
    with memory.torch_pool(library) if library in ("cupy", "numba", "warp") else contextlib.nullcontext():
        compiled = torch.compile(lambda t: twice(t.sin()).cos(), fullgraph=True, mode="reduce-overhead")
        sizes = [1024, 4096, 777, 65536]
        for size in sizes:  # warm-up and capture each size
            for _ in range(3):
                compiled(torch.randn(size, device="cuda"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        for i in range(1000):
            x = torch.randn(sizes[i % len(sizes)], device="cuda")
            out = compiled(x)
            if i % 101 == 0:
                torch.testing.assert_close(out, (2 * x.sin()).cos())
        del out
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() - before <= 4 * 65536 * 4
