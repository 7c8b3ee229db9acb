"""Find or build the LLTM extension (csrc/) and load it into the process.

Ahead of time: ``FULLGRAPH_BUILD_EXT=1 pip install --no-build-isolation .`` compiles it into
the package (``fullgraph/ops/lltm/_C*.so``, with the CUDA kernels when nvcc is found). Just
in time: the first use compiles it with ``torch.utils.cpp_extension.load`` into torch's
extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and later
processes load the cached build. Either way the library registers the kernels' operators
``torch.ops.fullgraph_lltm.forward`` / ``backward`` for CPU (and CUDA), which the public
``torch.ops.fullgraph.lltm_forward`` / ``lltm_backward`` (api.py) call.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "csrc"
NAME = "fullgraph_lltm"


class ExtensionBuildError(RuntimeError):
    """The LLTM extension could not be built or loaded."""


def prebuilt_library() -> Path | None:
    built = sorted(Path(__file__).parent.glob("_C*.so"))
    return built[0] if built else None


def missing_tools(with_cuda: bool) -> list[str]:
    """What a just-in-time build on this machine lacks (empty: it can build)."""
    from torch.utils import cpp_extension

    missing = []
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja (pip install ninja)")
    if with_cuda and cpp_extension.CUDA_HOME is None:
        missing.append("the CUDA toolkit (nvcc; set CUDA_HOME to its folder)")
    return missing


def vector_flags() -> list[str]:
    """Compiler flags that give ATen's vector types (at::vec) AVX2 on CPUs that have it."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def _compile(with_cuda: bool) -> None:
    from torch.utils import cpp_extension

    missing = missing_tools(with_cuda)
    if missing:
        raise ExtensionBuildError(
            f"fullgraph.lltm: building the {'C++/CUDA' if with_cuda else 'C++'} extension needs "
            + ", ".join(missing) + '. Or use backend="torch" (plain PyTorch).'
        )
    sources = [SOURCES / "lltm.cpp"] + ([SOURCES / "lltm_cuda.cu"] if with_cuda else [])
    # The sources' hash in the name: torch rebuilds on changes to the listed sources only, not to lltm.h.
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(SOURCES.iterdir()) if p.is_file())).hexdigest()
    name = NAME + ("_cuda_" if with_cuda else "_cpu_") + digest[:10]
    print(f"fullgraph: loading the LLTM extension {name} (compiled on first use, ~30 s; cached afterwards)",
          file=sys.stderr, flush=True)
    try:
        cpp_extension.load(
            name=name, sources=[str(s) for s in sources], extra_cflags=["-O3", *vector_flags()],
            extra_cuda_cflags=["-O3"], extra_include_paths=[str(SOURCES)], is_python_module=False,
            with_cuda=with_cuda, verbose=os.environ.get("FULLGRAPH_VERBOSE_BUILD") == "1",
        )
    except Exception as error:  # the compiler's own message is in the chained error
        raise ExtensionBuildError(f"fullgraph.lltm: building {name} failed: {error}") from error


@functools.cache
def load() -> bool:
    """Load the extension once per process (building it if needed). Returns whether its
    CUDA kernels are in it. Raises ExtensionBuildError naming what is missing."""
    prebuilt = prebuilt_library()
    if prebuilt is not None:
        torch.ops.load_library(str(prebuilt))
    else:
        _compile(with_cuda=torch.cuda.is_available() and missing_tools(True) == [])
    return torch._C._dispatch_has_kernel_for_dispatch_key("fullgraph_lltm::forward", "CUDA")
