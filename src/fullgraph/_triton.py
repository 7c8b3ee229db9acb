"""Triton, where installed, and what the host code that launches Triton kernels needs.

Kernel modules import triton at their top; the modules that launch them reach them through
``lazy``, so ``import fullgraph`` needs no Triton and a kernel module is imported only when
one of its kernels first runs.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import types

import torch


# Triton's interpreter runs the kernels on CPU tensors (slowly): the CPU tests use it.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
INSTALL = "triton: pip install triton (it comes with CUDA builds of torch)"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0 (``triton.cdiv`` without Triton)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n, 0 for n = 0 (``triton.next_power_of_2`` without Triton)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


class _Lazy(types.ModuleType):
    """A module imported on first use; reads and writes of its attributes go to it."""

    def __init__(self, name: str):
        super().__init__(name)
        object.__getattribute__(self, "__dict__")["_loaded"] = None

    def _module(self) -> types.ModuleType:
        # Cached after the first import: launchers read kernels and constants on every call,
        # so every read goes straight to the module (no failed lookup first, as __getattr__ has).
        state = object.__getattribute__(self, "__dict__")
        if state["_loaded"] is None:
            state["_loaded"] = importlib.import_module(state["__name__"])
        return state["_loaded"]

    def __getattribute__(self, attr: str):
        return getattr(_Lazy._module(self), attr)

    def __setattr__(self, attr: str, value) -> None:
        setattr(_Lazy._module(self), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(_Lazy._module(self), attr)


def lazy(name: str) -> types.ModuleType:
    """The kernel module ``name`` (absolute), imported when first used."""
    return _Lazy(name)


def _installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ValueError:  # sys.modules["triton"] is None: treated as not installed
        return False


# Read once at import: ``available`` runs inside code torch.compile traces, which cannot call find_spec.
INSTALLED = _installed()


def available(device_type: str = "cuda") -> bool:
    """Whether Triton is installed (its kernels are imported only when one first runs)."""
    return INSTALLED


def devices() -> tuple[str, ...]:
    """The device types Triton kernels run on here."""
    return ("cuda", "cpu") if INTERPRETED else ("cuda",)


def op(name: str, *, mutates_args=()):
    """``torch.library.triton_op(name)``: a custom operator whose function launches Triton
    kernels through ``traced``, which Inductor and ``run_decompositions`` trace into. Under
    Triton's interpreter (CPU tests), whose kernels cannot be traced, a plain custom operator
    with the function itself as its fake (its launches skip fake tensors)."""
    if not INTERPRETED:
        return torch.library.triton_op(name, mutates_args=mutates_args)

    def define(fn):
        defined = torch.library.custom_op(name, fn, mutates_args=mutates_args)
        defined.register_fake(fn)
        return defined
    return define


def tracing(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a tracer's (fake, or functional: Inductor tracing a ``triton_op``),
    not one a kernel runs on: host state such as cached device buffers stays out of traces."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(tensor, (FakeTensor, FunctionalTensor))


def traced(kernel):
    """``torch.library.wrap_triton(kernel)``, for launches inside a ``torch.library.triton_op``:
    Inductor traces into them and AOTInductor packages carry the kernel. Under Triton's
    interpreter a launch on fake tensors (a trace, whose outputs are shapes only) does nothing."""
    from torch.library import wrap_triton

    if not INTERPRETED:
        return wrap_triton(kernel)
    return _Interpreted(kernel)


class _Interpreted:
    def __init__(self, kernel, grid=None):
        self.kernel, self.grid = kernel, grid

    def __getitem__(self, grid):
        return _Interpreted(self.kernel, grid)

    def __call__(self, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor

        if not any(isinstance(a, FakeTensor) for a in (*args, *kwargs.values())):
            self.kernel[self.grid](*args, **kwargs)


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device: how many programs run at once, one per SM."""
    return torch.cuda.get_device_properties(device).multi_processor_count
