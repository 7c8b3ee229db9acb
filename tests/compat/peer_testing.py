"""What the ported peer suites import from their own packages' testing helpers: the dtypes
and devices they run over, the tensor constructor, PyTorch3D's ``assertClose`` mixin and
the references its tests compare against (written here; the peers' helpers are not
installed)."""

import pathlib
import unittest
from typing import Any

import torch

dtypes = [torch.half, torch.bfloat16, torch.float, torch.double, torch.int, torch.long]
grad_dtypes = [torch.half, torch.float, torch.double]
floating_dtypes = grad_dtypes + [torch.bfloat16]

devices = [torch.device("cpu")] + ([torch.device("cuda:0")] if torch.cuda.is_available() else [])


def tensor(x: Any, dtype: torch.dtype, device: torch.device):
    return None if x is None else torch.tensor(x, dtype=dtype, device=device)


# PyTorch3D's test helpers.


class TestCaseMixin:
    """``assertClose`` as PyTorch3D's tests use it: same shape, then torch.allclose."""

    def assertClose(self, input, other, *, rtol=1e-05, atol=1e-08, equal_nan=False, msg=None):
        input, other = torch.as_tensor(input), torch.as_tensor(other)
        self.assertEqual(tuple(input.shape), tuple(other.shape), msg)
        close = torch.allclose(input.cpu().double(), other.cpu().double(), rtol=rtol, atol=atol, equal_nan=equal_nan)
        if not close:
            gap = (input.cpu().double() - other.cpu().double()).abs().max().item()
            self.fail(f"not close: max abs difference {gap}" + (f" ({msg})" if msg else ""))


def get_random_cuda_device() -> str:
    if not torch.cuda.is_available():
        raise unittest.SkipTest("needs a CUDA device")
    return "cuda:0"


def _needs_pytorch3d(name: str):
    def missing(*args, **kwargs):
        raise unittest.SkipTest(f"needs PyTorch3D's {name} (meshes and their sample data are not part of fullgraph)")
    return missing


ico_sphere = _needs_pytorch3d("ico_sphere")
sample_points_from_meshes = _needs_pytorch3d("sample_points_from_meshes")
load_obj = _needs_pytorch3d("load_obj")


def get_tests_dir() -> pathlib.Path:
    return pathlib.Path(__file__).parent


def get_pytorch3d_dir() -> pathlib.Path:
    return pathlib.Path(__file__).parent


def masked_gather(points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """points [N, P, D] at idx [N, K] (or [N, L, K]); 0 where idx is -1."""
    flat = idx.reshape(idx.shape[0], -1)
    out = points.gather(1, flat.clamp(min=0)[..., None].expand(-1, -1, points.shape[-1]))
    out = out.masked_fill((flat < 0)[..., None], 0.0)
    return out.reshape(*idx.shape, points.shape[-1])


def sample_farthest_points_naive(points, lengths=None, K=50, random_start_point=False):
    """The reference the FPS tests compare against: one cloud at a time, a Python loop of
    argmax over the running minimum squared distance (ties to the smaller index)."""
    N, P, D = points.shape
    if lengths is None:
        lengths = torch.full((N,), P, dtype=torch.int64, device=points.device)
    elif lengths.shape != (N,):
        raise ValueError("points and lengths must have same batch dimension.")
    if isinstance(K, int):
        K = torch.full((N,), K, dtype=torch.int64, device=points.device)
    elif isinstance(K, list):
        K = torch.tensor(K, dtype=torch.int64, device=points.device)
    if K.shape[0] != N:
        raise ValueError("K and points must have the same batch dimension")
    width = int(K.max())
    idx = torch.full((N, width), -1, dtype=torch.int64, device=points.device)
    for n in range(N):
        size = int(lengths[n])
        count = min(size, int(K[n]))
        if count == 0:
            continue
        cloud = points[n, :size].detach()
        current = int(torch.randint(size, ())) if random_start_point else 0
        nearest = torch.full((size,), float("inf"), dtype=cloud.dtype, device=cloud.device)
        for i in range(count):
            idx[n, i] = current
            nearest = torch.minimum(nearest, (cloud - cloud[current]).square().sum(-1))
            current = int(nearest.argmax())
    return masked_gather(points, idx), idx


# PyG's test decorators.


def withPackage(*names: str):
    """Skip unless every package is importable; pyg-lib's operators are what fullgraph.compat.pyg
    provides, so "pyg_lib" is met."""
    import importlib.util

    import pytest

    missing = [name for name in names if name != "pyg_lib" and importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


def onlyFullTest(function):
    """PyG runs these only in its full test run; here they always run."""
    return function


# pyg-lib's operators and test decorator.


def withCUDA(func):
    import pytest

    return pytest.mark.parametrize("device", devices, ids=str)(func)
