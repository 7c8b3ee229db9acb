"""Turn a function written against another array library into a compile-safe torch operator.

    @fullgraph.extern.op("mylib::scaled_norms", "(Tensor x, float scale) -> Tensor",
                         outputs=lambda x, scale: [(x.shape[:1], x.dtype)], library="numpy")
    def scaled_norms(x, scale):             # x arrives as a numpy.ndarray (no copy)
        return np.linalg.norm(x, axis=1) * scale

    y = scaled_norms(torch.rand(5, 3), 2.0)  # a tensor; torch.compile(fullgraph=True) traces it

The tensors go to the library and back through DLPack without copies. ``outputs`` declares
each output's (shape, dtype) as a function of the inputs; the fake implementation that
torch.compile uses is built from it, so symbolic sizes work under ``dynamic=True``, and the
real outputs are checked against it. ``backward`` (plain torch code, or another extern op)
is registered with ``register_autograd``. This session's libraries: "numpy" (CPU; SciPy
works on the same arrays) and "cupy" (CUDA, run on PyTorch's current stream).
"""

from __future__ import annotations

import importlib

import torch

LIBRARIES = {"numpy": ("numpy", "cpu"), "cupy": ("cupy", "cuda")}
_PACKAGES = {"numpy": "numpy", "cupy": "cupy-cuda12x or cupy-cuda13x"}


class ExternError(RuntimeError):
    """An extern op's function broke its declared contract (shapes, dtypes, devices)."""


def _module(library: str):
    name = LIBRARIES[library][0]
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"fullgraph.extern: library={library!r} needs {name}: pip install {_PACKAGES[library]}") from error


def _to_library(library: str, tensor: torch.Tensor):
    module = _module(library)
    return module.from_dlpack(tensor.detach().contiguous())


def _from_library(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_dlpack(value) if hasattr(value, "__dlpack__") else torch.as_tensor(value)


def _specs(outputs, args) -> list[tuple[tuple, torch.dtype]]:
    specs = outputs(*args)
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, (list, tuple)) and len(s) == 2 for s in specs):
        raise TypeError("outputs: expected a function returning a list of (shape, dtype), one per output, "
                        f"got {specs!r}")
    return [(tuple(shape), dtype) for shape, dtype in specs]


class ExternOp:
    """The operator made by ``op``: call it like the function; ``.op`` is the torch op."""

    def __init__(self, fn, name: str, schema: str, outputs, library: str, backward, setup_context):
        if library not in LIBRARIES:
            raise ValueError(f"library: expected one of {sorted(LIBRARIES)}, got {library!r}")
        self.fn, self.name, self.outputs, self.library = fn, name, outputs, library
        self.device_type = LIBRARIES[library][1]
        self.op = torch.library.custom_op(name, self._run, mutates_args=(), schema=schema)
        self.op.register_fake(self._fake)
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context or _save_inputs)
        self.__doc__, self.__name__ = fn.__doc__, getattr(fn, "__name__", name)

    def _fake(self, *args):
        created = [_first_tensor(args).new_empty(shape, dtype=dtype) for shape, dtype in _specs(self.outputs, args)]
        return created[0] if len(created) == 1 else tuple(created)

    def _run(self, *args):
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor) and value.device.type != self.device_type:
                raise ValueError(f"{self.name}: library={self.library!r} runs on {self.device_type} tensors, "
                                 f"got argument {i} on {value.device}")
        arrays = [_to_library(self.library, a) if isinstance(a, torch.Tensor) else a for a in args]
        if self.library == "cupy":
            import cupy

            with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                result = self.fn(*arrays)
        else:
            result = self.fn(*arrays)
        results = list(result) if isinstance(result, (tuple, list)) else [result]
        specs = _specs(self.outputs, args)
        if len(results) != len(specs):
            raise ExternError(f"{self.name}: the function returned {len(results)} outputs, the outputs spec "
                              f"declares {len(specs)}")
        tensors = []
        for i, (value, (shape, dtype)) in enumerate(zip(results, specs)):
            tensor = _from_library(value)
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ExternError(f"{self.name}: output {i} came back as {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"the outputs spec declares {shape} {dtype}")
            tensors.append(tensor)
        # A custom op's outputs must not alias its inputs: copy any that the function passed through.
        inputs = {a.data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
        tensors = [t.clone() if t.numel() and t.data_ptr() in inputs else t for t in tensors]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def __call__(self, *args):
        return self.op(*args)


def _first_tensor(args) -> torch.Tensor:
    """The first tensor argument (outputs are created like it)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError("fullgraph.extern: an op needs at least one tensor argument")


def _save_inputs(ctx, inputs, output):
    ctx.inputs = inputs
    ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])


def op(name: str, schema: str, *, outputs, library: str = "numpy", backward=None, setup_context=None):
    """Register ``fn`` (a function of the library's arrays) as the torch operator ``name``.

    Args:
        name: "namespace::op_name". schema: its signature, e.g. "(Tensor x, float s) -> Tensor".
        outputs: ``outputs(*args) -> [(shape, dtype), ...]``, one per output, from the input
            tensors (fake ones while compiling): how torch.compile learns output shapes.
        library: "numpy" (CPU tensors) or "cupy" (CUDA tensors, run on the current stream).
        backward: optional ``backward(ctx, *grads) -> grads per input`` in torch code (or
            other ops); by default ``setup_context`` saves the tensor inputs as
            ``ctx.saved_tensors`` and all inputs as ``ctx.inputs``.

    Returns:
        A decorator making an ``ExternOp``; raises ExternError when the function's outputs
        break the spec, ValueError for tensors on the wrong device, ImportError (naming the
        package) when the library is missing.
    """
    def register(fn):
        return ExternOp(fn, name, schema, outputs, library, backward, setup_context)

    return register


def check(extern_op: ExternOp, *args) -> None:
    """``torch.library.opcheck`` on the op, then one torch.compile(fullgraph=True) call that
    must equal the eager call. Raises on the first failure."""
    torch.library.opcheck(extern_op.op, args)
    compiled = torch.compile(lambda *a: extern_op(*a), fullgraph=True)
    torch.testing.assert_close(compiled(*args), extern_op(*args))
