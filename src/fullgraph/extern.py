"""Turn a function written against another array library into a compile-safe torch operator.

    @fullgraph.extern.op("mylib::scaled_norms", "(Tensor x, float scale) -> Tensor",
                         outputs=lambda x, scale: [(x.shape[:1], x.dtype)], library="numpy")
    def scaled_norms(x, scale):             # x arrives as a numpy.ndarray (no copy)
        return np.linalg.norm(x, axis=1) * scale

    y = scaled_norms(torch.rand(5, 3), 2.0)  # a tensor; torch.compile(fullgraph=True) traces it

Tensors reach the library and come back without copies (DLPack or the CUDA array
interface). ``outputs`` declares each output's (shape, dtype) from the inputs: the fake
implementation torch.compile traces is built from it, so symbolic sizes work under
``dynamic=True``, and the real outputs are checked against it. GPU libraries run on
PyTorch's current CUDA stream, so their work is ordered with PyTorch's without a sync.
``backward`` (torch code, or other ops) is registered with ``register_autograd``.

Libraries: "numpy" (CPU; SciPy works on the same arrays), "cupy", "numba" (numba.cuda),
"warp" (NVIDIA Warp) and "jax", each imported on first use.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .libraries import LIBRARIES

CUDA_GRAPH_POLICIES = ("safe", "tag", "break")


class ExternError(RuntimeError):
    """An extern op's function broke its declared contract (shapes, dtypes, capture)."""


_running = threading.local()


def current_stream():
    """Inside an extern op's function: the library's handle on PyTorch's current stream
    (cupy ExternalStream, numba Stream, warp Stream; a torch.cuda.Stream for the others).

    CuPy and Warp already run on it; a Numba kernel must be launched on it:
    ``kernel[blocks, threads, fullgraph.extern.current_stream()](...)``.
    """
    stream = getattr(_running, "stream", None)
    if stream is None:
        raise RuntimeError("fullgraph.extern.current_stream() is only valid inside an extern op's function")
    return stream


def _specs(outputs, args) -> list[tuple[tuple, torch.dtype]]:
    specs = outputs(*args)
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, (list, tuple)) and len(s) == 2 for s in specs):
        raise TypeError("outputs: expected a function returning a list of (shape, dtype), one per output, "
                        f"got {specs!r}")
    return [(tuple(shape), dtype) for shape, dtype in specs]


class ExternOp:
    """The operator made by ``op``: call it like the function; ``.op`` is the torch op."""

    def __init__(self, fn, name, schema, outputs, library, backward, setup_context, cuda_graphs):
        if library not in LIBRARIES:
            raise ValueError(f"library: expected one of {sorted(LIBRARIES)}, got {library!r}")
        cuda_graphs = cuda_graphs or LIBRARIES[library].cuda_graphs
        if cuda_graphs not in CUDA_GRAPH_POLICIES:
            raise ValueError(f"cuda_graphs: expected one of {CUDA_GRAPH_POLICIES}, got {cuda_graphs!r}")
        self.fn, self.name, self.outputs, self.library = fn, name, outputs, library
        self.cuda_graphs = cuda_graphs
        self.device_type = LIBRARIES[library].device
        tags = (torch.Tag.cudagraph_unsafe,) if cuda_graphs != "safe" else ()
        self.op = torch.library.custom_op(name, self._run, mutates_args=(), schema=schema, tags=tags)
        self.op.register_fake(self._fake)
        if backward is not None:
            self.op.register_autograd(backward, setup_context=setup_context or _save_inputs)
        self._call = torch.compiler.disable(self.op) if cuda_graphs == "break" else self.op
        self.__doc__, self.__name__ = fn.__doc__, getattr(fn, "__name__", name)

    def _fake(self, *args):
        created = [_first_tensor(args).new_empty(shape, dtype=dtype) for shape, dtype in _specs(self.outputs, args)]
        return created[0] if len(created) == 1 else tuple(created)

    def _check_inputs(self, args) -> torch.device:
        device = _first_tensor(args).device
        for i, value in enumerate(args):
            if isinstance(value, torch.Tensor) and value.device.type != self.device_type:
                raise ValueError(f"{self.name}: library={self.library!r} runs on {self.device_type} tensors, "
                                 f"got argument {i} on {value.device}")
        if self.cuda_graphs != "safe" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ExternError(f"{self.name} is declared cuda_graphs={self.cuda_graphs!r} (it synchronizes or "
                              "allocates outside PyTorch) and cannot run inside a CUDA graph capture; call it "
                              "outside the captured region (torch.compile keeps it out of its CUDA graphs)")
        return device

    def _run(self, *args):
        device = self._check_inputs(args)
        library = LIBRARIES[self.library]
        module = library.load()
        outer = getattr(_running, "stream", None)
        # Conversions too happen on PyTorch's stream: DLPack then orders nothing across streams
        # (a wait on another stream would be illegal inside a CUDA graph capture).
        on_stream = library.on_stream(module, device) if device.type == "cuda" else contextlib.nullcontext()
        with on_stream as stream:
            arrays = [library.to_array(module, a) if isinstance(a, torch.Tensor) else a for a in args]
            _running.stream = stream
            try:
                result = self.fn(*arrays)
            finally:
                _running.stream = outer
            results = list(result) if isinstance(result, (tuple, list)) else [result]
            results = [library.from_array(module, value) for value in results]
        specs = _specs(self.outputs, args)
        if len(results) != len(specs):
            raise ExternError(f"{self.name}: the function returned {len(results)} outputs, the outputs spec "
                              f"declares {len(specs)}")
        tensors = []
        for i, (tensor, (shape, dtype)) in enumerate(zip(results, specs)):
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ExternError(f"{self.name}: output {i} came back as {tuple(tensor.shape)} {tensor.dtype}, "
                                  f"the outputs spec declares {shape} {dtype}")
            if tensor.device.type != device.type:
                raise ExternError(f"{self.name}: output {i} came back on {tensor.device}, expected {device.type} "
                                  "like the inputs")
            tensors.append(tensor)
        # A custom op's outputs must not alias its inputs: copy any that the function passed through.
        inputs = {a.data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
        tensors = [t.clone() if t.numel() and t.data_ptr() in inputs else t for t in tensors]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def __call__(self, *args):
        return self._call(*args)


def _first_tensor(args) -> torch.Tensor:
    """The first tensor argument (outputs are created like it)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError("fullgraph.extern: an op needs at least one tensor argument")


def _save_inputs(ctx, inputs, output):
    ctx.inputs = inputs
    ctx.save_for_backward(*[a for a in inputs if isinstance(a, torch.Tensor)])


def op(name: str, schema: str, *, outputs, library: str = "numpy", backward=None, setup_context=None,
       cuda_graphs: str | None = None):
    """Register ``fn`` (a function of the library's arrays) as the torch operator ``name``.

    Args:
        name: "namespace::op_name". schema: its signature, e.g. "(Tensor x, float s) -> Tensor".
        outputs: ``outputs(*args) -> [(shape, dtype), ...]``, one per output, from the input
            tensors (fake ones while compiling): how torch.compile learns output shapes.
        library: "numpy" (CPU tensors), or "cupy", "numba", "warp", "jax" (CUDA tensors).
        backward: optional ``backward(ctx, *grads) -> grads per input`` in torch code (or
            other ops); by default ``setup_context`` saves the tensor inputs as
            ``ctx.saved_tensors`` and all inputs as ``ctx.inputs``.
        cuda_graphs: whether the function may be captured in a CUDA graph.
            "safe": it only launches work on the current stream (default, except JAX);
            "tag": it synchronizes or allocates outside PyTorch: the op carries
            ``torch.Tag.cudagraph_unsafe`` so torch.compile's CUDA graphs run around it
            (``fullgraph=True`` still holds), and calling it during a manual capture raises
            ExternError (default for JAX); "break": torch.compile leaves the call out of
            its graph (a graph break, so not with ``fullgraph=True``).

    Returns:
        A decorator making an ``ExternOp``; raises ExternError when the function's outputs
        break the spec, ValueError for tensors on the wrong device, ImportError (naming the
        package) when the library is missing.
    """
    def register(fn):
        return ExternOp(fn, name, schema, outputs, library, backward, setup_context, cuda_graphs)

    return register


def check(extern_op: ExternOp, *args) -> None:
    """``torch.library.opcheck`` on the op, then one torch.compile(fullgraph=True) call that
    must equal the eager call (without fullgraph for cuda_graphs="break"). Raises on the
    first failure."""
    torch.library.opcheck(extern_op.op, args)
    compiled = torch.compile(lambda *a: extern_op(*a), fullgraph=extern_op.cuda_graphs != "break")
    torch.testing.assert_close(compiled(*args), extern_op(*args))
