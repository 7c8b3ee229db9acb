"""fullgraph.numpy: NumPy functions on torch tensors through torch.compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DEVICES

import fullgraph


@fullgraph.numpy.jit
def _weighted_rows(x, w):
    return (x * w[:, None]).sum(1), np.argmax(x, axis=1)


@pytest.mark.parametrize("device", DEVICES)
def test_tensors_in_tensors_out_on_their_device(device):
    generator = torch.Generator().manual_seed(0)
    x, w = torch.rand(40, 3, generator=generator).to(device), torch.rand(40, generator=generator).to(device)
    sums, best = _weighted_rows(x, w)
    assert sums.device == x.device and best.device == x.device
    want_sums, want_best = _weighted_rows.fn(x.cpu().numpy(), w.cpu().numpy())
    np.testing.assert_allclose(sums.cpu().numpy(), want_sums, rtol=1e-6)
    np.testing.assert_array_equal(best.cpu().numpy(), want_best)


def test_numpy_in_numpy_out():
    x, w = np.random.default_rng(1).random((40, 3)), np.random.default_rng(2).random(40)
    sums, best = _weighted_rows(x, w)
    assert isinstance(sums, np.ndarray) and isinstance(best, np.ndarray)
    np.testing.assert_allclose(sums, (x * w[:, None]).sum(1))


def test_default_float_sets_the_dtype_of_created_arrays():
    x = torch.zeros(3, dtype=torch.float32)
    assert fullgraph.numpy.jit(lambda x: x + np.ones(3))(x).dtype == torch.float64
    assert fullgraph.numpy.jit(lambda x: x + np.ones(3), default_float="float32")(x).dtype == torch.float32


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [False, True])
def test_jitted_functions_inside_an_enclosing_compiled_graph(dynamic):
    """Called from code that torch.compile traces, a jitted function becomes part of that one
    graph (its own compile and its lock stay out of the way)."""
    x, w = torch.rand(5, 3, dtype=torch.float64), torch.rand(5, dtype=torch.float64)
    compiled = torch.compile(lambda x, w: _weighted_rows(x, w)[0] * 2, fullgraph=True, dynamic=dynamic)
    torch.testing.assert_close(compiled(x, w), _weighted_rows(x, w)[0] * 2)
    single = fullgraph.numpy.jit(lambda x: x + np.ones(3), default_float="float32")
    with pytest.raises(Exception, match="default_float='float32' cannot be switched inside an enclosing"):
        torch.compile(lambda x: single(x), fullgraph=True)(x.float())


@fullgraph.numpy.jit
def _needs_three_rows(x):
    if x.shape[0] < 3:
        raise ValueError(f"x: expected at least 3 rows, got {x.shape[0]}")
    return x * 2


def test_the_functions_own_errors_reach_the_caller():
    with pytest.raises(ValueError, match="x: expected at least 3 rows, got 2"):
        _needs_three_rows(torch.rand(2))
    assert _needs_three_rows(torch.ones(3)).tolist() == [2.0, 2.0, 2.0]


def _branchy(x):
    if x.sum() > 0:  # a branch on array values: not one graph
        return x
    return -x


def test_untraceable_code_gets_a_named_error_and_an_eager_escape():
    x = torch.arange(3.0)
    with pytest.raises(fullgraph.numpy.NumpyCompileError, match=r"(?s)_branchy: .*eager=True"):
        fullgraph.numpy.jit(_branchy)(x)
    assert torch.equal(fullgraph.numpy.jit(_branchy, eager=True)(x), x)


def test_bad_options():
    with pytest.raises(ValueError, match="default_float: expected one of"):
        fullgraph.numpy.jit(default_float="float16")
    with pytest.raises(TypeError, match="fn: expected a function, got int"):
        fullgraph.numpy.jit(3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tensors_on_two_devices_are_refused():
    with pytest.raises(ValueError, match="expected all tensors on one device"):
        _weighted_rows(torch.rand(4, 3), torch.rand(4, device="cuda"))


@pytest.mark.slow
def test_many_functions_and_dtypes_compile_without_hitting_the_recompile_limit():
    for scale in range(10):
        scaled = fullgraph.numpy.jit(lambda x, scale=scale: x * scale)
        for dtype in (torch.float32, torch.float64):
            assert scaled(torch.ones(2, dtype=dtype)).tolist() == [float(scale)] * 2


def test_static_functions_compile_per_signature_past_the_recompile_limit():
    first_row = fullgraph.numpy.jit(lambda x: x.reshape(-1, x.shape[-1])[0] * 2, dynamic=False)
    for n in range(1, 12):  # more signatures than the compiler's 8 variants per function
        x = torch.rand(n, 3, dtype=torch.float64)
        torch.testing.assert_close(first_row(x), x[0] * 2)
    assert len(first_row._static) == 11
    first_row(torch.rand(1, 3, dtype=torch.float64))
    assert len(first_row._static) == 11  # a signature seen before reuses its variant


def test_host_reads_and_dtypes_numpy_lacks_get_clear_errors():
    @fullgraph.numpy.jit
    def _reads_a_value(x):
        return x * float(x.sum())

    with pytest.raises(fullgraph.numpy.NumpyCompileError, match="_reads_a_value: torch.compile cannot trace"):
        _reads_a_value(torch.rand(4))
    double = fullgraph.numpy.jit(lambda x: 2 * x)
    with pytest.raises(TypeError, match="argument 0 is torch.bfloat16, which NumPy has no dtype for"):
        double(torch.rand(4, dtype=torch.bfloat16))


def test_keyword_arguments():
    @fullgraph.numpy.jit
    def scaled(x, *, scale=1.0, offset=None):
        return x * scale + (0 if offset is None else offset)

    x = torch.arange(3.0)
    assert scaled(x, scale=2.0).tolist() == [0.0, 2.0, 4.0]
    assert scaled(x, scale=2.0, offset=torch.ones(3)).tolist() == [1.0, 3.0, 5.0]


def test_default_float_is_per_function_across_threads():
    import threading

    as64 = fullgraph.numpy.jit(lambda x: x + np.zeros(3), default_float="float64")
    as32 = fullgraph.numpy.jit(lambda x: x + np.zeros(3), default_float="float32")
    seen, errors = {}, []

    def run(name, fn):
        try:
            for _ in range(20):
                seen.setdefault(name, set()).add(fn(torch.zeros(3, dtype=torch.float16)).dtype)
        except Exception as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(n, f)) for n, f in (("64", as64), ("32", as32))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert seen == {"64": {torch.float64}, "32": {torch.float32}}


def test_python_containers_get_a_clear_error():
    double = fullgraph.numpy.jit(lambda x: 2 * x)
    with pytest.raises(TypeError, match="argument 0 is a Python list; pass a tensor or a NumPy array"):
        double([1.0, 2.0])


def test_np_random_follows_torch_manual_seed_compiled_and_numpy_seed_eagerly():
    """As documented in jit: torch's generator inside the compiled code, NumPy's with eager=True."""
    def noisy(x):
        return x + np.random.rand(*x.shape)

    compiled, eager = fullgraph.numpy.jit(noisy), fullgraph.numpy.jit(noisy, eager=True)
    x = torch.arange(4.0)
    torch.manual_seed(5)
    first = compiled(x)
    torch.manual_seed(5)
    assert torch.equal(compiled(x), first)
    np.random.seed(5)
    after_numpy_seed = compiled(x)
    np.random.seed(5)
    assert not torch.equal(compiled(x), after_numpy_seed)  # np.random.seed does not reach it
    np.random.seed(5)
    want = x.numpy() + np.random.rand(4)
    np.random.seed(5)
    np.testing.assert_array_equal(eager(x).numpy(), want)


def test_without_a_cpp_compiler_cpu_tensors_run_in_numpy_or_the_traced_operators(monkeypatch):
    """Inductor's CPU code is C++: where no compiler is found, a jitted function on CPU tensors
    runs in NumPy itself (NumPy's default float: nothing traced, the first call is quick) or
    its traced torch operators ("eager" backend), instead of failing."""
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert fullgraph.numpy._backend(torch.device("cpu")) == "eager"

    def nearest(x, centroids):
        return np.argmin(((x[:, None] - centroids[None]) ** 2).sum(-1), axis=1)

    x, c = torch.rand(50, 3, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    want = np.argmin(((x.numpy()[:, None] - c.numpy()[None]) ** 2).sum(-1), axis=1)
    in_numpy, traced = fullgraph.numpy.jit(nearest), fullgraph.numpy.jit(nearest, default_float="float32")
    for fn in (in_numpy, traced):
        got = fn(x, c)
        assert isinstance(got, torch.Tensor) and np.array_equal(got.numpy(), want)
    assert not in_numpy._by_backend and not in_numpy._static and set(traced._by_backend) == {"eager"}
