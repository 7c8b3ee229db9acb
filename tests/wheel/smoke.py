"""Every public operator's first call from an installed wheel, on CPU tensors (with the argument
``cuda``: the C++/CUDA operators' first calls on the GPU): run by
tests/test_extension_builds.py in a fresh virtual environment with no compiler on PATH.
Prints one JSON object: the package's path, each operator's first-call seconds, and what any
call raised or warned."""

import json
import sys
import time
import warnings

import torch  # noqa: E402

import fullgraph  # noqa: E402

generator = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.rand(*shape, generator=generator)


q, r, f = rand(500, 3), rand(2000, 3), rand(2000, 8)
wide_q, wide_r = rand(300, 64), rand(1000, 64)
alphas = fullgraph.diffusion.squaredcos_cap_v2(100)
eps, x = rand(4, 16, 2), rand(4, 16, 2)
calls = {
    "knn": lambda: fullgraph.knn(q, r, 8),
    "knn feature space": lambda: fullgraph.knn(wide_q, wide_r, 8),
    "radius": lambda: fullgraph.radius(q, r, 0.1, 16),
    "knn_aggregate": lambda: fullgraph.knn_aggregate(q, r, f, 8),
    "radius_aggregate": lambda: fullgraph.radius_aggregate(q, r, f, 0.1),
    "knn_gather": lambda: fullgraph.knn_gather(f, torch.randint(0, 2000, (500, 8), generator=generator)),
    "knn_reduce": lambda: fullgraph.knn_reduce(f, fullgraph.knn(q, r, 8)[1]),
    "knn_edges": lambda: fullgraph.knn_edges(q, r, 8),
    "knn_graph": lambda: fullgraph.knn_graph(r, 8),
    "radius_edges": lambda: fullgraph.radius_edges(q, r, 0.1),
    "radius_graph": lambda: fullgraph.radius_graph(r, 0.1),
    "fps": lambda: fullgraph.fps(r, 0.25, random_start=False),
    "ball_query": lambda: fullgraph.ball_query(q[None], r[None], K=8, radius=0.1),
    "voxel_grid": lambda: fullgraph.voxel_grid(r, 0.1),
    "kmeans": lambda: fullgraph.kmeans(r, 8, seed=0),
    "kmeans_assign": lambda: fullgraph.kmeans_assign(r, r[:8]),
    "lltm": lambda: fullgraph.lltm(rand(4, 5), rand(18, 11), rand(18), rand(4, 6), rand(4, 6)),
    "narrow_mlp": lambda: fullgraph.narrow_mlp(rand(100, 3), [rand(25, 3), rand(1, 25)], [rand(25), rand(1)]),
    "ddpm_step": lambda: fullgraph.ddpm_step(eps, x, torch.tensor(50), alphas, rand(4, 16, 2)),
    "ddim_step": lambda: fullgraph.ddim_step(eps, x, torch.tensor(50), torch.tensor(40), alphas),
    "conv_groupnorm_mish": lambda: fullgraph.conv_groupnorm_mish(rand(4, 64, 16), rand(64, 64, 5) - 0.5, rand(64),
                                                                 rand(64), rand(64), 8),
}
if sys.argv[1:] == ["cuda"]:
    lltm_args = [t.cuda() for t in (rand(4, 5), rand(18, 11), rand(18), rand(4, 6), rand(4, 6))]
    calls = {"fps": lambda: fullgraph.fps(r.cuda(), 0.25, random_start=False, backend="cuda"),
             "lltm": lambda: fullgraph.lltm(*lltm_args, backend="cuda")}
seconds, problems = {}, {}
for name, call in calls.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        began = time.perf_counter()
        try:
            call()
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        except Exception as error:  # reported, not fatal: every operator gets its call
            problems[name] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:300]}"
        seconds[name] = round(time.perf_counter() - began, 3)
    if caught:
        problems.setdefault(name, f"warned: {caught[0].category.__name__}: {str(caught[0].message)[:300]}")
from fullgraph.ops.neighbors.cpu import native  # noqa: E402

print(json.dumps({"fullgraph": fullgraph.__file__, "native": native.available(), "seconds": seconds,
                  "problems": problems}))
sys.exit(0)
