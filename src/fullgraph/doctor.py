"""``fullgraph doctor``: which native parts this installation has (built, to be built on first
use, or impossible here), which optional libraries are installed, and what "auto" takes
because of it. Builds nothing and imports no kernel module."""

from __future__ import annotations

import importlib.util
import platform

import torch

from . import _extension, _triton

LIBRARIES = ("scipy", "sklearn", "rich", "matplotlib", "warp", "cupy", "numba", "jax", "cuml", "rmm", "cuvs")


def _native_parts(cuda: bool) -> list[tuple[str, str]]:
    from .ops.lltm import build as lltm
    from .ops.neighbors.cpu import native
    from .ops.sampling.cuda import backend as fps

    parts = [("CPU neighbour extension", _extension.state(native.NAME, native.SOURCES, with_cuda=False,
                                                          cflags=native.CFLAGS, prebuilt=native.PREBUILT))]
    prebuilt = lltm.prebuilt_library()
    if prebuilt is not None:
        parts.append(("LLTM extension", f"in the package ({prebuilt.name}: loads without compiling)"))
    else:
        parts.append(("LLTM C++ extension", _extension.state(lltm.NAME + "_cpu", [lltm.SOURCES / "lltm.cpp"],
                                                             with_cuda=False)))
        if cuda:
            parts.append(("LLTM CUDA extension", _extension.state(
                lltm.NAME + "_cuda", [lltm.SOURCES / "lltm.cpp", lltm.SOURCES / "lltm_cuda.cu"], with_cuda=True)))
    if cuda and torch.cuda.get_device_capability()[0] >= 9:
        parts.append(("fps CUDA extension (thread-block clusters)",
                      _extension.state("fullgraph_fps", [fps.SOURCE], with_cuda=True,
                                                       prebuilt=fps.PREBUILT)))
    else:
        parts.append(("fps CUDA extension (thread-block clusters)", "not used: needs a GPU of compute capability >= 9.0"))
    return parts


def _auto_choices(device: torch.device) -> list[tuple[str, str]]:
    from . import numpy
    from .ops.lltm import api as lltm
    from .ops.neighbors import registration
    from .ops.sampling import api as sampling

    choices = []
    for dim in (3, 64):
        for op in ("knn", "radius"):
            try:
                name = registration.BACKENDS.resolve("auto", op, device, torch.float32, dim, 16, size=10**8).name
            except ValueError as refusal:
                name = f"none ({refusal})"
            choices.append((f"{op}, float32, D = {dim}", name))
    choices.append(("fps, float32, D = 3", sampling.BACKENDS.resolve("auto", "farthest_points", device, torch.float32,
                                                                     3, 4096, "x").name))
    choices.append(("lltm, float32", lltm.BACKENDS.resolve("auto", "lltm", device, torch.float32).name))
    choices.append(("numpy.jit (kmeans)", "Inductor" if numpy._backend(device) == "inductor" else
                    "NumPy itself (no C++ compiler for Inductor's CPU code)"))
    return choices


def report() -> str:
    """The doctor's text."""
    from . import __version__

    cuda = torch.cuda.is_available()
    triton = _triton.available()
    lines = [f"fullgraph {__version__}, torch {torch.__version__}, Python {platform.python_version()}",
             "CUDA: " + (f"{torch.cuda.get_device_name()} (capability {'.'.join(map(str, torch.cuda.get_device_capability()))})"
                         if cuda else "not available"),
             "Triton: " + ("installed" + (" (interpreter on CPU tensors)" if _triton.INTERPRETED else "")
                           if triton else "not installed (the GPU kernels need it)"),
             "", "native parts:"]
    lines += [f"  {name}: {status}" for name, status in _native_parts(cuda)]
    installed = [name for name in LIBRARIES if importlib.util.find_spec(name) is not None]
    lines += ["", "optional libraries: " + (", ".join(installed) or "none"),
              "  missing: " + (", ".join(name for name in LIBRARIES if name not in installed) or "none")]
    for device in [torch.device("cpu")] + ([torch.device("cuda")] if cuda else []):
        lines += ["", f'"auto" on {device.type}:']
        lines += [f"  {what}: {name}" for what, name in _auto_choices(device)]
    return "\n".join(lines)
