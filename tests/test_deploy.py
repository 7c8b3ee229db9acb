"""Deployment without Python: the denoise steps decompose into PyTorch's own operators, so an
exported sampler's AOTInductor package runs from the C++ program in examples/deploy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fullgraph
from conftest import DEVICES
from fullgraph import _extension, _triton
from fullgraph.models.unet1d import ConditionalUnet1D, fuse_conv_blocks
from fullgraph.ops import conv_block


def _sampler(steps: int, fused_blocks: bool = False):
    torch.manual_seed(0)
    unet = ConditionalUnet1D(2, 32, down_dims=(16, 32, 64)).eval()
    if fused_blocks:
        fuse_conv_blocks(unet, backend="triton")
    return fullgraph.diffusion.DDIMSampler(unet, steps=steps).eval(), (torch.randn(1, 16, 2), torch.randn(1, 32))


def _without_fullgraph(sampler, args):
    program = torch.export.export(sampler, args).run_decompositions(fullgraph.diffusion.decompositions())
    found = [str(node.target) for node in program.graph.nodes if "fullgraph" in str(node.target)]
    assert not found, found
    return program


def test_the_sampler_exports_without_fullgraph_operators():
    sampler, args = _sampler(steps=1)
    program = _without_fullgraph(sampler, args)
    with torch.no_grad():
        torch.testing.assert_close(program.module()(*args), sampler(*args), rtol=1e-5, atol=1e-5)


def _runner(build: Path) -> Path:
    """examples/deploy's program built with CMake against this torch (no Python linked)."""
    from examples.deploy.time_sampler import build_runner

    runner = build_runner(build)
    linked = subprocess.run(["ldd", str(runner)], capture_output=True, text=True).stdout
    assert "libpython" not in linked and "torch_python" not in linked, linked
    return runner


@pytest.mark.deploy
@pytest.mark.parametrize("device, fused_steps, fused_blocks",
                         [("cpu", False, False), ("cpu", True, False), ("cuda", True, False), ("cuda", True, True)])
def test_the_cpp_runner_runs_the_ddim_sampler_without_python(tmp_path, device, fused_steps, fused_blocks):
    """The 10-step DDIM sampler exported, packaged by AOTInductor, built into nothing but the
    package; examples/deploy's program (CMake against the torch wheel's libtorch) loads and
    runs it in a process with no Python library and no Python environment: the same actions.
    ``fused_steps``: the package holds fullgraph's DDIM step itself (a triton_op: its kernel,
    Triton on CUDA, goes into the package), not its decomposition; ``fused_blocks``: the
    U-Net's blocks are fullgraph's fused conv blocks, as their triton_op form. On CUDA the
    runner also replays one run captured in a CUDA graph."""
    if shutil.which("cmake") is None or _extension.cpp_compiler() is None:
        pytest.skip("needs cmake and a C++ compiler")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fused_steps and _triton.INTERPRETED:
        pytest.skip("under Triton's interpreter the steps are plain custom operators (fullgraph._triton.op)")
    sampler, args = _sampler(steps=10, fused_blocks=fused_blocks)
    sampler, args = sampler.to(device), tuple(a.to(device) for a in args)
    with torch.backends.cudnn.flags(allow_tf32=False):  # the fused blocks' products: float32 as the reference's
        program = torch.export.export(sampler, args) if fused_steps else _without_fullgraph(sampler, args)
        if fused_blocks:  # the blocks as their triton_op form: their kernels go into the package
            program = program.run_decompositions(conv_block.decompositions())
        package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "sampler.pt2"))
        with torch.no_grad():
            want = sampler(*args).cpu()
    torch.save(list(args), tmp_path / "inputs.pt")
    runner = _runner(tmp_path / "build")
    # (CUDA: the package's own kernels sum in other orders, which ten steps amplify; 1.8e-3 seen on an H200)
    tolerance = 1e-5 if device == "cpu" else 5e-3
    for mode in (["5"], ["5", "graph"]) if device == "cuda" else (["5"],):
        done = subprocess.run([str(runner), package, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt"), *mode],
                              env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "median_ms" in done.stdout, done.stdout + done.stderr
        (got,) = torch.load(tmp_path / "out.pt")
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def test_an_lltm_cell_exports_to_the_extensions_own_operator():
    from fullgraph.ops import lltm

    if not lltm.BACKENDS.get("cpu").available("cpu"):
        pytest.skip("the LLTM extension cannot be built here")
    cell = fullgraph.models.LLTM(8, 16, backend="cpu").eval()
    args = (torch.randn(4, 8), (torch.randn(4, 16), torch.randn(4, 16)))
    program = torch.export.export(cell, args).run_decompositions(lltm.decompositions())
    targets = {str(node.target) for node in program.graph.nodes}
    assert "fullgraph_lltm.forward.default" in targets and not any(t.startswith("fullgraph.") for t in targets)
    with torch.no_grad():
        for got, want in zip(program.module()(*args), cell(*args)):
            assert torch.equal(got, want)


def _run_with_library(tmp_path, package, inputs, operator: str, library) -> tuple:
    """The C++ program's outputs of ``package`` on ``inputs``, run once without ``library``
    (it must fail naming ``operator``) and once with it loaded (RUN_PACKAGE_LIBRARIES)."""
    torch.save(list(inputs), tmp_path / "inputs.pt")
    runner = _runner(tmp_path / "build")
    command = [str(runner), package, str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")]
    done = subprocess.run(command, env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and operator in done.stderr, done.stderr[-2000:]
    done = subprocess.run(command, env={"PATH": "/usr/bin:/bin", "RUN_PACKAGE_LIBRARIES": str(library)},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return torch.load(tmp_path / "out.pt")


@pytest.mark.deploy
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_cpp_runner_runs_an_lltm_package_with_the_extension_loaded(tmp_path, device):
    """An LLTM cell on the C++ extension exports to a program holding the extension's own
    operator (``lltm.decompositions``); its package runs from the C++ program once that loads
    the extension's library (RUN_PACKAGE_LIBRARIES), bit for bit, and without it fails
    naming the operator."""
    if shutil.which("cmake") is None or _extension.cpp_compiler() is None:
        pytest.skip("needs cmake and a C++ compiler")
    from fullgraph.ops import lltm

    if not lltm.BACKENDS.get(device).available(device):
        pytest.skip(f"the LLTM extension has no {device} kernels here")
    torch.manual_seed(0)
    cell = fullgraph.models.LLTM(32, 64, backend=device).eval().to(device)
    args = (torch.randn(8, 32, device=device), (torch.randn(8, 64, device=device), torch.randn(8, 64, device=device)))
    program = torch.export.export(cell, args).run_decompositions(lltm.decompositions())
    assert "fullgraph_lltm.forward.default" in {str(node.target) for node in program.graph.nodes}
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "lltm.pt2"))
    outputs = _run_with_library(tmp_path, package, [args[0], *args[1]], "fullgraph_lltm::forward", lltm.library())
    with torch.no_grad():
        for got, want in zip(outputs, cell(*args)):
            assert torch.equal(got, want.cpu())


class _Sample(torch.nn.Module):
    def forward(self, x, lengths):
        return fullgraph.fps(x, n_samples=64, lengths=lengths, random_start=False)


def _clouds(device):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 1000, 3, generator=generator)
    x[1, :10] = x[1, 10]  # ties: the smaller index wins
    return x.to(device), torch.tensor([1000, 700, 64, 1], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_fps_decomposes_to_the_cuda_library_only_where_it_runs_there(device):
    """``sampling.decompositions()`` puts the CUDA extension's operator in place of a call on
    backend "cuda" and leaves a call on any other backend as fullgraph's operator: the
    program computes the same samples either way."""
    from fullgraph.ops import sampling

    args = _clouds(device)
    on_library = sampling.api.BACKENDS.resolve("auto", "farthest_points", args[0].device, torch.float32, 3, 1000,
                                           "x").name == "cuda"
    program = torch.export.export(_Sample(), args).run_decompositions(sampling.decompositions())
    targets = {str(node.target) for node in program.graph.nodes}
    wanted = "fullgraph_fps.farthest_points.default" if on_library else "fullgraph.farthest_points.default"
    assert wanted in targets, targets
    assert torch.equal(program.module()(*args), _Sample()(*args))


@pytest.mark.deploy
def test_the_cpp_runner_runs_fps_with_the_cuda_library_loaded(tmp_path):
    """Farthest-point sampling on the CUDA extension (``sampling.decompositions``) packaged
    and run by the C++ program once it loads the extension (RUN_PACKAGE_LIBRARIES): the same
    indices as Python's."""
    from fullgraph.ops import sampling

    if shutil.which("cmake") is None or _extension.cpp_compiler() is None:
        pytest.skip("needs cmake and a C++ compiler")
    if not sampling.api.BACKENDS.get("cuda").available("cuda"):
        pytest.skip("needs a GPU with thread-block clusters and the fps extension")
    args = _clouds("cuda")
    program = torch.export.export(_Sample(), args).run_decompositions(sampling.decompositions())
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(tmp_path / "fps.pt2"))
    (got,) = _run_with_library(tmp_path, package, args, "fullgraph_fps::farthest_points", sampling.library())
    assert torch.equal(got, _Sample()(*args).cpu())
