"""Models whose layers come in two implementations ("fullgraph" / "plain") switched together."""

from __future__ import annotations

from torch import nn

from .. import _validate

IMPLEMENTATIONS = ("fullgraph", "plain")


class Switchable(nn.Module):
    """``model.implementation = "plain"`` sets every layer that has an ``implementation``."""

    def _layers(self):
        return [m for m in self.modules() if m is not self and "implementation" in vars(m)]

    @property
    def implementation(self) -> str:
        return self._layers()[0].implementation

    @implementation.setter
    def implementation(self, value: str) -> None:
        _validate.choice("implementation", value, IMPLEMENTATIONS)
        for layer in self._layers():
            layer.implementation = value
