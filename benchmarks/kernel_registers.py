"""Registers and spills of the neighbour kernels the seed projectors and the 1M rows launch,
compiled for the H100 (sm_90) by Triton's own compiler and ptxas: no GPU needed.

A first process runs a small radius_aggregate (forward, backward with all three gradients),
knn_aggregate (forward, backward), kNN (k = 16) and radius search (cap 32) in Triton's
interpreter on the CPU and records each distinct launch's argument types and constants (the
host code's GPU choices); this process compiles each for sm_90 and prints what ptxas
allocated. Counts come from this machine's Triton (the device's 3.6 may differ: ncu read 122
registers for the seed's search kernel where this reads 96).

    python benchmarks/kernel_registers.py [KERNEL_NAME ...]     (~3 minutes on the 2-core development CPU)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

CAPTURE = r"""
import inspect, json, sys
import torch
import fullgraph
from fullgraph import _triton
from fullgraph.ops.neighbors.triton import kernels as triton_kernels

_triton.INTERPRETED = False  # the host code's GPU constants (it picks others for the interpreter)

launches = {}
SHOWN = ("K", "USE_RADIUS", "STATS_ONLY", "PULLS", "BLOCK_M", "BLOCK_N")  # launches told apart by these

def recorder(name, kernel):
    class Launch:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                names = kernel.arg_names
                bound = dict(zip(names, args), **kwargs)
                signature, constants = {}, {}
                for arg in names:
                    value = bound[arg]
                    if isinstance(value, torch.Tensor):
                        signature[arg] = "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                                                torch.int64: "i64", torch.int32: "i32", torch.int8: "i8",
                                                torch.bool: "i1", torch.uint8: "u8"}[value.dtype]
                    elif arg in kernel.constexpr_names:
                        signature[arg], constants[arg] = "constexpr", value
                    elif isinstance(value, bool):
                        signature[arg] = "i1"
                    elif isinstance(value, int):
                        signature[arg] = "i32" if -2**31 <= value < 2**31 else "i64"
                    else:
                        signature[arg] = "fp32"
                warps = kwargs.get("num_warps", 4)
                key = name + " " + " ".join(f"{k}={v}" for k, v in constants.items() if k in SHOWN)
                launches.setdefault(key, {"kernel": name, "signature": signature, "constants": constants,
                                          "num_warps": warps})
                return kernel[grid](*args, **kwargs)
            return launch
    return Launch()

for name in dir(triton_kernels):
    kernel = getattr(triton_kernels, name)
    if name.endswith("_kernel") and hasattr(kernel, "arg_names"):
        parameters = inspect.signature(kernel.fn).parameters.values()
        kernel.constexpr_names = {p.name for p in parameters if "constexpr" in str(p.annotation)}
        setattr(triton_kernels, name, recorder(name, kernel))

g = torch.Generator().manual_seed(0)
query = (torch.rand(1, 100, 3, generator=g) * 2 - 1).requires_grad_()
ref = torch.randn(1, 200, 3, generator=g).requires_grad_()
features = torch.randn(1, 200, 25, generator=g).requires_grad_()
out = fullgraph.radius_aggregate(query, ref, features, 0.3, sigma=0.1, backend="triton")
out.backward(torch.randn_like(out))
out = fullgraph.knn_aggregate(query, ref, features, 7, sigma=0.1, backend="triton")
out.backward(torch.randn_like(out))
fullgraph.knn(ref, ref, 16, backend="triton")  # the 1M rows' searches
fullgraph.radius(ref, ref, 0.5, 32, backend="triton")
json.dump(launches, sys.stdout)
"""


def main() -> None:
    wanted = set(sys.argv[1:])
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    recorded = json.loads(subprocess.run([sys.executable, "-c", CAPTURE], env=env, check=True,
                                         capture_output=True, text=True).stdout)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fullgraph.ops.neighbors.triton import kernels as triton_kernels

    target = GPUTarget("cuda", 90, 32)
    print(f"Triton {triton.__version__}, sm_90: registers a thread, spilled bytes, shared memory a block")
    for key, launch in sorted(recorded.items()):
        name = launch["kernel"]
        if wanted and name not in wanted:
            continue
        source = ASTSource(getattr(triton_kernels, name), launch["signature"], launch["constants"])
        compiled = triton.compile(source, target=target, options={"num_warps": launch["num_warps"]})
        blocks = {k: v for k, v in launch["constants"].items() if "BLOCK" in k or k in ("DP", "CP", "LANES")}
        print(f"{key:60s} {_ptxas_usage(compiled.asm['ptx'])}  {launch['num_warps']} warps  {blocks}", flush=True)


def _ptxas_usage(ptx: str) -> str:
    """ptxas -v's register, spill and shared-memory line for sm_90a."""
    import triton.backends.nvidia

    tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as file:
            file.write(ptx)
        for ptxas in ("ptxas-blackwell", "ptxas"):  # the newest first: Triton's PTX version may need it
            run = subprocess.run([os.path.join(tools, ptxas), "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                report = run.stderr
                break
        else:
            raise RuntimeError(f"ptxas could not assemble the kernel: {run.stderr}")
    registers = re.search(r"Used (\d+) registers", report).group(1)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    shared = re.search(r"(\d+) bytes smem", report)
    return (f"{registers:>4s} regs  spills {spills.group(1):>5s} B stored {spills.group(2):>5s} B loaded  "
            f"{shared.group(1) if shared else 0:>6} B shared")

if __name__ == "__main__":
    main()
