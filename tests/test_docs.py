"""The examples in the public docstrings run and print what they say."""

from __future__ import annotations

import doctest

import torch

import pytest

import fullgraph
from fullgraph.ops import ddpm, kmeans
from fullgraph.ops.sampling import api as sampling
from fullgraph.ops.lltm import api as lltm
from fullgraph.ops.neighbors import api


@pytest.mark.parametrize("module, examples", [(api, 4), (fullgraph.numpy, 2), (kmeans, 5), (lltm, 3), (ddpm, 4), (sampling, 2)])
def test_docstring_examples(module, examples):
    torch.manual_seed(0)
    result = doctest.testmod(module, extraglobs={"torch": torch, "fullgraph": fullgraph}, verbose=False)
    assert result.attempted >= examples and result.failed == 0


def test_the_toolkit_page_s_warp_block_is_the_tested_example():
    """docs/toolkit.md's Warp block is examples/wrap_a_warp_kernel.py's, which the GPU tests run."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    block = (root / "examples" / "wrap_a_warp_kernel.py").read_text().split("# --- README ---")[1].strip()
    assert f"```python\n{block}\n```" in (root / "docs" / "toolkit.md").read_text()
    assert len([line for line in block.splitlines() if line.strip()]) < 20
