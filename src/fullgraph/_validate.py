"""Shared input checks. Each raises before any kernel runs, naming the argument,
what was expected and what came."""

from __future__ import annotations

import math
import numbers

import torch


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}"
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # an array: never its values
        return f"a {type(value).__name__} of shape {tuple(value.shape)}, {value.dtype}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {_describe(value)}")
    return value


def floating(name: str, value) -> torch.Tensor:
    """A floating-point tensor (float16, bfloat16, float32 or float64)."""
    tensor(name, value)
    if not value.dtype.is_floating_point:
        raise TypeError(f"{name}: expected a floating-point tensor, got {value.dtype}")
    return value


def rank(name: str, value: torch.Tensor, ranks: tuple[int, ...], layout: str) -> torch.Tensor:
    if value.dim() not in ranks:
        raise ValueError(
            f"{name}: expected shape {layout}, got {value.dim()} dimensions {tuple(value.shape)}"
        )
    return value


def same_dtype_and_device(name: str, value: torch.Tensor, other_name: str, other: torch.Tensor):
    if value.device != other.device:
        raise ValueError(
            f"{name}: expected a tensor on {other.device} like {other_name}, got {value.device}"
        )
    if value.dtype != other.dtype:
        raise TypeError(f"{name}: expected {other.dtype} like {other_name}, got {value.dtype}")


INT64_MAX = 2**63 - 1


def integer(name: str, value, minimum: int) -> int:
    """An int >= minimum, as a Python int (a symbolic one, under torch.compile(dynamic=True),
    is specialized: the operators take ints)."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name}: expected an int, got {_describe(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value}")
    if value > INT64_MAX:
        raise ValueError(f"{name}: expected an int below 2**63, got {value}")
    return int(value)


def real(name: str, value, *, minimum: float, strict: bool) -> float:
    """A finite Python number, > minimum when ``strict`` else >= minimum."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name}: expected a float, got {_describe(value)}")
    value = float(value)
    below = value <= minimum if strict else value < minimum
    # Comparisons rather than math.isfinite: under dynamic=True the float may be symbolic.
    finite = value == value and abs(value) != math.inf
    if not finite or below:
        bound = ">" if strict else ">="
        raise ValueError(f"{name}: expected a finite float {bound} {minimum}, got {value}")
    return value


def choice(name: str, value, options) -> str:
    if value not in options:
        raise ValueError(f"{name}: expected one of {sorted(options)}, got {value!r}")
    return value


# Set while a check runs on traced values outside dynamo's own tracing (fullgraph._contract),
# where torch.compiler.is_compiling() may not say so.
TRACED_CHECKS = [0]


def values_readable(device: torch.device) -> bool:
    """Whether reading a tensor's values on ``device`` is allowed here: not while
    torch.compile traces (a graph break) nor inside a CUDA graph capture (a failure)."""
    if TRACED_CHECKS[0] or torch.compiler.is_compiling():
        return False
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def read(*values: torch.Tensor) -> list[int]:
    """0-d integer or bool tensors as ints, in one host read (a sync on GPUs) for all of them."""
    return torch.stack([value.to(torch.int64) for value in values]).tolist()


def lengths(name: str, value, batch: int, maximum: int, device: torch.device) -> torch.Tensor:
    """Valid-prefix lengths: an int64 tensor of shape (batch,) with values in [0, maximum].

    The value range is checked where ``values_readable``: elsewhere the kernels clamp.
    """
    tensor(name, value)
    if value.dtype != torch.int64:
        raise TypeError(f"{name}: expected an int64 tensor, got {value.dtype}")
    if value.shape != (batch,):
        raise ValueError(f"{name}: expected shape ({batch},), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {value.device}")
    if value.numel() > 0 and values_readable(value.device):
        low, high = read(*torch.aminmax(value))
        if low < 0 or high > maximum:
            raise ValueError(
                f"{name}: expected values in [0, {maximum}], got values in [{low}, {high}]"
            )
    return value
