"""Triton, where installed: the one import of it for every module with Triton kernels."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - backends that need it report it when asked for
    triton = tl = None

# Triton's interpreter runs the kernels on CPU tensors (slowly): the CPU tests use it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INSTALL = "triton: pip install triton (it comes with CUDA builds of torch)"


def available(device_type: str = "cuda") -> bool:
    return triton is not None


def devices() -> tuple[str, ...]:
    """The device types Triton kernels run on here."""
    return ("cuda", "cpu") if INTERPRETED else ("cuda",)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: how many programs run at once, one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count
