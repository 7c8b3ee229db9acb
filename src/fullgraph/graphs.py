"""Capture a callable on CUDA tensors once per input signature and replay it (CUDA graphs).

    step = fullgraph.graphs.graphed(unet)          # a module or a function of CUDA tensors
    out = step(sample, timestep, cond)              # first call per signature: warm-up + capture
    out = step(new_sample, timestep, cond)          # later calls: copy in, replay, no launches

Each signature (shapes, dtypes, devices of the tensor arguments; values of the others) gets
its own graph: the first call warms the callable up on a side stream, copies the arguments
into static buffers and captures one call; later calls copy the new arguments into those
buffers and replay. Outputs are the graph's static output tensors (views that the next
replay of that signature overwrites) unless ``clone_outputs=True``. Graphs of one ``graphed``
callable share one memory pool; at most ``max_graphs`` signatures are kept (least recently
used dropped). What the callable does on the host (Python branches, reading tensor values)
happens once, at capture: replays repeat the captured GPU work only.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree


class GraphCaptureError(RuntimeError):
    """The callable cannot be captured in a CUDA graph (the message says why)."""


_SYNC_HINTS = ("stream is capturing", "cudaErrorStreamCapture", "synchroniz")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list  # static tensors, in the order of the tensor leaves of the arguments
    output: object  # the static output (a pytree of tensors)


def _signature(leaves) -> tuple:
    return tuple((tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor)
                 else (type(x), x) for x in leaves)


class Graphed:
    """``fn`` replayed from CUDA graphs, one per input signature; see the module docstring."""

    def __init__(self, fn, *, max_graphs: int = 8, warmup: int = 2, clone_outputs: bool = False,
                 eager_on_cpu: bool = False):
        if not callable(fn):
            raise TypeError(f"fn: expected a callable (a module or a function), got {type(fn).__name__}")
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs: expected an int >= 1, got {max_graphs!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(f"warmup: expected an int >= 1 (cuBLAS and friends allocate on first use), got {warmup!r}")
        functools.update_wrapper(self, fn, updated=())
        self.fn, self.max_graphs, self.warmup = fn, max_graphs, warmup
        self.clone_outputs, self.eager_on_cpu = clone_outputs, eager_on_cpu
        self._graphs: collections.OrderedDict[tuple, _Captured] = collections.OrderedDict()
        self._pool = None
        self.captures = 0  # how many graphs were captured (cache misses)

    def _device(self, leaves) -> torch.device | None:
        tensors = [(i, x) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        devices = {x.device for _, x in tensors}
        if not tensors:
            raise ValueError("fullgraph.graphs: expected at least one CUDA tensor argument (the graph's inputs), "
                             "got none")
        if len(devices) > 1:
            found = ", ".join(f"argument {i}: {x.device}" for i, x in tensors)
            raise ValueError(f"fullgraph.graphs: expected all tensor arguments on one CUDA device, got {found}")
        device = devices.pop()
        if device.type != "cuda":
            if self.eager_on_cpu:
                return None
            raise ValueError(f"fullgraph.graphs: CUDA graphs capture CUDA work, got tensors on {device} "
                             "(pass eager_on_cpu=True to run the callable eagerly there)")
        return device

    def __call__(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        device = self._device(leaves)
        if device is None:
            return self.fn(*args, **kwargs)
        key = (spec, _signature(leaves))
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(leaves, spec, device)
            self._graphs[key] = captured
            if len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
            for static, value in zip(captured.inputs, (x for x in leaves if isinstance(x, torch.Tensor))):
                static.copy_(value)
            captured.graph.replay()
        out = captured.output
        return pytree.tree_map_only(torch.Tensor, torch.clone, out) if self.clone_outputs else out

    def _capture(self, leaves, spec, device) -> _Captured:
        static_leaves = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        static_args, static_kwargs = pytree.tree_unflatten(static_leaves, spec)
        if self._pool is None:
            with torch.cuda.device(device):
                self._pool = torch.cuda.graph_pool_handle()
        graph, output = capture(functools.partial(self.fn, *static_args, **static_kwargs), device,
                                warmup=self.warmup, pool=self._pool)
        bad = [type(x).__name__ for x in pytree.tree_leaves(output) if not isinstance(x, (torch.Tensor, type(None)))]
        if bad:
            raise GraphCaptureError(f"fullgraph.graphs: the callable must return tensors (or containers of them), "
                                    f"got {', '.join(sorted(set(bad)))}: those would be frozen at capture")
        self.captures += 1
        graph.replay()  # the capture recorded the work without running it
        inputs = [x for x in static_leaves if isinstance(x, torch.Tensor)]
        return _Captured(graph, inputs, output)


def capture(fn, device: torch.device, *, warmup: int = 2, pool=None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn()`` up ``warmup`` times on a side stream, then capture one call on ``device``.

    Returns (graph, output): ``graph.replay()`` repeats the captured GPU work, writing into
    ``output``'s tensors. The capture records without running: replay once for the result.
    Raises GraphCaptureError naming the cause when the call cannot be captured.
    """
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        generator = _generator(device)
        before = generator.clone_state()
        try:
            # thread_local: CUDA calls of the process's other threads (compile workers, data
            # loaders) cannot invalidate this capture; this thread's own unsafe calls still fail it.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                output = fn()
        except GraphCaptureError:  # refused before capturing: the message is already ours
            raise
        except Exception as error:  # the CUDA or PyTorch error names the failing call
            generator.graphsafe_set_state(before)
            raise GraphCaptureError(_explain(error)) from error
    return graph, output


def _generator(device: torch.device) -> torch.Generator:
    """The default random generator of a CUDA device (the current one for "cuda")."""
    return torch.cuda.default_generators[torch.cuda.current_device() if device.index is None else device.index]


def recover(device=None) -> None:
    """Undo what a failed CUDA graph capture of your own leaves behind, so that CUDA work
    (random numbers included) runs again in this process.

    When ``with torch.cuda.graph(g): ...`` fails, PyTorch leaves the device's default random
    generator in capture mode and every later ``torch.randn(..., device="cuda")`` raises
    "Offset increment outside graph capture encountered unexpectedly". ``recover`` gives the
    generator a fresh state with the same seed and offset. ``capture`` and ``graphed`` do
    this themselves when a capture fails.
    """
    generator = _generator(torch.device("cuda") if device is None else torch.device(device))
    fresh = torch.Generator(device=generator.device)
    fresh.set_state(generator.get_state())
    generator.graphsafe_set_state(fresh)


def _explain(error: Exception) -> str:
    text = str(error)
    cause = "it failed while being captured"
    if any(hint.lower() in text.lower() for hint in _SYNC_HINTS):
        cause = ("it synchronizes with the host or allocates outside PyTorch while being captured: .item(), "
                 ".tolist(), .cpu(), printing a tensor, `if tensor:`, and ops whose output size depends on the data "
                 "(nonzero, boolean masks, unique) all wait for the GPU, which a capture forbids")
    return (f"fullgraph.graphs: cannot capture the callable in a CUDA graph: {cause}. Keep such work outside the "
            f"graphed callable, or compute it on the device.\nThe error during capture: {text.splitlines()[0]}")


def graphed(fn=None, *, max_graphs: int = 8, warmup: int = 2, clone_outputs: bool = False,
            eager_on_cpu: bool = False):
    """Replay ``fn`` from CUDA graphs, captured once per input signature.

    Args:
        fn: a callable of CUDA tensors (and other arguments, which become part of the
            signature). Used as ``graphed(fn)`` or as a decorator ``@graphed(...)``.
        max_graphs: signatures kept (each holds its graph and static buffers).
        warmup: eager calls on a side stream before each capture.
        clone_outputs: return copies instead of the static outputs (which the next replay
            of the same signature overwrites).
        eager_on_cpu: on CPU tensors run ``fn`` eagerly instead of raising.

    Returns:
        A ``Graphed`` callable with ``fn``'s signature; ``.captures`` counts captures.

    Raises:
        ValueError: no tensor arguments, tensors on several devices, or CPU tensors (unless
            eager_on_cpu). GraphCaptureError: the capture failed (host synchronization,
            data-dependent shapes, non-tensor outputs), naming the cause.
    """
    if fn is None:
        return functools.partial(graphed, max_graphs=max_graphs, warmup=warmup, clone_outputs=clone_outputs,
                                 eager_on_cpu=eager_on_cpu)
    return Graphed(fn, max_graphs=max_graphs, warmup=warmup, clone_outputs=clone_outputs, eager_on_cpu=eager_on_cpu)
