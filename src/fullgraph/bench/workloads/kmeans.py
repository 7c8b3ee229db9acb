"""The NumPy-compilation tutorial's k-means in NumPy: the tutorial's code, compiled, on tensors, and scikit-learn."""

from __future__ import annotations

import numpy as np
import torch

from ...ops import kmeans as kmeans_ops
from .base import Case, Workload, register


def _document_kmeans(x, means):
    """The NumPy-compilation tutorial's NumPy assignment step, verbatim."""
    return np.argmin(np.linalg.norm(x - means[:, None], axis=2), axis=0)


def _kmeans(params, device):
    """forward = the assignment step, train = one Lloyd iteration (assign + update)."""
    generator = np.random.default_rng(0)
    half = params["points"] // 2
    x = np.repeat(np.array([[5, 5], [10, 10]], dtype=np.float32), [half, half], axis=0)
    x += generator.standard_normal(x.shape, dtype=np.float32)
    means = np.array([[5, 5], [10, 10]], dtype=np.float32)
    x_device, means_device = torch.from_numpy(x).to(device), torch.from_numpy(means).to(device)
    compiled_document = torch.compile(_document_kmeans)
    # The tutorial's tensor wrapper; called without its `with torch.device("cuda")`, which
    # fails inside the compiler on torch 2.11.
    document_on_tensors = torch.compile(lambda x, m: torch.from_numpy(_document_kmeans(x.numpy(), m.numpy())))
    cases = [
        Case("document eager", lambda: _document_kmeans(x, means),
             lambda: kmeans_ops.lloyd_step_numpy(x, means)),
        Case("document compiled", lambda: compiled_document(x, means)),
        Case(f"document compiled, {device.type} tensors", lambda: document_on_tensors(x_device, means_device)),
        Case("fullgraph compiled", lambda: kmeans_ops.kmeans_assign(x_device, means_device),
             lambda: kmeans_ops.lloyd_step(x_device, means_device)),
    ]
    try:
        from sklearn.cluster import KMeans
        from sklearn.metrics import pairwise_distances_argmin
    except ImportError:
        return cases
    one_iteration = KMeans(2, init=means, n_init=1, max_iter=1, algorithm="lloyd")
    # "train" is a whole KMeans.fit of one iteration: its input checks and setup included, so it
    # is no per-iteration figure (`fullgraph bench kmeans-fit` compares whole fits).
    cases.append(Case("scikit-learn (train: fit of 1 iteration, setup included)",
                      lambda: pairwise_distances_argmin(x, means), lambda: one_iteration.fit(x)))
    return cases


register(Workload(
    name="kmeans",
    description="NumPy k-means: the assignment step (forward) and one Lloyd iteration (train), 2-D float32 points, "
                "2 clusters; NumPy and scikit-learn on the CPU, fullgraph on the chosen device",
    sizes={"seed": {"points": 20_000_000}, "small": {"points": 1_000_000}, "tiny": {"points": 20_000}},
    build=_kmeans,
    notes=[("floors on an H100 (~3 TB/s), seed size: the assignment reads 160 MB of points and writes 160 MB "
            "of int64 labels, ~0.107 ms; a Lloyd iteration as written (assign, then sum the clusters reading "
            "points and labels again) moves 640 MB, ~0.21 ms")],
))
