"""Farthest-point sampling: torch_cluster's ``fps`` and PyTorch3D's ``sample_farthest_points``.

Each sample is the point farthest from those taken so far (squared Euclidean distance in
float32, float64 for float64 inputs; ties to the smaller index); the first is the item's
first valid point (``random_start=False``) or one drawn uniformly among its valid points.
Points beyond an item's length or with a non-finite coordinate are never taken.

The padded form (x [B, N, D], lengths) reads nothing back to the host: K iterations of a few
batched tensor operations, so it compiles and runs inside CUDA graphs (replayed, the K
iterations cost no launches). The flat form with a batch vector reads the item sizes once
(its output length depends on them), like torch_cluster.
"""

from __future__ import annotations

import math

import torch

from .. import _validate
from .neighbors.batching import Padded, check_batch
from .neighbors.pairs import accumulation_dtype, full_lengths, valid_points
from .scaling import magnitude, safe_scale


def farthest_points(x: torch.Tensor, lengths: torch.Tensor | None, count: int, random_start: bool,
                    generator: torch.Generator | None) -> torch.Tensor:
    """idx [B, count] int64 of padded clouds x [B, N, D] (-1 beyond an item's valid points)."""
    batch, size, _ = x.shape
    valid = valid_points(x, lengths)
    acc = accumulation_dtype(x.dtype)
    largest = torch.where(valid, magnitude(x).to(acc), 0).amax(1) if size else x.new_zeros(batch, dtype=acc)
    points = torch.where(valid[..., None], x.to(acc) / safe_scale(largest)[:, None, None], 0)
    if random_start:
        draw = torch.rand((batch, size), generator=generator, device=x.device)
        current = torch.where(valid, draw, -1.0).argmax(1) if size else torch.zeros(batch, dtype=torch.int64,
                                                                                     device=x.device)
    else:
        current = valid.to(torch.int8).argmax(1) if size else torch.zeros(batch, dtype=torch.int64, device=x.device)
    idx = torch.empty((batch, count), dtype=torch.int64, device=x.device)
    gap = torch.where(valid, math.inf, -1.0).to(acc)  # squared distance to the nearest sample; -1: never taken
    items = torch.arange(batch, device=x.device)
    for i in range(count):
        idx[:, i] = current
        if i + 1 == count:
            break
        last = points[items, current]
        d2 = (points[..., 0] - last[:, None, 0]).square()
        for c in range(1, points.shape[-1]):
            d2 += (points[..., c] - last[:, None, c]).square()
        gap = torch.where(valid, torch.minimum(gap, d2), -1.0)
        current = gap.argmax(1)  # the first of the largest: ties go to the smaller index
    taken = valid.sum(1, keepdim=True)
    return torch.where(torch.arange(count, device=x.device)[None, :] < taken, idx, -1)


def fps(x, ratio=None, *, n_samples=None, batch=None, lengths=None, random_start=True, generator=None):
    """Farthest-point sampling of one or many point clouds.

    Two forms:

    - torch_cluster's: ``fps(x, ratio, batch=batch)`` with x [N, D] and a sorted int64 batch
      vector [N] (None: one cloud) returns the 1-D int64 indices into x of
      ``ceil(ratio * n_b)`` samples of each item b (``n_samples=`` instead: that many, at
      most n_b), item after item. One host read of the item sizes.
    - PyTorch3D's: ``fps(x, n_samples=K, lengths=lengths)`` with x [B, N, D] (lengths [B]
      int64, the valid prefixes) returns idx [B, K] int64, -1 beyond an item's valid
      points; ``ratio`` instead gives K = ceil(ratio * N). No host read: capture-safe.

    Args:
        ratio: fraction in (0, 1]. n_samples: int >= 1 (at most N in the padded form).
        random_start: draw each item's first sample uniformly among its valid points (from
            ``generator``, on x's device); else its first valid point.

    Example:
        >>> x = torch.rand(1000, 3)
        >>> fullgraph.fps(x, 0.25, random_start=False).shape
        torch.Size([250])
    """
    _validate.floating("x", x)
    _validate.rank("x", x, (2, 3), "[N, D] (with a batch vector) or [B, N, D] (with lengths)")
    if (ratio is None) == (n_samples is None):
        raise ValueError(f"ratio, n_samples: expected exactly one of them, got ratio={ratio!r}, "
                         f"n_samples={n_samples!r}")
    if ratio is not None:
        ratio = _validate.real("ratio", ratio, minimum=0.0, strict=True)
        if ratio > 1:
            raise ValueError(f"ratio: expected a fraction in (0, 1], got {ratio}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator: expected a torch.Generator, got {type(generator).__name__}")
    if x.dim() == 3:
        if batch is not None:
            raise ValueError("batch: only for flat clouds [N, D]; padded clouds [B, N, D] take lengths")
        size = x.shape[1]
        count = _validate.integer("n_samples", n_samples, minimum=1) if n_samples is not None else max(
            1, math.ceil(ratio * size))
        if count > max(size, 1):
            raise ValueError(f"n_samples: expected at most N = {size} points per cloud, got {count}")
        if lengths is not None:
            _validate.lengths("lengths", lengths, x.shape[0], size, x.device)
        return farthest_points(x, lengths, count, random_start, generator)
    if lengths is not None:
        raise ValueError("lengths: only for padded clouds [B, N, D]; flat clouds [N, D] take a batch vector")
    if batch is not None:
        check_batch("batch", batch, x)
    if n_samples is not None:
        _validate.integer("n_samples", n_samples, minimum=1)
    layout = Padded.of(batch, x.shape[0], x.device)
    sizes = layout.lengths.tolist()  # the one host read: the output length depends on it
    wanted = [min(n, n_samples) if n_samples is not None else math.ceil(ratio * n) for n in sizes]
    if not sizes or max(wanted) == 0:
        return torch.zeros(0, dtype=torch.int64, device=x.device)
    idx = farthest_points(layout.pad(x), full_lengths(layout.lengths, layout.items, layout.width, x.device),
                          max(wanted), random_start, generator)
    keep = torch.arange(idx.shape[1], device=x.device)[None, :] < torch.tensor(wanted, device=x.device)[:, None]
    rows = layout.global_index(idx, torch.arange(layout.items, device=x.device))
    return rows[keep & (rows >= 0)]
