"""Find or build the LLTM extension (csrc/) and load it into the process.

Ahead of time: ``FULLGRAPH_BUILD_EXT=1 pip wheel --no-build-isolation .`` compiles it into
the package (``fullgraph/ops/lltm/_lltm.so``, with the CUDA kernels when nvcc is found),
loaded where it fits the torch installed (``_extension.load_prebuilt``). Just
in time: the first use compiles it with ``torch.utils.cpp_extension.load`` into torch's
extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and later
processes load the cached build. Either way the library registers the kernels' operators
``torch.ops.fullgraph_lltm.forward`` / ``backward`` for CPU (and CUDA), which the public
``torch.ops.fullgraph.lltm_forward`` / ``lltm_backward`` (api.py) call.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..._extension import (ExtensionBuildError, build, carried, load_prebuilt, loaded_library, missing_tools,
                           vector_flags)

__all__ = ["ExtensionBuildError", "library", "load", "missing_tools", "prebuilt_library", "vector_flags"]

SOURCES = Path(__file__).parent / "csrc"
NAME = "fullgraph_lltm"


PREBUILT = Path(__file__).parent / "_lltm.so"  # where a wheel carries it (setup.py), with or without CUDA


def prebuilt_library() -> Path | None:
    """The build the package carries, where it fits this torch, Python and CPU."""
    return PREBUILT if carried(PREBUILT) else None


def _compile(with_cuda: bool) -> None:
    sources = [SOURCES / "lltm.cpp"] + ([SOURCES / "lltm_cuda.cu"] if with_cuda else [])
    build(NAME + ("_cuda" if with_cuda else "_cpu"), sources, with_cuda=with_cuda,
          what=f"fullgraph.lltm: the {'C++/CUDA' if with_cuda else 'C++'} extension",
          instead='use backend="torch" (plain PyTorch)')


def library() -> Path:
    """The file of the loaded extension (loading it first): a C++ program that runs an
    AOTInductor package holding ``fullgraph_lltm::forward`` loads it (docs/deploy.md)."""
    load()
    return loaded_library("_lltm", NAME)


@functools.cache
def load() -> bool:
    """Load the extension once per process (building it if needed). Returns whether its
    CUDA kernels are in it. Raises ExtensionBuildError naming what is missing."""
    if not load_prebuilt(PREBUILT, "fullgraph.lltm: the extension"):
        _compile(with_cuda=torch.cuda.is_available() and missing_tools(True) == [])
    return torch._C._dispatch_has_kernel_for_dispatch_key("fullgraph_lltm::forward", "CUDA")
