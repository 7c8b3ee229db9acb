"""Every Python block of the README runs as pasted, in order, on the machine it says it runs
on: blocks that open with "# on a CUDA machine" run where CUDA is, the Warp block where Warp
is installed (the GPU test runs), every other block here, on a CPU."""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

README = Path(__file__).parents[1] / "README.md"
BLOCKS = [textwrap.dedent(block) for block in re.findall(r"^ *```python\n(.*?)^ *```", README.read_text(), re.S | re.M)]


def _missing(block: str) -> str | None:
    """Why this machine cannot run the block (None: it can)."""
    if block.startswith("# on a CUDA machine") and not torch.cuda.is_available():
        return "the block says it runs on a CUDA machine"
    if re.search(r"^import .*\bwarp\b", block, re.M) and (importlib.util.find_spec("warp") is None
                                                          or not torch.cuda.is_available()):
        return "the block needs NVIDIA Warp and a GPU"
    return None


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 6 and all(block.strip() for block in BLOCKS)


@pytest.mark.slow
def test_every_block_runs_as_pasted():
    namespace: dict = {}
    skipped = []
    for number, block in enumerate(BLOCKS):
        reason = _missing(block)
        if reason:
            skipped.append((number, reason))
            continue
        try:
            exec(compile(block, f"README.md python block {number}", "exec"), namespace)
        except Exception as error:  # the block's number and text make the failure readable
            raise AssertionError(f"README python block {number} failed:\n{block}") from error
    assert len(skipped) < len(BLOCKS) // 2, skipped
