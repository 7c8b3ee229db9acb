"""Ahead-of-time build of the LLTM extension (optional; pyproject.toml holds the metadata).

    FULLGRAPH_BUILD_EXT=1 pip install --no-build-isolation .

compiles src/fullgraph/ops/lltm/csrc into fullgraph/ops/lltm/_C*.so against the torch that is
installed (hence --no-build-isolation), with the CUDA kernels when nvcc is found
(FULLGRAPH_BUILD_CUDA=0 leaves them out). Without FULLGRAPH_BUILD_EXT the package is pure
Python and the extension is built just in time on first use.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("FULLGRAPH_BUILD_EXT") == "1":
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    csrc = "src/fullgraph/ops/lltm/csrc"
    with_cuda = CUDA_HOME is not None and os.environ.get("FULLGRAPH_BUILD_CUDA", "1") != "0"
    import importlib.util

    spec = importlib.util.spec_from_file_location("_extension", "src/fullgraph/_extension.py")
    flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags)
    extension = CUDAExtension if with_cuda else CppExtension
    sources = [f"{csrc}/lltm.cpp"] + ([f"{csrc}/lltm_cuda.cu"] if with_cuda else [])
    compile_args = {"cxx": ["-O3", *flags.vector_flags()], "nvcc": ["-O3"]}
    ext_modules = [extension("fullgraph.ops.lltm._C", sources, include_dirs=[os.path.abspath(csrc)],
                             extra_compile_args=compile_args if with_cuda else compile_args["cxx"])]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
