"""Power-of-two scaling that keeps squared distances finite and exact.

The squares of float32 differences overflow beyond ~1.8e19 and lose precision below ~1e-19.
Coordinates are divided by a power of two near their magnitude first; that is exact, so a
scaled distance times the scale equals the unscaled one wherever neither overflows or
underflows, and the usual range (``SCALE_BELOW`` to ``SCALE_ABOVE``) is not scaled at all.
The neighbour operators (``neighbors.pairs``; in Triton kernels
``scaling_kernels.kernel_safe_scale``, the grid's and the dense frames') and k-means use it.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

# Magnitudes outside [2^-30, 2^40] are scaled (``kernel_safe_scale`` repeats these two).
SCALE_BELOW, SCALE_ABOVE = 2.0**-30, 2.0**40


def magnitude(points: Tensor) -> Tensor:
    """[...]: the largest |coordinate| of each point [..., D]; NaN or inf for a point with a
    non-finite coordinate (``safe_scale`` leaves those unscaled: such points take no part)."""
    return points.abs().amax(-1)


def safe_scale(size: Tensor) -> Tensor:
    """A power of two to divide coordinates of magnitude ``size`` by before squaring: 1 in
    the usual range, else the size's own power of two. Dividing by a power of two is exact,
    so a scaled distance times the scale equals the unscaled one wherever neither
    overflows or underflows: scaling changes only results that would be wrong."""
    extreme = ((size > SCALE_ABOVE) | (size < SCALE_BELOW)) & (size > 0) & torch.isfinite(size)
    _, exponent = torch.frexp(torch.where(extreme, size, 1))  # size = m 2^e, 0.5 <= m < 1
    return torch.where(extreme, torch.ldexp(torch.ones_like(size), exponent - 1), 1)


