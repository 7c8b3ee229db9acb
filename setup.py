"""Ahead-of-time builds of the C++ extensions (optional; pyproject.toml holds the metadata).

    FULLGRAPH_BUILD_EXT=1 pip wheel --no-build-isolation --no-deps -w dist .

compiles, against the torch that is installed (hence --no-build-isolation), the CPU neighbour
extension (fullgraph/ops/neighbors/cpu/_native.so) and the LLTM extension
(fullgraph/ops/lltm/_lltm.so) and, where nvcc is found, the CUDA kernels: LLTM's (sm_80-sm_90) in
the same library and fps's (fullgraph/ops/sampling/cuda/_fps.so, sm_90); FULLGRAPH_BUILD_CUDA=0
leaves them out. Beside each library its build info (<library>.json: the torch, CUDA, Python
and CPU vector extension it was built for): an installation loads it only where they fit, and
builds just in time otherwise. Without FULLGRAPH_BUILD_EXT the package is pure Python and the
extensions are built just in time on first use.
"""

import importlib.util
import json
import os
from pathlib import Path

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("FULLGRAPH_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    def _module(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    extension = _module("_extension", "src/fullgraph/_extension.py")
    # The flags of the just-in-time builds, with the vector extension of other machines' CPUs.
    cflags = ["-O3", *extension.portable_vector_flags(), *extension.parallel_flags()]
    neighbours = "src/fullgraph/ops/neighbors/cpu/csrc"
    native = [f"{neighbours}/{name}" for name in
              ("smallest.cpp", "squared_distances.cpp", "weighted_sums.cpp", "knn_reduce.cpp")]
    ext_modules.append(CppExtension("fullgraph.ops.neighbors.cpu._native", native,
                                    include_dirs=[os.path.abspath(neighbours)],
                                    extra_compile_args=[*cflags, "-ffp-contract=off"],
                                    extra_link_args=extension.parallel_flags()))
    lltm = "src/fullgraph/ops/lltm/csrc"
    with_cuda = CUDA_HOME is not None and os.environ.get("FULLGRAPH_BUILD_CUDA", "1") != "0"
    sources = [f"{lltm}/lltm.cpp"] + ([f"{lltm}/lltm_cuda.cu"] if with_cuda else [])
    kind = CUDAExtension if with_cuda else CppExtension
    # The GPUs users run (A100, A10/RTX 30, L4/RTX 40, H100), and PTX for later ones.
    lltm_arches = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in (80, 86, 89, 90)]
    lltm_arches.append("-gencode=arch=compute_90,code=compute_90")
    ext_modules.append(kind("fullgraph.ops.lltm._lltm", sources, include_dirs=[os.path.abspath(lltm)],
                            extra_compile_args={"cxx": cflags, "nvcc": ["-O3", *lltm_arches]} if with_cuda else cflags,
                            extra_link_args=extension.parallel_flags()))
    if with_cuda:  # fps's thread-block clusters need compute capability 9.0
        fps = "src/fullgraph/ops/sampling/cuda/csrc"
        ext_modules.append(CUDAExtension("fullgraph.ops.sampling.cuda._fps", [f"{fps}/farthest_points.cu"],
                                         include_dirs=[os.path.abspath(fps)],
                                         extra_compile_args={"cxx": cflags, "nvcc": [
                                             "-O3", "-gencode=arch=compute_90,code=sm_90",
                                             "-gencode=arch=compute_90,code=compute_90"]}))

    class BuildWithInfo(BuildExtension.with_options(no_python_abi_suffix=True)):
        """Writes each library's build info beside it."""

        def build_extension(self, ext):
            super().build_extension(ext)
            library = Path(self.get_ext_fullpath(ext.name))
            library.with_suffix(".json").write_text(json.dumps(extension.build_info()) + "\n")

    cmdclass = {"build_ext": BuildWithInfo}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
