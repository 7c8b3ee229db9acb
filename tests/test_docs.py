"""The examples in the public docstrings run and print what they say."""

from __future__ import annotations

import doctest

import torch

import pytest

import fullgraph
from fullgraph.ops import ddpm, kmeans, lltm
from fullgraph.ops.neighbors import api


@pytest.mark.parametrize("module, examples", [(api, 4), (fullgraph.numpy, 2), (kmeans, 4), (lltm, 3), (ddpm, 4)])
def test_docstring_examples(module, examples):
    torch.manual_seed(0)
    result = doctest.testmod(module, extraglobs={"torch": torch, "fullgraph": fullgraph}, verbose=False)
    assert result.attempted >= examples and result.failed == 0
