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


_REGISTERED: dict[str, "ExternOp"] = {}  # the extern ops of this process, by name


def _registered(name: str) -> bool:
    """Whether ``name`` ("namespace::op") is an operator torch already knows."""
    namespace, op_name = name.split("::")
    try:
        getattr(getattr(torch.ops, namespace), op_name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _check_name(name, replace: bool) -> None:
    """A new "namespace::op" name, or (with replace=True) one of this process's own extern ops
    outside fullgraph's namespace: registering over an operator swaps it for everyone."""
    if not isinstance(name, str) or name.count("::") != 1 or not all(name.split("::")):
        raise ValueError(f'name: expected "namespace::op_name", got {name!r}')
    if not _registered(name) and name not in _REGISTERED:
        return
    if name.startswith("fullgraph::"):
        raise ValueError(f"name: {name!r} is one of fullgraph's own operators and cannot be replaced; "
                         "register yours in a namespace of your own")
    if not replace or name not in _REGISTERED:
        raise ValueError(f"name: {name!r} is already a registered operator"
                         + ("; pass replace=True to replace your own extern op" if name in _REGISTERED else
                            " (not an extern op of this process); choose another name"))


class ExternOp:
    """The operator made by ``op``: call it like the function; ``.op`` is the torch op."""

    def __init__(self, fn, name, schema, outputs, library, backward, setup_context, cuda_graphs, replace=False):
        _check_name(name, replace)
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
        _REGISTERED[name] = self

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
            results = [self._tensor(library, module, i, value) for i, value in enumerate(results)]
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
            tensors.append(tensor.contiguous())  # the fake outputs are contiguous: compiled code relies on it
        # A custom op's outputs must not alias its inputs (or each other): copy any that the
        # function passed through, as a whole or as a view into an input's memory.
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        kept: list[torch.Tensor] = []
        for tensor in tensors:
            kept.append(tensor.clone() if any(overlaps(tensor, other) for other in inputs + kept) else tensor)
        return kept[0] if len(kept) == 1 else tuple(kept)

    def _tensor(self, library, module, index: int, value) -> torch.Tensor:
        """Output ``index`` as a tensor, or ExternError naming the op and the output."""
        try:
            tensor = library.from_array(module, value)
        except (TypeError, ValueError, RuntimeError, BufferError) as error:
            raise ExternError(f"{self.name}: output {index} is {type(value).__name__} {_short(value)}, expected an "
                              f"array ({type(error).__name__}: {error})") from None
        if not isinstance(tensor, torch.Tensor) or value is None:
            raise ExternError(f"{self.name}: output {index} is {type(value).__name__}, expected an array")
        return tensor

    def __call__(self, *args):
        return self._call(*args)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of tensors a and b overlaps (same device, intersecting byte ranges)."""
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False

    def span(t):
        start = t.untyped_storage().data_ptr()
        return start, start + t.untyped_storage().nbytes()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


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
       cuda_graphs: str | None = None, replace: bool = False):
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
        replace: allow ``name`` to replace an extern op registered earlier in this process
            (never one of fullgraph's own, nor an operator defined elsewhere).

    Returns:
        A decorator making an ``ExternOp``. Registering raises ValueError for a name already
        taken (see ``replace``); calls raise ExternError when the function's outputs break the
        spec or are not arrays, ValueError for tensors on the wrong device, ImportError (naming
        the package) when the library is missing. Outputs never share memory with the inputs:
        one that does (the input itself, or a view into it) is copied.
    """
    def register(fn):
        return ExternOp(fn, name, schema, outputs, library, backward, setup_context, cuda_graphs, replace)

    return register


def check(extern_op: ExternOp, *args) -> None:
    """``torch.library.opcheck`` on the op, no output sharing memory with an input, then one
    torch.compile(fullgraph=True) call that must equal the eager call (without fullgraph for
    cuda_graphs="break"). Raises on the first failure."""
    torch.library.opcheck(extern_op.op, args)
    out = extern_op(*args)
    for i, tensor in enumerate(out if isinstance(out, tuple) else (out,)):
        for j, value in enumerate(args):
            if isinstance(value, torch.Tensor) and overlaps(tensor, value):
                raise ExternError(f"{extern_op.name}: output {i} shares memory with argument {j}")
    compiled = torch.compile(lambda *a: extern_op(*a), fullgraph=extern_op.cuda_graphs != "break")
    torch.testing.assert_close(compiled(*args), extern_op(*args))
