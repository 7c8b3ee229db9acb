"""The peers' functions with their exact signatures, defaults and return types, on
fullgraph's operators: ``fullgraph.compat.torch_cluster``, ``fullgraph.compat.pytorch3d``
and ``fullgraph.compat.pyg`` (``torch_geometric.nn.pool``; ``pyg.install()`` routes PyG's
own models through them) and ``fullgraph.compat.pyg_lib`` (``pyg_lib.ops``). Differences from each peer are listed in its module's docstring
and in docs/vocabulary.md.
"""

import importlib

__all__ = ["pyg", "pyg_lib", "pytorch3d", "torch_cluster"]


def __getattr__(name: str):
    if name in __all__:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
