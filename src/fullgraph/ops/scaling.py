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


# On CPUs, points of at least this many values are sized from their least and greatest
# coordinates, with no copy of |points|: a fresh copy's page faults cost more than its pass (2-core
# CPU, float32, ms abs + amax / aminmax: [200000, 768] 378 / 245, [100000, 128] 39 / 21); on
# smaller clouds aminmax was the slower ([16384, 64] 0.4 / 1.9).
LARGE_CPU_VALUES = 2**22


def large_on_cpu(x: Tensor) -> bool:
    """Whether x is a CPU tensor of at least LARGE_CPU_VALUES values (eager calls only)."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling() and x.numel() >= LARGE_CPU_VALUES


def magnitude(points: Tensor) -> Tensor:
    """[...]: the largest |coordinate| of each point [..., D]; NaN or inf for a point with a
    non-finite coordinate (``safe_scale`` leaves those unscaled: such points take no part)."""
    if points.shape[-1] and large_on_cpu(points):
        low, high = torch.aminmax(points, dim=-1)
        return torch.maximum(-low, high)
    return points.abs().amax(-1)


def safe_scale(size: Tensor) -> Tensor:
    """A power of two to divide coordinates of magnitude ``size`` by before squaring: 1 in
    the usual range, else the size's own power of two. Dividing by a power of two is exact,
    so a scaled distance times the scale equals the unscaled one wherever neither
    overflows or underflows: scaling changes only results that would be wrong."""
    extreme = ((size > SCALE_ABOVE) | (size < SCALE_BELOW)) & (size > 0) & torch.isfinite(size)
    _, exponent = torch.frexp(torch.where(extreme, size, 1))  # size = m 2^e, 0.5 <= m < 1
    return torch.where(extreme, torch.ldexp(torch.ones_like(size), exponent - 1), 1)


