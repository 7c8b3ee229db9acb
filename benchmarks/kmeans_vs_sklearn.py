"""Whole k-means fits, fullgraph.KMeans(backend="fullgraph") (the compiled NumPy steps)
against scikit-learn's KMeans on the same data, from
the same initial centroids (so both run the same iterations) and each with its own
k-means++; wall time of fit() including initialization, median of a few fits.

    python benchmarks/kmeans_vs_sklearn.py [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from sklearn.cluster import KMeans as SklearnKMeans

import fullgraph

SHAPES = [(200_000, 16, 20), (1_000_000, 2, 8), (50_000, 64, 100)]  # n, d, k


def _seconds(fit, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fit()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# {torch.get_num_threads()} threads, torch {torch.__version__}, fullgraph on {args.device}, "
          f"scikit-learn on the CPU; seconds per fit (median of {args.repeats})")
    print("n d k | init | sklearn s (iters) | fullgraph s (iters) | inertia sklearn / fullgraph")
    rng = np.random.default_rng(0)
    for n, d, k in SHAPES:
        x = rng.standard_normal((n, d)).astype(np.float32)
        data = x if args.device == "cpu" else torch.from_numpy(x).to(args.device)
        init = x[rng.choice(n, k, replace=False)]
        for label, options, ours in (("same centroids", {"init": init}, {"init": init}),
                                     ("own k-means++", {"random_state": 0}, {"random_state": 0})):
            theirs = SklearnKMeans(n_clusters=k, n_init=1, max_iter=300, **options)
            model = fullgraph.KMeans(n_clusters=k, n_init=1, max_iter=300, backend="fullgraph", **ours)
            fullgraph.KMeans(n_clusters=k, max_iter=2, backend="fullgraph").fit(data)  # compiles the steps first
            s_theirs = _seconds(lambda: theirs.fit(x), args.repeats)
            s_ours = _seconds(lambda: model.fit(data), args.repeats)
            print(f"{n} {d} {k} | {label} | {s_theirs:.3f} ({theirs.n_iter_}) | {s_ours:.3f} ({model.n_iter_}) | "
                  f"{theirs.inertia_:.6g} / {float(model.inertia_):.6g}", flush=True)


if __name__ == "__main__":
    main()
