"""The LLTM recurrent cell of PyTorch's LLTM extension tutorial as a module, on fullgraph's operator."""

from __future__ import annotations

import math

import torch

from ..ops.lltm import lltm


class LLTM(torch.nn.Module):
    """LLTM(input_features, state_size): ``forward(input [B, F], (h [B, S], cell [B, S]))
    -> (new_h, new_cell)``. Parameters as in the tutorial: ``weights`` [3 S, F + S] and
    ``bias`` [3 S], uniform in +-1/sqrt(S). ``backend`` as in ``fullgraph.lltm``."""

    def __init__(self, input_features: int, state_size: int, *, backend: str = "auto"):
        super().__init__()
        self.input_features, self.state_size, self.backend = input_features, state_size, backend
        self.weights = torch.nn.Parameter(torch.empty(3 * state_size, input_features + state_size))
        self.bias = torch.nn.Parameter(torch.empty(3 * state_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.state_size)
        for weight in self.parameters():
            torch.nn.init.uniform_(weight, -bound, bound)

    def forward(self, input: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]):
        old_h, old_cell = state
        return lltm(input, self.weights, self.bias, old_h, old_cell, backend=self.backend)

    def extra_repr(self) -> str:
        return f"input_features={self.input_features}, state_size={self.state_size}, backend={self.backend!r}"
