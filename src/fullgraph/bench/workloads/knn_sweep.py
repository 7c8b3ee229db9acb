"""Feature-space kNN over a grid of shapes, widths, list lengths and dtypes: fullgraph's "auto"
beside what users write (``torch.topk(torch.cdist(q, r), k, largest=False)``), in each mode a
user calls it: as called (eager), compiled (``torch.compile(fullgraph=True, dynamic=True)``) and
replayed from a CUDA graph; on CPUs FAISS's exact index too, where faiss is installed.

A row's variant names its cell (B, M x N, D, k, dtype), the implementation and the mode;
``--plot`` draws the heat map of cdist + topk's time over fullgraph's per cell and mode (> 1:
fullgraph faster). The eager "auto" row carries how many of 256 sampled queries got other
lists than the "torch" reference (must be 0), and, for the cells a size lists under ``first``,
the first call's wall time in a fresh process with empty Triton and Inductor caches (cold) and
again with the caches that process left (warm).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import torch

from ...ops.neighbors import knn
from .base import Case, Workload, register, replayed

SAMPLES = 256
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# What the first-call probe runs in a fresh process (argv: device, B, M, N, D, k, dtype).
_FIRST_CALL = """
import sys, time, torch
device, (b, m, n, d, k), dtype = sys.argv[1], map(int, sys.argv[2:7]), getattr(torch, sys.argv[7])
q, r = (torch.randn(b, rows, d, device=device, dtype=dtype) for rows in (m, n))
import fullgraph
if device == "cuda":
    torch.cuda.synchronize()
start = time.perf_counter()
fullgraph.knn(q, r, k)
if device == "cuda":
    torch.cuda.synchronize()
print(time.perf_counter() - start)
"""


def first_calls(device: str, cell: tuple) -> dict:
    """Wall seconds of fullgraph.knn's first call on ``cell`` (B, M, N, D, k, dtype) in a fresh
    process: with empty caches (cold), then with the caches the first process left (warm)."""
    times = {}
    with tempfile.TemporaryDirectory() as caches:
        # (kernels compiled in the background, as a user's first call meets them, whatever the
        # benchmark's own process was told)
        env = {**{n: v for n, v in os.environ.items() if n != "FULLGRAPH_BACKGROUND_COMPILE"},
               "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
               "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor")}
        for name in ("first_call_cold_s", "first_call_warm_s"):
            done = subprocess.run([sys.executable, "-c", _FIRST_CALL, device, *map(str, cell)], env=env,
                                  capture_output=True, text=True, timeout=600)
            if done.returncode:
                times[name.replace("_s", "_error")] = (done.stderr.strip().splitlines() or ["?"])[-1][:300]
                break
            times[name] = float(done.stdout.split()[-1])
    return times


def _label(cell) -> str:
    batch, m, n, dim, k, dtype = cell
    return f"B={batch} {m}x{n} D={dim} k={k} {dtype}"


def _calls(fn, query, ref, device) -> dict:
    """{mode: a call of ``fn`` on query and ref}: as called, compiled and, on CUDA, graphed."""
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    calls = {"as called": lambda: fn(query, ref), "compiled": lambda: compiled(query, ref)}
    if device.type == "cuda":
        calls["graphed"] = replayed(calls["as called"], device)
    return calls


def exact_peer(device: torch.device, dtype: str):
    """FAISS's exact index (``IndexFlatL2``, the threads FAISS is given) a batch item at a time,
    as its users call it on float32 CPU tensors: (distances, indices) [B, M, k]; None where
    faiss is not installed or the cell is not one it takes."""
    if device.type != "cpu" or dtype != "float32":
        return None
    try:
        import faiss
    except ImportError:
        return None

    def search(query, ref, k):
        found = []
        for q, r in zip(query.numpy(), ref.numpy()):
            index = faiss.IndexFlatL2(r.shape[-1])
            index.add(r)
            squared, idx = index.search(q, k)
            found.append((torch.from_numpy(squared).sqrt_(), torch.from_numpy(idx)))
        return torch.stack([d for d, _ in found]), torch.stack([i for _, i in found])

    return search


def _cells(params, device, generator):
    """(cell, whether its first call is probed, query, ref) of each cell, the probed cells
    included where ``cells`` lacks them."""
    first = {tuple(cell) for cell in params.get("first", ())}
    listed = [tuple(cell) for cell in params["cells"]]
    for cell in listed + sorted(first - set(listed)):
        batch, m, n, dim, k, dtype = cell
        if k > n:
            continue
        query = torch.randn(batch, m, dim, generator=generator, device=device).to(DTYPES[dtype])
        ref = torch.randn(batch, n, dim, generator=generator, device=device).to(DTYPES[dtype])
        yield cell, cell in first, query, ref


def _knn_sweep(params, device):
    generator = torch.Generator(device=device).manual_seed(0)
    cases = []
    for cell, probe_first, query, ref in _cells(params, device, generator):
        k = cell[4]
        label = _label(cell)
        rows = torch.randint(0, cell[1], (min(cell[1], SAMPLES),), generator=generator, device=device)

        def plain(q, r, k=k):
            return torch.topk(torch.cdist(q, r), k, largest=False)

        def ours(q, r, k=k):
            return knn(q, r, k)

        def check(query=query, ref=ref, k=k, rows=rows, cell=cell, probe_first=probe_first):
            want = knn(query[:, rows], ref, k, backend="torch")[1]
            fields = {"mismatched_sampled_queries": int((knn(query, ref, k)[1][:, rows] != want).any(-1).sum())}
            return {**fields, **(first_calls(device.type, cell) if probe_first else {})}

        for impl, fn in (("cdist + topk", plain), ("fullgraph auto", ours)):
            for mode, call in _calls(fn, query, ref, device).items():
                extra = check if (impl, mode) == ("fullgraph auto", "as called") else None
                cases.append(Case(f"{label}: {impl}, {mode}", call, check=extra, group=label))
        peer = exact_peer(device, cell[5])
        if peer is not None:  # (no compiled or graphed mode: FAISS runs outside torch)
            cases.append(Case(f"{label}: faiss exact, as called",
                              lambda q=query, r=ref, k=k, peer=peer: peer(q, r, k), group=label))
    return cases


def _grid(shapes, dims, ks, dtypes=("float32",)):
    return [[b, m, n, d, k, t] for b, m, n in shapes for d in dims for k in ks for t in dtypes]


# The shapes of the issue that asked for this sweep (H100 first measurements), the rows every
# size keeps.
_REPORTED = [[16, 256, 256, 64, 20, "float32"], [16, 2048, 2048, 32, 16, "float32"],
             [1, 10_000, 200_000, 256, 10, "float32"], [1, 10_000, 100_000, 768, 10, "float32"],
             [4, 3000, 3000, 300, 24, "float32"], [1, 2000, 50_000, 1024, 50, "float32"]]
_FIRST = [[1, 2000, 50_000, d, 10, "float32"] for d in (256, 300, 768, 1024, 2048)]
_FULL_DIMS = (2, 3, 4, 8, 16, 32, 64, 96, 128, 192, 256, 300, 512, 768, 1024, 2048)
_FULL_SHAPES = ((16, 256, 256), (8, 2048, 2048), (1, 10_000, 100_000), (1, 10_000, 1_000_000))

register(Workload(
    name="knn-sweep",
    description="feature-space kNN over widths, list lengths, shapes and dtypes: fullgraph auto beside "
                "cdist + topk, as called, compiled and graphed",
    sizes={
        # minutes on a GPU: the reported shapes, a width sweep on three shapes, long lists, half precision
        "quick": {"cells": _REPORTED + _grid(((16, 256, 256), (4, 3000, 3000), (1, 10_000, 200_000)),
                                            (8, 64, 256, 768), (16,))
                  + _grid(((4, 3000, 3000),), (64,), (1, 64, 256)) + [[1, 2000, 50_000, 128, 1024, "float32"]]
                  + [[16, 256, 256, 64, 20, "bfloat16"], [4, 3000, 3000, 256, 16, "bfloat16"]],
                  "first": _FIRST + [[1, 10_000, 200_000, 256, 10, "float32"]]},
        # the widths beyond the tensor-core kernels' (D > 128), a couple of minutes on a GPU
        "wide": {"cells": [c for c in _REPORTED if c[3] > 128]
                 + _grid(((16, 256, 256), (4, 3000, 3000), (1, 10_000, 200_000)), (256, 768), (16,))
                 + [[4, 3000, 3000, 2048, 16, "float32"], [4, 3000, 3000, 256, 16, "bfloat16"]],
                 "first": _FIRST},
        # batches of small clouds across widths (on a GPU a few launches a call: where host time
        # and the re-measure of wide members weigh most)
        "batched": {"cells": _grid(((16, 256, 256),), (96, 128, 192, 300, 512, 768, 1024, 1536, 2048), (16, 64))},
        # what a CPU runs in minutes
        "small": {"cells": _grid(((16, 256, 256), (2, 1024, 1024), (1, 2000, 20_000)), (8, 64, 256), (16,))
                  + [[16, 256, 256, 64, 64, "float32"], [16, 256, 256, 256, 64, "float32"],
                     [4, 512, 512, 64, 256, "float32"], [16, 256, 256, 64, 16, "bfloat16"],
                     [16, 256, 256, 64, 16, "float16"], [2, 64, 300, 16, 4, "bfloat16"]],
                  "first": [[1, 2000, 20_000, 256, 16, "float32"]]},
        # single large clouds on a CPU, where FAISS's exact index is the peer (minutes on 2 cores)
        "peers": {"cells": [[1, 2000, 100_000, 128, 10, "float32"], [1, 2048, 16_384, 64, 20, "float32"],
                            [1, 1000, 200_000, 768, 10, "float32"], [1, 5000, 50_000, 16, 10, "float32"]]},
        # long lists on mid-size clouds and lists of nearly every reference, on a CPU (a minute)
        "lists": {"cells": _grid(((1, 1000, 1000),), (8, 32, 512), (256,))
                  + [[4, 1000, 1000, 32, 256, "float32"], [4, 300, 300, 512, 256, "float32"],
                     [3, 500, 5000, 64, 1024, "float32"], [1, 500, 5000, 256, 1024, "float32"],
                     [2, 64, 70, 128, 64, "float32"], [1, 64, 64, 512, 64, "float32"]]},
        "tiny": {"cells": [[2, 64, 300, 16, 4, "float32"], [1, 50, 400, 200, 8, "float32"]],
                 "first": [[1, 50, 400, 200, 8, "float32"]]},
        "full": {"cells": _REPORTED + _grid(_FULL_SHAPES, _FULL_DIMS, (1, 4, 16, 64, 256, 1024),
                                            ("float32", "bfloat16", "float16")),
                 "first": _FIRST},
    },
    build=_knn_sweep,
    baseline="",
))

