"""Just-in-time builds of fullgraph's C++/CUDA extensions.

A wheel built with ``FULLGRAPH_BUILD_EXT=1`` (setup.py) carries the libraries, each with its
build info (``build_info``): they load where torch, Python and the CPU fit. Otherwise the
first use compiles an extension's sources with ``torch.utils.cpp_extension.load`` into
torch's extension cache (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``)
under a name that holds a hash of the sources, the flags and the torch and Python built for
(``cache_key``), so an edited source is rebuilt, two environments keep two builds, and later
processes load the cached build without a word. The extensions register their kernels as operators
(``TORCH_LIBRARY``); nothing is imported as a Python module.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch


class ExtensionBuildError(RuntimeError):
    """A C++/CUDA extension could not be built or loaded."""


def cpp_compiler() -> str | None:
    """The C++ compiler's path (CXX, else c++ on PATH), or None where none is found."""
    return _found(os.environ.get("CXX", "c++"))


@functools.lru_cache(maxsize=8)
def _found(program: str) -> str | None:
    return shutil.which(program)


def missing_tools(with_cuda: bool) -> list[str]:
    """What a just-in-time build on this machine lacks (empty: it can build)."""
    from torch.utils import cpp_extension

    missing = []
    if cpp_compiler() is None:
        missing.append(f"a C++ compiler ({os.environ.get('CXX', 'c++')!r} is not on PATH; install g++ or set CXX)")
    if not cpp_extension.is_ninja_available():
        missing.append("ninja (pip install ninja)")
    if with_cuda and cpp_extension.CUDA_HOME is None:
        missing.append("the CUDA toolkit (nvcc; set CUDA_HOME to its folder)")
    return missing


def vector_flags() -> list[str]:
    """Compiler flags that give ATen's vector types (at::vec) and GCC's vector extensions
    AVX-512 or AVX2 on CPUs that have them (the capability torch dispatches to)."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512",
                "-DCPU_CAPABILITY_AVX512"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


def parallel_flags() -> list[str]:
    """Compiler flags that let at::parallel_for in an extension use PyTorch's OpenMP threads
    (without them its inline OpenMP code runs on one thread)."""
    return ["-fopenmp"] if torch.backends.openmp.is_available() else []


def cache_key(files: Sequence[Path], flags: Sequence[str]) -> str:
    """The part of an extension's cache name that changes with anything in its binary: the
    sources and headers, the flags, and the torch and Python it is built for (two environments
    on one machine keep two builds instead of rebuilding each other's)."""
    torch_build = f"{torch.__version__} {torch.version.cuda} {torch.version.git_version} {sys.version_info[:2]}"
    digest = hashlib.sha1(b"".join(p.read_bytes() for p in files) + " ".join(flags).encode() + torch_build.encode())
    return digest.hexdigest()[:10]


def build_info() -> dict:
    """What a binary built here depends on: the torch (version, CUDA, commit) and Python it is
    built against, and the CPU vector extension its kernels may use."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "torch_commit": torch.version.git_version,
            "python": list(sys.version_info[:2]), "cpu_capability": portable_capability()}


def portable_capability() -> str:
    """The vector extension a binary for other machines is compiled for: AVX2 where this CPU
    has it (every x86-64 CPU of the last decade), else none."""
    return "AVX2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "DEFAULT"


def portable_vector_flags() -> list[str]:
    return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"] \
        if portable_capability() == "AVX2" else []


def prebuilt_problem(library: Path) -> str | None:
    """Why the library built into the package (``setup.py``, beside it its build info
    ``<library>.json``) cannot be loaded in this process, or None where it can."""
    import json

    info_file = library.with_suffix(".json")
    if not info_file.is_file():
        return f"{library.name} has no build info ({info_file.name})"
    built = json.loads(info_file.read_text())
    here = build_info()
    for key in ("torch", "cuda", "torch_commit", "python"):
        if built.get(key) != here[key]:
            return f"it was built for {key} {built.get(key)}, this is {here[key]}"
    if built.get("cpu_capability") == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "it was built for CPUs with AVX2, this one has none"
    return None


def carried(library: Path | None) -> bool:
    """Whether the package carries ``library`` built for this torch, Python and CPU."""
    return library is not None and library.is_file() and prebuilt_problem(library) is None


def load_prebuilt(library: Path, what: str) -> bool:
    """Load ``library`` if it is there and fits this torch, Python and CPU; where it is there
    but does not fit, a warning says why (the caller then builds just in time)."""
    if not library.is_file():
        return False
    problem = prebuilt_problem(library)
    if problem is not None:
        import warnings

        warnings.warn(f"{what}: not loading the build in the package ({problem}); building just in time instead",
                      RuntimeWarning, stacklevel=3)
        return False
    torch.ops.load_library(str(library))
    return True


def loaded_library(*names: str) -> Path:
    """The file of the last library loaded into this process whose file name starts with one
    of ``names``: what a C++ program that runs a package holding its operators loads first."""
    found = [Path(p) for p in torch.ops.loaded_libraries if Path(p).name.startswith(names)]
    if not found:
        raise ExtensionBuildError(f"no library named {' or '.join(names)}* is loaded")
    return found[-1]


def _built(full_name: str) -> Path | None:
    """The library of this build in torch's extension cache, or None (loading it compiles nothing)."""
    from torch.utils import cpp_extension

    library = Path(cpp_extension._get_build_directory(full_name, verbose=False)) / f"{full_name}.so"
    return library if library.is_file() else None


def _planned(name: str, sources: Sequence[Path], cflags: Sequence[str], cuda_flags: Sequence[str]):
    """(cache name, C++ flags, CUDA flags, include folders) of a build of ``sources``."""
    folders = sorted({Path(s).parent for s in sources})
    files = sorted(p for folder in folders for p in folder.iterdir() if p.is_file() and p.suffix in (".cpp", ".cu", ".h"))
    cflags = ["-O3", *vector_flags(), *parallel_flags(), *cflags]
    cuda_flags = ["-O3", *cuda_flags]
    return f"{name}_{cache_key(files, [*cflags, *cuda_flags])}", cflags, cuda_flags, folders


def state(name: str, sources: Sequence[Path], *, with_cuda: bool, cflags: Sequence[str] = (),
          cuda_flags: Sequence[str] = (), prebuilt: Path | None = None) -> str:
    """Whether ``build`` would load this extension from the cache, compile it, or cannot: a
    line for ``fullgraph doctor``; builds nothing."""
    if carried(prebuilt):
        return f"in the package ({prebuilt.name}, built for torch {torch.__version__}: loads without compiling)"
    full_name = _planned(name, sources, cflags, cuda_flags)[0]
    if _built(full_name):
        return f"built ({full_name}, cached: loads without compiling)"
    missing = missing_tools(with_cuda)
    if missing:
        return "cannot be built here: needs " + ", ".join(missing)
    return "not built yet: compiled on first use (~1 min), then cached"


def build(name: str, sources: Sequence[Path], *, with_cuda: bool, what: str, instead: str,
          cflags: Sequence[str] = (), cuda_flags: Sequence[str] = (), prebuilt: Path | None = None) -> None:
    """Load the extension ``name``: the ``prebuilt`` library where the package carries one that
    fits (``load_prebuilt``), else compile ``sources`` (and the headers beside them, hashed
    too) into the extension ``name`` + ``cache_key`` and load it into this process; a message
    on stderr says so only when it compiles.

    what: how the messages name it ("fullgraph.lltm: the C++ extension"); instead: what a user
    can do without it ('use backend="torch"'). Raises ExtensionBuildError naming the missing
    tools, or carrying the compiler's message.
    """
    from torch.utils import cpp_extension

    if prebuilt is not None and load_prebuilt(prebuilt, what):
        return
    full_name, cflags, cuda_flags, folders = _planned(name, sources, cflags, cuda_flags)
    cached = _built(full_name)
    if cached:  # loads without a compiler or ninja, and without running the build tool
        torch.ops.load_library(str(cached))
        return
    missing = missing_tools(with_cuda)
    if missing:
        raise ExtensionBuildError(f"{what}: building it needs " + ", ".join(missing) + f". Or {instead}.")
    print(f"fullgraph: building {full_name} ({what}; once, ~1 min; cached afterwards)", file=sys.stderr, flush=True)
    try:
        cpp_extension.load(
            name=full_name, sources=[str(s) for s in sources], extra_cflags=cflags,
            extra_cuda_cflags=cuda_flags, extra_include_paths=[str(f) for f in folders],
            is_python_module=False, with_cuda=with_cuda,
            verbose=os.environ.get("FULLGRAPH_VERBOSE_BUILD") == "1",
        )
    except Exception as error:  # the compiler's own message is in the chained error
        raise ExtensionBuildError(f"{what}: building {full_name} failed: {error}") from error
