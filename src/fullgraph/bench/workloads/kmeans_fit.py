"""Whole k-means fits, as scikit-learn users run them: ``sklearn.cluster.KMeans.fit`` against
``fullgraph.KMeans(backend="fullgraph")`` (the compiled NumPy steps) on the same data from
the same initial centroids, so both run the same Lloyd iterations. On CPUs these rows are
why ``fullgraph.KMeans(backend="auto")`` hands CPU data to scikit-learn."""

from __future__ import annotations

import numpy as np
import torch

from ...ops.kmeans import KMeans
from .base import Case, Workload, register

SKLEARN = "scikit-learn KMeans.fit"


def _fit_fields(model) -> dict:
    return {"iterations": int(model.n_iter_), "inertia": float(model.inertia_)}


def _fits(params, device):
    """forward = one whole fit (300 iterations at most, scikit-learn's tolerance)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((params["points"], params["dim"])).astype(np.float32)
    init = x[rng.choice(len(x), params["clusters"], replace=False)]
    data = torch.from_numpy(x).to(device)
    ours = KMeans(params["clusters"], init=init, max_iter=300, backend="fullgraph")
    cases = [Case("fullgraph KMeans.fit, compiled NumPy steps", lambda: ours.fit(data),
                  check=lambda: _fit_fields(ours.fit(data)))]
    try:
        from sklearn.cluster import KMeans as SklearnKMeans
    except ImportError:
        return cases
    theirs = SklearnKMeans(params["clusters"], init=init, n_init=1, max_iter=300)
    return [Case(SKLEARN, lambda: theirs.fit(x), check=lambda: _fit_fields(theirs.fit(x))), *cases]


register(Workload(
    name="kmeans-fit",
    description="whole k-means fits from the same initial centroids: scikit-learn (CPU) against fullgraph's "
                "compiled NumPy steps on the chosen device",
    sizes={"seed": {"points": 200_000, "dim": 16, "clusters": 20}, "small": {"points": 50_000, "dim": 64, "clusters": 100},
           "wide": {"points": 1_000_000, "dim": 2, "clusters": 8}, "tiny": {"points": 4000, "dim": 8, "clusters": 5}},
    build=_fits,
    notes=["scikit-learn runs on the CPU whatever --device says; iterations and inertia are in each row"],
    baseline=SKLEARN,
))
