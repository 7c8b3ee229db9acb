"""Backends: what each implementation of an operator family supports, and the one place
that picks one.

A backend is one module that declares a ``Backend`` record (its name, the ops it
implements, devices, dtypes, limits on D and k, whether it can be captured in a CUDA
graph, what to install) next to its kernels; its family lists it once, in order of
preference (``family(...)``). ``resolve`` picks a backend for ``"auto"`` (the first one,
in that order, that fits the tensors and is installed) or checks an explicit choice, and
words the refusal: ValueError for a device, op, D or k it does not cover, TypeError for a
dtype, ImportError naming the package when its library is missing.

Adding a backend: write the module (its ``Backend`` with ``implementation`` set to its
kernels), and add its record to the family's list (for the neighbour operators, in
``ops/neighbors/registration.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .graphs import GraphCaptureError

FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
ANY_DEVICE = "any"


def _always(device_type: str) -> bool:
    return True


def _everywhere(device_type, dtype, dim, k, size=None) -> bool:
    return True


@dataclass(frozen=True)
class Backend:
    """One implementation of an operator family.

    devices / auto_devices: torch device types it runs on / where "auto" may pick it
    (``ANY_DEVICE`` for all); auto_when(device_type, dtype, dim, k, size): where "auto"
    prefers it (the measured crossovers against the backends after it; size: the work's size
    where the family knows one, e.g. query-reference pairs per batch item, else None). dims:
    the D it accepts (None: any). max_k: the longest neighbour list (None: any). capturable:
    its kernels may run inside a CUDA graph capture (no host sync, no allocation outside
    PyTorch): True, False, the ops that may, or a function (op, dtype, dim, k) -> bool. available(device_type): whether
    its library is installed (and, for a compiled one, buildable) for that device; install:
    what brings it there. implementation: the family's kernel interface.
    """

    name: str
    ops: tuple[str, ...]
    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = FLOATING
    auto_devices: tuple[str, ...] = ()
    dims: tuple[int, ...] | None = None
    max_k: int | None = None
    capturable: bool | tuple[str, ...] | Callable[[str, torch.dtype, object, int], bool] = True
    install: str = ""
    available: Callable[[str], bool] = _always
    implementation: object = None
    note: str = ""  # why a dtype is refused, e.g. "computes in float32"
    auto_when: Callable[..., bool] = _everywhere  # the measured crossovers for "auto"

    def runs_on(self, device_type: str) -> bool:
        return ANY_DEVICE in self.devices or device_type in self.devices

    def fits(self, op: str, device_type: str, dtype: torch.dtype, dim, k, size=None) -> bool:
        """Whether "auto" may pick it for these tensors (installed included)."""
        return (op in self.ops and (ANY_DEVICE in self.auto_devices or device_type in self.auto_devices)
                and dtype in self.dtypes and (self.dims is None or dim is None or dim in self.dims)
                and (self.max_k is None or k <= self.max_k)
                and _holds(self.auto_when(device_type, dtype, dim, k, size)) and self.available(device_type))

    def check(self, op: str, device_type: str, dtype: torch.dtype, dim, k, argument: str,
              k_argument: str = "k") -> None:
        """Raise the error a user sees when asking for this backend explicitly."""
        if op not in self.ops:
            raise ValueError(f'backend: "{self.name}" provides {" and ".join(self.ops)}, not {op}')
        if not self.runs_on(device_type):
            wanted = " or ".join(d.upper() for d in self.devices)
            raise ValueError(f'backend: "{self.name}" needs {wanted} tensors, got tensors on {device_type}')
        if not self.available(device_type):
            raise ImportError(f'backend="{self.name}" needs {self.install}')
        if self.dims is not None and dim is not None and dim not in self.dims:
            wanted = " or ".join(str(d) for d in self.dims)
            raise ValueError(f'{argument}: backend="{self.name}" needs D = {wanted}, got D = {dim}')
        if dtype not in self.dtypes:
            wanted = "/".join(str(d).removeprefix("torch.") for d in self.dtypes)
            raise TypeError(f'{argument}: backend="{self.name}" {self.note or "takes " + wanted}, got {dtype}')
        if self.max_k is not None and k > self.max_k:
            raise ValueError(f'{k_argument}: backend="{self.name}" supports up to {self.max_k} neighbours, got {k}')


    def captures(self, op: str, dtype: torch.dtype = torch.float32, dim=None, k: int = 1) -> bool:
        if callable(self.capturable):
            return self.capturable(op, dtype, dim, k)
        return self.capturable is True or (isinstance(self.capturable, tuple) and op in self.capturable)

    def check_capture(self, device: torch.device, op: str, dtype: torch.dtype = torch.float32, dim=None,
                      k: int = 1) -> None:
        """Refuse to run ``op`` (on ``dtype``, D = ``dim``, lists of ``k``) inside a CUDA graph capture when
        its kernels cannot be captured, before anything is launched (a failed capture would
        invalidate the whole graph)."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing() and not self.captures(op, dtype, dim, k):
            raise GraphCaptureError(
                f'backend="{self.name}" runs {op} ({str(dtype).removeprefix("torch.")}, D = {dim}, lists of {k}) with a host '
                "synchronization or allocations outside PyTorch, so it cannot run inside a CUDA graph capture; "
                'choose a capturable backend, or leave this call out of the graph (torch.compile without '
                'mode="reduce-overhead")')


def _holds(verdict) -> bool:
    """A rule's verdict. On sizes torch.export keeps symbolic, true only where it holds for
    every size: a guard there would pin a size the export was asked to keep dynamic (the
    rule's other side, the next backend, runs at every size)."""
    if isinstance(verdict, torch.SymBool) and torch.compiler.is_exporting():
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return statically_known_true(verdict)
    return bool(verdict)


@dataclass(frozen=True)
class Family:
    """The backends of one operator family, in order of preference for "auto"."""

    name: str
    backends: tuple[Backend, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return ("auto",) + tuple(b.name for b in self.backends)

    def get(self, name: str) -> Backend:
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise ValueError(f"backend: expected one of {sorted(self.names)}, got {name!r}")

    def resolve(self, choice, op: str, device: torch.device, dtype: torch.dtype, dim=None, k: int = 1,
                argument: str = "query", k_argument: str = "k", size=None) -> Backend:
        """The backend ``choice`` ("auto" or a name) for ``op`` on tensors of this device,
        dtype and D, holding lists of k (``size``: see ``Backend``); raises as the class docstring says, naming
        ``argument`` (the tensor) and ``k_argument`` (the list length) as the caller calls them."""
        if not isinstance(choice, str):
            raise TypeError(f"backend: expected a str, one of {sorted(self.names)}, got {type(choice).__name__}")
        if choice == "auto":
            for backend in self.backends:
                if backend.fits(op, device.type, dtype, dim, k, size):
                    return backend
            raise ValueError(f"{self.name}: no backend runs {op} on {dtype} tensors on {device}")
        backend = self.get(choice)
        backend.check(op, device.type, dtype, dim, k, argument, k_argument)
        return backend


def family(name: str, *backends: Backend) -> Family:
    """Declare an operator family's backends, most preferred first."""
    names = [b.name for b in backends]
    if len(set(names)) != len(names) or "auto" in names:
        raise ValueError(f"backends: names must be unique and not 'auto', got {names}")
    return Family(name, backends)
