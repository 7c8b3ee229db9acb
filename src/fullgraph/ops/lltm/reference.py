"""The LLTM cell in plain PyTorch, as the tutorial writes it: the reference backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lltm(input, weights, bias, old_h, old_cell):
    """(new_h, new_cell), each [B, S]; see fullgraph.lltm."""
    gate_weights = F.linear(torch.cat([old_h, input], dim=1), weights, bias)
    input_gate, output_gate, candidate = gate_weights.chunk(3, dim=1)
    new_cell = old_cell + F.elu(candidate) * torch.sigmoid(input_gate)
    return torch.tanh(new_cell) * torch.sigmoid(output_gate), new_cell
