"""The certificate's arithmetic: the error bound of the expanded products
``|q|^2 + |r|^2 - 2 q.r`` and the floor it puts under the distances of the references a list
left out (the dense backend's module docstring derives it)."""

from __future__ import annotations

import torch


def roundoff(dtype: torch.dtype) -> float:
    """Unit roundoff of the product: float32 products may run in TF32 or bf16 when the user
    allowed it (torch.set_float32_matmul_precision), and the bound must hold then too."""
    if dtype == torch.float64:
        return 2.0**-53
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch >= 2.9: per-backend settings that disagree; assume the loosest
        precision = "medium"
    return {"highest": 2.0**-24, "high": 2.0**-11}.get(precision, 2.0**-8)


def beyond_expansion(value, q_abs, reach, dim: int, u: float):
    """A floor under the squared distances, as the reference measures them, of the references
    whose expanded value ``|q|^2 + |r|^2 - 2 q.r`` (D coordinates, unit roundoff u) came out
    at least ``value`` [B, m], for queries of norm ``q_abs`` [B, m] among references of norm
    at most ``reach`` (broadcasting): the expansion's error bound of the module docstring,
    then the reference's own rounding. A list whose k-th squared distance lies below it is exact."""
    return (value - 2 * (dim + 4) * u * (q_abs + reach) ** 2) * (1 - 2 * (dim + 2) * u)
