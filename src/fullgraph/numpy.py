"""Run functions written in NumPy on torch tensors, on any device, through ``torch.compile``.

    @fullgraph.numpy.jit
    def nearest(x, centroids):
        return np.argmin(((x[:, None] - centroids[None]) ** 2).sum(-1), axis=1)

    labels = nearest(points, centroids)   # tensors on the GPU: runs there, no copies

The compiler reads the ``x.numpy()`` / ``torch.from_numpy`` around the function as hints
and keeps the data where it is: tensors in, tensors out, on their device. NumPy arrays in
give NumPy arrays out (computed on the CPU). Arrays a function creates from nothing
(``np.zeros(n)``, ``np.arange(k)``) are created on the CPU; derive them from an input
(``np.zeros_like(x)``, ``np.ones_like(x[:, 0])``) to keep them on the input's device.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading

import numpy as np
import torch

from . import _extension

DEFAULT_FLOATS = ("float64", "float32")
STATIC_VARIANTS = 32  # compiled variants a dynamic=False function keeps (least recently used dropped)


class NumpyCompileError(RuntimeError):
    """torch.compile could not trace a NumPy function as one graph."""


def _to_torch(value):
    """ndarrays and NumPy scalars (also inside tuples and lists) as tensors."""
    if isinstance(value, (tuple, list)):
        return type(value)(_to_torch(v) for v in value)
    if isinstance(value, (np.ndarray, np.generic)):
        return torch.from_numpy(np.asarray(value))
    return value


def _map_tensors(value, fn):
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    return fn(value) if isinstance(value, torch.Tensor) else value


# Held around every compiled call: the default float below is one process-wide value, so
# two threads calling functions jitted with different default_float must not interleave.
_DEFAULT_FLOAT_LOCK = threading.RLock()


@contextlib.contextmanager
def _default_float(name: str):
    """NumPy's default float inside the compiler while tracing. torch keeps it in one
    process-wide value that it reads once from ``torch._dynamo.config.numpy_default_float``,
    so it is set (and restored) around each call, under a lock, rather than through the config."""
    from torch._numpy import _dtypes_impl

    with _DEFAULT_FLOAT_LOCK:
        saved = _dtypes_impl.default_dtypes()
        _dtypes_impl._default_dtypes = saved._replace(float_dtype=getattr(torch, name))
        try:
            yield
        finally:
            _dtypes_impl._default_dtypes = saved


def _traced(fn):
    """``fn`` between the ``.numpy()`` / ``from_numpy`` hints, with a code object of its own:
    the compiler caches compiled variants per code object, so each jitted function keeps its
    own cache rather than sharing one (and its guards) with every other."""

    def traced(*args, **kwargs):
        arrays = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        named = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return _to_torch(fn(*arrays, **named))

    traced.__code__ = traced.__code__.replace(co_name=f"numpy_{getattr(fn, '__name__', 'function')}")
    return traced


def _backend(device: torch.device) -> str:
    """torch.compile's backend for tensors on ``device``: Inductor, except on CPUs where no C++
    compiler is found (Inductor's CPU code is C++): there the traced torch operators run as
    they are ("eager"), on the tensors' device all the same."""
    return "eager" if device.type == "cpu" and _extension.cpp_compiler() is None else "inductor"


def _in_numpy(device: torch.device, default_float: str) -> bool:
    """Whether a call runs the function in NumPy itself: on CPUs without a C++ compiler, where
    tracing buys no speed ("eager" backend) and a CPU tensor's memory is NumPy's without a copy;
    only for NumPy's own default float (NumPy's creation functions cannot take another)."""
    return default_float == "float64" and _backend(device) == "eager"


class NumpyFunction:
    """A NumPy function that takes and returns torch tensors (or NumPy arrays); see ``jit``."""

    def __init__(self, fn, default_float: str, dynamic: bool | None, eager: bool):
        functools.update_wrapper(self, fn)
        self.fn, self.default_float, self.eager, self.dynamic = fn, default_float, eager, dynamic
        self._static, self._by_backend = collections.OrderedDict(), {}
        self._inline = _traced(fn)  # what an enclosing torch.compile traces (code.replace is not traceable)

    def _compiled(self, backend: str):
        """Made on first use: importing a module of jitted functions loads no compiler."""
        if backend not in self._by_backend:
            self._by_backend[backend] = torch.compile(_traced(self.fn), fullgraph=True, dynamic=self.dynamic,
                                                      backend=backend)
        return self._by_backend[backend]

    def _compiled_for(self, args, kwargs, device):
        """The compiled function for these arguments. dynamic=False keeps one per signature,
        each with a code object (so a compile cache) of its own: the compiler's limit of 8
        variants per function never makes a static function fall back to running eagerly."""
        backend = _backend(device)
        if self.dynamic is not False:
            return self._compiled(backend)
        key = tuple((a.shape, a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                    for a in (*args, *sorted(kwargs.items(), key=lambda item: item[0])))
        if key not in self._static:
            self._static[key] = torch.compile(_traced(self.fn), fullgraph=True, dynamic=False, backend=backend)
            if len(self._static) > STATIC_VARIANTS:
                self._static.popitem(last=False)
        self._static.move_to_end(key)
        return self._static[key]

    def _run_eagerly(self, args, kwargs, device):
        def host(a):
            return a.numpy(force=True) if isinstance(a, torch.Tensor) else a

        out = _to_torch(self.fn(*map(host, args), **{k: host(v) for k, v in kwargs.items()}))
        return _map_tensors(out, lambda t: t.to(device))

    def _tensors(self, args, kwargs):
        """Arguments with ndarrays as tensors, checked: one device, dtypes NumPy has."""
        args = [torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args]
        kwargs = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
        named = [*(f"argument {i}" for i in range(len(args))), *kwargs]
        tensors = [(name, a) for name, a in zip(named, [*args, *kwargs.values()]) if isinstance(a, torch.Tensor)]
        for name, value in zip(named, [*args, *kwargs.values()]):
            if isinstance(value, (list, tuple, dict, set)):
                raise TypeError(f"{self.__name__}: {name} is a Python {type(value).__name__}; pass a tensor or a "
                                "NumPy array (np.asarray(...)) or a scalar")
        for name, tensor in tensors:
            if tensor.dtype in (torch.bfloat16, torch.complex32) or "float8" in str(tensor.dtype):
                raise TypeError(f"{self.__name__}: {name} is {tensor.dtype}, which NumPy has no dtype for; "
                                "convert it (e.g. .float()) before the call")
        if len({t.device for _, t in tensors}) > 1:
            found = ", ".join(f"{name}: {t.device}" for name, t in tensors)
            raise ValueError(f"{self.__name__}: expected all tensors on one device, got {found}")
        return args, kwargs, tensors[0][1].device if tensors else torch.device("cpu")

    def __call__(self, *args, **kwargs):
        numpy_in = any(isinstance(a, np.ndarray) for a in (*args, *kwargs.values()))
        args, kwargs, device = self._tensors(args, kwargs)
        if self.eager:
            out = self._run_eagerly(args, kwargs, device)
        elif torch.compiler.is_dynamo_compiling():  # False when run: another thread's compile cannot take this
            # Inside an enclosing torch.compile: the function becomes part of that graph.
            from torch._numpy import _dtypes_impl

            current = _dtypes_impl._default_dtypes  # default_dtypes() itself is not traceable
            float_dtype = current.float_dtype if current is not None else \
                getattr(torch, torch._dynamo.config.numpy_default_float)
            if float_dtype != getattr(torch, self.default_float):
                raise NumpyCompileError(
                    f"{self.__name__}: default_float={self.default_float!r} cannot be switched inside an enclosing "
                    "torch.compile (the compiler reads NumPy's default float once, from "
                    "torch._dynamo.config.numpy_default_float); jit it with that default_float")
            out = self._inline(*args, **kwargs)
        elif _in_numpy(device, self.default_float):
            out = self._run_eagerly(args, kwargs, device)
        else:
            try:
                with _default_float(self.default_float):
                    out = self._compiled_for(args, kwargs, device)(*args, **kwargs)
            except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError,
                    torch._dynamo.exc.TorchRuntimeError) as error:
                if isinstance(error.__cause__, torch._dynamo.exc.ObservedException):
                    # The function raised an exception of its own: run it in NumPy to raise that.
                    self._run_eagerly(args, kwargs, device)
                raise NumpyCompileError(
                    f"{self.__name__}: torch.compile cannot trace this NumPy code as one graph.\n{error}\n"
                    "Rewrite that construct without it (e.g. np.where instead of an `if` on array values, no "
                    "float()/int() of array values), or pass eager=True to fullgraph.numpy.jit to run the function "
                    "in NumPy while debugging."
                ) from error
        return _map_tensors(out, lambda t: t.numpy(force=True)) if numpy_in else out


def jit(fn=None, *, default_float: str = "float64", dynamic: bool | None = None, eager: bool = False):
    """Compile a function written in NumPy so that it runs on torch tensors on any device.

    Args:
        fn: a function of ndarrays (and Python scalars; positional or keyword) returning
            ndarrays, NumPy scalars, or tuples/lists of them. Used as ``@jit`` or
            ``@jit(default_float="float32")``.
        default_float: the dtype NumPy creation functions use inside the compiled code
            ("float64", NumPy's own, or "float32").
        dynamic: None (compile for the first shapes, then once more for dynamic shapes when
            they change), True (dynamic from the start) or False (a compiled variant per
            signature of shapes, dtypes and devices; the last 32 are kept).
        eager: run the function in NumPy instead (tensors copied to the host and back):
            for debugging, never for speed.

    On CPUs where no C++ compiler is found (Inductor's CPU code is C++) a function of NumPy's
    default float runs in NumPy itself, on the tensors' memory (no copy, no trace); one of
    ``default_float="float32"`` runs its traced torch operators.

    Random numbers: compiled, ``np.random`` draws from torch's generator, so
    ``torch.manual_seed`` repeats a run and ``np.random.seed`` has no effect (the compiler
    maps NumPy's sampling onto torch's); with ``eager=True`` (and in NumPy itself, above)
    NumPy's own generator and seed apply, so the modes draw different numbers.

    Returns:
        A callable taking tensors (all on one device) or NumPy arrays and returning the
        function's results as tensors on that device (NumPy arrays if any NumPy array came in).

    Raises:
        NumpyCompileError: the compiler cannot trace the function (the message names the
            construct and the line), also for reading array values on the host. ValueError:
            tensors on different devices, or a bad option. TypeError: a tensor dtype NumPy
            has no equivalent for (bfloat16, float8).

    Example:
        >>> import numpy as np, torch, fullgraph
        >>> double = fullgraph.numpy.jit(lambda x: 2 * x)
        >>> double(torch.arange(3.0)).tolist()
        [0.0, 2.0, 4.0]
    """
    if default_float not in DEFAULT_FLOATS:
        raise ValueError(f"default_float: expected one of {DEFAULT_FLOATS}, got {default_float!r}")
    if fn is None:
        return functools.partial(jit, default_float=default_float, dynamic=dynamic, eager=eager)
    if not callable(fn):
        raise TypeError(f"fn: expected a function, got {type(fn).__name__}")
    return NumpyFunction(fn, default_float, dynamic, eager)
