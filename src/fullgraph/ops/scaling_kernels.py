"""The Triton twins of ``scaling``'s powers of two, for kernels that scale coordinates themselves."""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def kernel_power_below(size):
    """2^floor(log2(size)) of float32 size > 0 (subnormals too), from the exponent bits."""
    small = size < 1.1754943508222875e-38  # below 2^-126: lifted by 2^64 first (exact)
    lifted = tl.where(small, size * 18446744073709551616.0, size)
    power = (lifted.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(small, power * 5.421010862427522e-20, power)

@triton.jit
def kernel_safe_scale(size):
    """``safe_scale`` in a Triton kernel (float32 size): the same power of two."""
    extreme = ((size > 1099511627776.0) | (size < 9.313225746154785e-10)) & (size > 0) & (size < float("inf"))
    return tl.where(extreme, kernel_power_below(tl.where(extreme, size, 1.0)), 1.0)
