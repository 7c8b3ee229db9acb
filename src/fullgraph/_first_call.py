"""The first eager call of an operator without importing torch._dynamo.

``torch.library.custom_op`` wraps each kernel so that Dynamo never traces into it, and that
wrapper imports ``torch._dynamo`` on its first call: 2.4 of the 2.6 s of a first ``knn`` on
a 2-core CPU. Before ``torch._dynamo`` is imported nothing can be compiling, so until then
the kernels run directly; from the first call after its import on, torch's own wrapper.
"""

from __future__ import annotations

import sys

import torch


def _until_dynamo(fn):
    def call(*args, **kwargs):
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        try:
            disabled = torch._dynamo.disable(fn, True, wrapping=False)
        except TypeError:  # torch versions whose disable takes no ``wrapping``
            disabled = torch._dynamo.disable(fn, True)
        fn.__dynamo_disable = disabled  # torch's wrapper calls it from now on
        return disabled(*args, **kwargs)
    return call


def defer_dynamo_import(namespace: str) -> int:
    """Give the kernels of the custom operators of ``namespace`` the deferred wrapper;
    returns how many (0 where torch's internals differ: then nothing changes)."""
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:
        return 0
    count = 0
    for name, opdef in list(OPDEFS.items()):
        if not name.startswith(f"{namespace}::"):
            continue
        for kernel in getattr(opdef, "_backend_fns", {}).values():
            wrapped = getattr(kernel, "__wrapped__", None)
            if wrapped is not None and getattr(wrapped, "__dynamo_disable", None) is None:
                wrapped.__dynamo_disable = _until_dynamo(wrapped)
                count += 1
    return count
