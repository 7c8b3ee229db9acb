"""The seed Diffusion Policy's 10-step DDIM sampler (ConditionalUnet1D 256/512/1024 in
bfloat16, fullgraph's fused DDIM step, batch 1) with two U-Nets: "fused-block" (its blocks
fullgraph's fused conv blocks, the other convolutions products) and "matmul-conv" (every
convolution a product). Each timed three ways on one GPU: the Python graphed loop (as
``fullgraph bench diffusion-policy`` runs it), and its AOTInductor package from this folder's
C++ runner, as called and as a captured CUDA graph replayed. Writes result rows like
``fullgraph bench``'s:

    python examples/deploy/time_sampler.py --json benchmarks/results/<device>/deploy-ddim.json

Needs CUDA, cmake and a C++ compiler; packaging takes one to two minutes a U-Net.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from fullgraph import graphs
from fullgraph.bench.runner import environment
from fullgraph.diffusion import DDIMSampler, denoise_ddim
from fullgraph.models.unet1d import ConditionalUnet1D, fuse_conv_blocks, matmul_convolutions
from fullgraph.ops import conv_block

PARAMS = {"batch": 1, "train_steps": 100, "ddim_steps": 10, "down_dims": [256, 512, 1024], "cond": 1028,
          "dtype": "bfloat16"}
U_NETS = ("fused-block", "matmul-conv")
# Packaged, each fused block's arrival counters are zeros of its own (a fill): combo kernels
# make the U-Net's 25 fills 5 kernels (H200, the loop 3.07 -> 2.83 ms in Python).
INDUCTOR_CONFIGS = {"combo_kernels": True}


def build_runner(build: Path) -> Path:
    """This folder's C++ runner built with CMake against this torch's libtorch, into ``build``."""
    source = Path(__file__).parent
    for command in (["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                     f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"], ["cmake", "--build", str(build)]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command[:2])} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return build / "run_package"


def _python_loop(net, x, cond, sampler, runs: int) -> tuple[list[float], torch.Tensor]:
    loop = graphs.graphed(torch.no_grad()(functools.partial(denoise_ddim, torch.compile(net, fullgraph=True))),
                          warmup=2)
    args = (x, cond, sampler.alphas_cumprod, sampler.timesteps, True)
    for _ in range(5):
        loop(*args)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loop(*args)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times, loop(*args)


def _u_net(unet, kind: str):
    """The bfloat16 U-Net of ``kind`` (U_NETS) from a copy of ``unet``."""
    net = copy.deepcopy(unet)
    if kind == "fused-block":
        net = fuse_conv_blocks(net, "triton")
    return matmul_convolutions(net).to(torch.bfloat16)


def _time(kind: str, unet, x, cond, want, runner: Path, folder: Path, runs: int) -> list[dict]:
    """The rows of one U-Net: the Python graphed loop, then its package from C++ as called and replayed."""
    device = x.device
    net = _u_net(unet, kind)
    sampler = DDIMSampler(net, steps=PARAMS["ddim_steps"], train_steps=PARAMS["train_steps"]).to(device).eval()
    python = f"python graphed loop, compiled {kind} bf16 U-Net"
    times, out = _python_loop(net, x, cond, sampler, runs)
    timings, deviations = {python: times}, {python: float((out.float() - want).abs().max())}
    started = time.perf_counter()
    # The fused blocks as their triton_op form: Inductor traces into it and the package holds its kernels.
    program = torch.export.export(sampler, (x, cond)).run_decompositions(conv_block.decompositions())
    package = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / f"{kind}.pt2"),
                                                       inductor_configs=INDUCTOR_CONFIGS)
    packaged_s = time.perf_counter() - started
    for name, mode in ((f"C++ runner, {kind} U-Net package as called", []),
                       (f"C++ runner, {kind} U-Net package, captured CUDA graph replayed", ["graph"])):
        done = subprocess.run([str(runner), package, str(folder / "inputs.pt"), str(folder / "out.pt"), str(runs),
                               *mode], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True)
        timings[name] = [float(done.stdout.split()[-1])]
        (got,) = torch.load(folder / "out.pt")
        deviations[name] = float((got.to(device).float() - want).abs().max())
    rows, base = [], statistics.median(timings[python])
    for name, times in timings.items():
        median = statistics.median(times)
        rows.append({"workload": "deploy-ddim", "size": "seed", "params": {**PARAMS, "u_net": kind}, "variant": name,
                     "phase": "forward", **environment(device), "median_ms": median, "runs": runs, "baseline": python,
                     "speedup_vs_eager": base / median, "peak_memory_bytes": None, "first_call_s": None,
                     "max_abs_diff_vs_eager_ddim": deviations[name],
                     "packaged_s": None if name == python else round(packaged_s, 1)})
        print(f"{name}: {median:.3f} ms, max abs diff vs the eager sampler {deviations[name]:.4f}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--u-net", choices=U_NETS, action="append", help="the U-Nets to time (default: both)")
    options = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    unet = ConditionalUnet1D(down_dims=tuple(PARAMS["down_dims"]), global_cond_dim=PARAMS["cond"]).to(device).eval()
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(1, unet.horizon, unet.action_dim, device=device, generator=generator)
    cond = torch.randn(1, PARAMS["cond"], device=device, generator=generator)
    with torch.no_grad():  # the float32 sampler, eager
        want = DDIMSampler(unet, steps=PARAMS["ddim_steps"], train_steps=PARAMS["train_steps"]).to(device).eval()(
            x, cond).float()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        runner = build_runner(folder / "build")
        torch.save([x, cond], folder / "inputs.pt")
        for kind in options.u_net or U_NETS:
            rows += _time(kind, unet, x, cond, want, runner, folder, options.runs)
            if options.json:  # after each U-Net
                options.json.parent.mkdir(parents=True, exist_ok=True)
                options.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
