"""One error contract, compiled or not: a public function refuses bad input with the same
TypeError / ValueError (type and message) eagerly and under ``torch.compile(fullgraph=True)``.

Eagerly a function's own checks raise. While torch.compile traces, an exception raised in the
traced code would end the trace (torch._dynamo.exc.Unsupported), so ``checked`` runs the
function's check outside the trace (``torch._dynamo.nonstrict_trace``: real Python on the
traced values); where it refuses, the graph gets an operator that raises that error when the
compiled code runs, and the function's body is not traced. Where it accepts, the compiled code
runs nothing of it: the guards the check placed on shapes recompile for inputs it would refuse.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

import torch

from . import _validate

_REFUSALS = {error.__name__: error for error in (TypeError, ValueError)}
_CHECKS: dict[str, Callable] = {}
# Leaves nonstrict_trace cannot take travel as a marker string and come back as stand-ins.
_MARKER = "\0fullgraph:"
_PASSABLE = (torch.Tensor, bool, int, float, str, torch.dtype, torch.device, list, tuple, torch.SymInt,
             torch.SymFloat, torch.SymBool)


class Unknown:
    """Stands in for an argument of a type the check cannot be shown while tracing."""

    def __init__(self, type_name: str):
        self.type_name = type_name

    def __repr__(self):
        return f"<{self.type_name}>"


@torch.library.custom_op("fullgraph::refuse", mutates_args=())
def refuse(kind: str, message: str, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Raise the refusal ``kind`` (TypeError or ValueError) with ``message``; its fake
    returns tensors like ``like``, standing in for the refused call's outputs."""
    raise _REFUSALS[kind](message)


@refuse.register_fake
def _(kind, message, like):
    return [torch.empty_like(tensor) for tensor in like]


def _marked(value):
    """An argument as nonstrict_trace takes it (traced: runs under torch.compile)."""
    if value is None:
        return _MARKER + "None"
    if isinstance(value, torch.Generator):
        return _MARKER + "Generator"
    if isinstance(value, (list, tuple)):
        return type(value)(_marked(v) for v in value)
    if isinstance(value, _PASSABLE):
        return value
    return _MARKER + type(value).__name__


def _restored(value):
    if isinstance(value, dict):
        return {key: _restored(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_restored(v) for v in value)
    if isinstance(value, str) and value.startswith(_MARKER):
        name = value.removeprefix(_MARKER)
        return None if name == "None" else torch.Generator() if name == "Generator" else Unknown(name)
    return value


def _concrete(value):
    """``value`` with symbolic sizes and numbers made concrete (each a guard): messages then
    name the values, as eagerly."""
    if isinstance(value, dict):
        return {key: _concrete(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, torch.Tensor):
        return torch.empty_strided([int(s) for s in value.shape], [int(s) for s in value.stride()],
                                   dtype=value.dtype, device=value.device).requires_grad_(value.requires_grad)
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    if isinstance(value, torch.SymBool):
        return bool(value)
    return value


def _refusal(name: str, args, kwargs, outputs: int):
    check = _CHECKS[name]
    args, kwargs = _restored(args), _restored(kwargs)
    # Outputs made from an argument: traced tensors like the inputs (a flag first).
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    like = first if first is not None else torch.empty(0)
    _validate.TRACED_CHECKS[0] += 1  # values are not there to read
    try:
        check(*args, **kwargs)
    except tuple(_REFUSALS.values()) as error:
        try:
            check(*_concrete(args), **_concrete(kwargs))
        except tuple(_REFUSALS.values()) as exact:
            error = exact
        return [like.new_empty(1), *torch.ops.fullgraph.refuse(type(error).__name__, str(error), [like] * outputs)]
    finally:
        _validate.TRACED_CHECKS[0] -= 1
    return [like.new_empty(0)]  # refused calls return [a flag of one element, *stand-ins]


# torch.compile calls _refusal as one opaque call (nonstrict_trace). That registration lives in
# torch._dynamo, seconds to import: it is made when torch._dynamo is (_OnDynamoImport).
_TRACED_REFUSAL: list[Callable] = [_refusal]


def _register() -> None:
    nonstrict_trace = getattr(torch._dynamo, "nonstrict_trace", None)  # torch >= 2.7
    if nonstrict_trace is not None:  # older: the check is traced, a refusal ends the trace (Unsupported)
        _TRACED_REFUSAL[0] = nonstrict_trace(_refusal)


class _OnDynamoImport(importlib.abc.MetaPathFinder):
    """Registers ``_refusal`` right after torch._dynamo is imported (by torch.compile's first call)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _register()

        spec.loader.exec_module = exec_module
        return spec


if "torch._dynamo" in sys.modules:
    _register()
else:
    sys.meta_path.insert(0, _OnDynamoImport())


def checked(check: Callable, outputs: int = 1):
    """Decorator of a public function whose argument checks are ``check`` (same signature;
    raises TypeError / ValueError, never reads tensor values while compiling), run before
    the function's body; ``outputs``: how many tensors the function returns (1: one tensor,
    not a tuple)."""
    name = f"{check.__module__}.{check.__qualname__}"
    _CHECKS[name] = check

    def decorate(fn):
        @functools.wraps(fn)
        def public(*args, **kwargs):
            if not torch.compiler.is_dynamo_compiling():  # False when run, in any thread
                check(*args, **kwargs)
            else:
                flag, *refused = _TRACED_REFUSAL[0](name, _marked(args), {k: _marked(v) for k, v in kwargs.items()},
                                                    outputs)
                if flag.shape[0]:
                    return refused[0] if outputs == 1 else tuple(refused)
            return fn(*args, **kwargs)
        return public
    return decorate
