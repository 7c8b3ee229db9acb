"""The examples in the public docstrings run and print what they say."""

from __future__ import annotations

import doctest

import torch

import fullgraph
from fullgraph.ops.neighbors import api


def test_docstring_examples():
    torch.manual_seed(0)
    result = doctest.testmod(api, extraglobs={"torch": torch, "fullgraph": fullgraph}, verbose=False)
    assert result.attempted >= 4 and result.failed == 0
