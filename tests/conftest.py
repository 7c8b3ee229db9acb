"""Shared fixtures: tolerances, devices, point-cloud distributions, a float64 oracle."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (on CPU tensors). This must
# be set before fullgraph (and its @triton.jit kernels) is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests assert which path answers a call: kernels compile in the calling process here
# (tests/test_background.py runs the background compiles in processes of their own).
os.environ.setdefault("FULLGRAPH_BACKGROUND_COMPILE", "0")
# JAX takes 75% of the GPU's memory when it starts unless told not to: the pytest workers
# sharing the GPU (and the processes they start) then ran out of memory.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# One table of tolerances per dtype: (rtol, atol) for distances and aggregated features.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}

# On the H100 machine (torch 2.11+cu130) a C++ exception thrown out of a JIT-built extension
# crashes the process (SIGSEGV; a minimal load_inline extension too), so the extensions' own
# TORCH_CHECKs are exercised on torch 2.13 (CI) only; the Python checks before them run everywhere.
CPP_CHECKS_CRASH = torch.__version__.startswith("2.11")
CRASH_REASON = "a C++ exception out of the extension crashes the process on torch 2.11"

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False
# Backends that run on CPU tensors here: triton through its interpreter when no GPU.
if HAVE_TRITON and not torch.cuda.is_available():
    from fullgraph.ops.neighbors.triton import backend as triton_backend

    # Triton's interpreter runs each program in Python, so CPU runs take fewer, larger
    # programs: the same kernels with other block constants (GPU runs keep the tuned ones).
    triton_backend.SEARCH_BLOCKS = (16, 32, 1)

# What Triton's interpreter checks on the CPU in 3-D: a distribution for each path of the grid
# kernels (plain cells, crowded cells, ties, far-out coordinates and their scaling); normal,
# planar and grid clouds take those paths too (CI time: ~25 s each interpreted).
INTERPRETED_3D = ("uniform", "clustered", "duplicates", "far")


def skip_interpreted_extras(backend: str, device: str, distribution: str, dim: int) -> None:
    """Triton's interpreter is slow: on the CPU it checks the INTERPRETED_3D distributions in
    3-D and the other dimensions on two distributions. GPU runs check every combination."""
    wanted = INTERPRETED_3D if dim == 3 else ("uniform", "far")
    if backend == "triton" and device == "cpu" and distribution not in wanted:
        pytest.skip("interpreted Triton: this combination runs on the GPU")


CPU_BACKENDS = ["torch", "cpu"] + (["triton"] if HAVE_TRITON and not torch.cuda.is_available() else [])


def backend_cases(*, float64: bool = False) -> list:
    """(backend, device) pairs to test; float64=True keeps those that compute in float64."""
    cases = [(b, "cpu") for b in CPU_BACKENDS]
    if torch.cuda.is_available():
        cases += [(b, "cuda") for b in backends_for("cuda")]
    if float64:
        cases = [c for c in cases if c[0] != "triton"]
    return [pytest.param(*c, id=f"{c[0]}-{c[1]}") for c in cases]


def backends_for(device: str, dtype: torch.dtype = torch.float32) -> list[str]:
    """Backends for tensors of this device and dtype (Triton computes in float32 only)."""
    names = CPU_BACKENDS if device == "cpu" else ["torch"] + (["triton"] if HAVE_TRITON else [])
    return [b for b in names if not (b == "triton" and dtype == torch.float64)]

DISTRIBUTIONS = ["uniform", "normal", "clustered", "duplicates", "planar", "far", "grid"]


def tolerance(dtype: torch.dtype) -> dict:
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


def points(distribution: str, count: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[count, dim] float64 points of a named distribution; never all zeros."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    def randint(high, *shape):
        return torch.randint(0, high, shape, generator=generator)

    if distribution == "uniform":
        return torch.rand(count, dim, generator=generator, dtype=torch.float64)
    if distribution == "normal":
        return randn(count, dim)
    if distribution == "clustered":
        centers = 3 * randn(4, dim)
        return centers[randint(4, count)] + 0.05 * randn(count, dim)
    if distribution == "duplicates":
        pool = randn(max(1, count // 4), dim)
        return pool[randint(pool.shape[0], count)]
    if distribution == "planar":
        out = randn(count, dim)
        out[:, -1] = 0.25
        return out
    if distribution == "far":
        out = randn(count, dim)
        out[randint(2, count).bool()] += 1e4
        return out
    if distribution == "grid":
        return randint(4, count, dim).to(torch.float64) * 0.5
    raise ValueError(distribution)


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _valid(points: np.ndarray, length: int) -> np.ndarray:
    ok = np.isfinite(points).all(-1)
    ok[length:] = False
    return ok


def oracle_distances(query, ref, query_length=None, ref_length=None) -> np.ndarray:
    """[M, N] float64 brute-force distances, +inf for any invalid pair."""
    q = query.detach().cpu().double().numpy()
    r = ref.detach().cpu().double().numpy()
    d = np.sqrt(((q[:, None, :] - r[None, :, :]) ** 2).sum(-1)) if q.size and r.size else np.zeros((len(q), len(r)))
    ok = _valid(q, len(q) if query_length is None else query_length)[:, None] & _valid(
        r, len(r) if ref_length is None else ref_length)[None, :]
    return np.where(ok, d, np.inf)


def oracle_nearest(d: np.ndarray, k: int, radius: float = np.inf):
    """(dists [M, k], idx [M, k], counts [M]) by (distance, index) order, float64."""
    within = d <= radius
    key = np.where(within, d, np.inf)
    order = np.lexsort((np.broadcast_to(np.arange(d.shape[1]), d.shape), key), axis=-1)[:, :k]
    dists = np.full((d.shape[0], k), np.inf)
    idx = np.full((d.shape[0], k), -1, dtype=np.int64)
    take = order.shape[1]
    dists[:, :take] = np.take_along_axis(key, order, -1)
    idx[:, :take] = np.where(np.isfinite(dists[:, :take]), order, -1)
    return dists, idx, within.sum(-1)


def oracle_aggregate(d: np.ndarray, features, mask: np.ndarray, sigma: float) -> np.ndarray:
    """[M, C]: softmax(-d / sigma) over ``mask`` applied to features, 0 for empty rows."""
    f = features.detach().cpu().double().numpy()
    shifted = np.where(mask, d, np.inf)
    low = np.where(mask.any(-1), shifted.min(-1, initial=np.inf), 0)
    w = np.where(mask, np.exp(-(np.where(mask, d, 0) - low[:, None]) / sigma), 0)
    total = w.sum(-1, keepdims=True)
    return np.where(total > 0, (w @ f) / np.where(total > 0, total, 1), 0)


def assert_neighbors(dists, idx, expected_dists, expected_idx, true_d, dtype):
    """Backend output against the oracle, up to float rounding of near-ties.

    dists match the oracle's; each returned index really lies at the returned distance;
    indices match wherever the oracle's neighbouring distances are not within rounding
    of each other (exact ties included: they must go to the smaller index).
    """
    tol = tolerance(dtype)
    dists = dists.detach().cpu().double().numpy()
    idx = idx.cpu().numpy()
    np.testing.assert_allclose(dists, expected_dists, **tol)
    assert ((idx >= 0) == (expected_idx >= 0)).all()
    found = idx >= 0
    rows = np.broadcast_to(np.arange(idx.shape[0])[:, None], idx.shape)
    np.testing.assert_allclose(true_d[rows[found], idx[found]], dists[found], **tol)
    for row in range(idx.shape[0]):
        chosen = idx[row][idx[row] >= 0]
        assert len(set(chosen.tolist())) == len(chosen), "an index repeats within a row"
    gap_scale = tol["atol"] + tol["rtol"] * np.abs(np.nan_to_num(expected_dists, posinf=0))
    padded = np.concatenate([expected_dists, np.full((len(expected_dists), 1), np.inf)], -1)
    full_sorted = np.sort(np.where(np.isfinite(true_d), true_d, np.inf), -1)
    if full_sorted.shape[1] > expected_dists.shape[1]:
        padded[:, -1] = full_sorted[:, expected_dists.shape[1]]
    with np.errstate(invalid="ignore"):
        gap_after = np.diff(padded, axis=-1)
        gap_before = np.concatenate([np.full((len(padded), 1), np.inf), gap_after[:, :-1]], -1)
    near_tie = ((gap_after > 0) & (gap_after <= 4 * gap_scale)) | ((gap_before > 0) & (gap_before <= 4 * gap_scale))
    decided = found & ~near_tie
    np.testing.assert_array_equal(idx[decided], expected_idx[decided])


def assert_compiled_model_trains(model, compiled, query, ref, target, steps: int = 5, tol: float = 1e-5):
    """The compiled model matches eager, and Adam steps through it lower the loss."""
    torch.testing.assert_close(compiled(query, ref), model(query, ref), rtol=tol, atol=tol)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.mean((compiled(query, ref) - target) ** 2)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def assert_compiles_once_and_trains(model, inputs, loss_fn, steps: int = 4, lr: float = 1e-3):
    """torch.compile(model, fullgraph=True) makes one graph, and Adam steps through it
    lower ``loss_fn(output)``."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(compiled(*inputs))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert counter.frame_count == 1 and losses[-1] < losses[0], (counter.frame_count, losses)


# Triton's interpreter runs the GPU kernels on a CPU at a thousandth of their speed. Tests
# marked ``interpreted(keep=n)`` run every parametrization on a GPU; on a CPU only their
# first n interpreted ones (ids naming "triton" or "tensor cores"; every parametrization of
# a test without such ids), so that CI on two cores stays near 20 minutes.
# FULLGRAPH_INTERPRETER_ALL=1 runs them all here.
_INTERPRETED_IDS = ("triton", "tensor cores", "tensor_cores")


def _interpreted(name: str) -> bool:
    return any(word in name for word in _INTERPRETED_IDS)


def pytest_collection_modifyitems(config, items):
    # Slow tests first: pytest -n's workers then finish on short tests together, rather than one
    # finishing a minute-long test alone while the others wait.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if torch.cuda.is_available() or os.environ.get("FULLGRAPH_INTERPRETER_ALL") == "1":
        return
    marked = [(item, item.get_closest_marker("interpreted")) for item in items]
    groups: dict = {}
    for item, marker in marked:
        if marker is not None:
            groups.setdefault((item.nodeid.split("::")[0], item.originalname), []).append((item, marker))
    for group in groups.values():
        named = any(_interpreted(item.name) for item, _ in group)  # ids tell interpreted cases apart
        cases = [item for item, _ in group if not named or _interpreted(item.name)]
        for item in cases[group[0][1].kwargs.get("keep", 1):]:
            item.add_marker(pytest.mark.skip(reason="interpreted Triton on a CPU: the GPU runs every case "
                                                    "(FULLGRAPH_INTERPRETER_ALL=1 runs them here)"))


# Under pytest-xdist every worker is a process with its own thread pools: on a 16-core machine
# 16 workers of 16 threads each spent most of their time waiting for a core (compiles and CPU
# kernels ran 5-10x slower). Each worker gets its share of the cores, and so do the
# processes it starts.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    os.environ.setdefault("OMP_NUM_THREADS", _SHARE)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _return_gpu_memory():
    """Give the GPU memory a test's tensors held back to the device after it (workers share
    one GPU: a test that used tens of GiB left them reserved in its worker's cache, and
    the others ran out of memory)."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > 2**30:
        torch.cuda.empty_cache()
