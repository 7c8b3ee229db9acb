"""The README and every docs/ page: their Python blocks run as pasted, in order, on the machine
they say they run on (blocks that open with "# on a CUDA machine" where CUDA is, blocks that
import Warp where Warp and a GPU are, every other block here); the README's results table is
the one ``fullgraph report --summary`` draws from the result rows."""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[str]:
    return [textwrap.dedent(block) for block in re.findall(r"^ *```python\n(.*?)^ *```", page.read_text(), re.S | re.M)]


def _missing(block: str) -> str | None:
    """Why this machine cannot run the block (None: it can)."""
    if block.startswith("# on a CUDA machine") and not torch.cuda.is_available():
        return "the block says it runs on a CUDA machine"
    if re.search(r"^import .*\bwarp\b", block, re.M) and (importlib.util.find_spec("warp") is None
                                                          or not torch.cuda.is_available()):
        return "the block needs NVIDIA Warp and a GPU"
    return None


def test_the_readme_is_short_and_has_its_blocks():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    assert len(blocks(ROOT / "README.md")) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_block_runs_as_pasted(page):
    namespace: dict = {}
    for number, block in enumerate(blocks(page)):
        if _missing(block):
            continue
        try:
            exec(compile(block, f"{page.name} python block {number}", "exec"), namespace)
        except Exception as error:  # the block's number and text make the failure readable
            raise AssertionError(f"{page.name} python block {number} failed:\n{block}") from error


def test_the_results_table_is_drawn_from_the_rows():
    from fullgraph.bench import report

    folder = ROOT / "benchmarks" / "results" / "h100"
    generated = report.summary([report.read_json(path) for path in report.result_files(folder)])
    text = (ROOT / "README.md").read_text()
    table = re.search(r"<!-- results:.*?-->\n(.*?)\n<!-- /results -->", text, re.S).group(1)
    assert table == generated, "run `fullgraph report --summary benchmarks/results/h100` and paste it"


def test_every_page_is_linked_and_every_link_resolves():
    docs = ROOT / "docs"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"
    index = (docs / "index.md").read_text()
    for page in docs.glob("*.md"):
        assert page.name == "index.md" or f"({page.name})" in index, f"docs/index.md does not link {page.name}"


def test_the_docs_build_with_warnings_as_errors(tmp_path):
    """mkdocs with the API reference from the docstrings (mkdocstrings), strict."""
    import subprocess
    import sys

    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "api" / "index.html").read_text().count("fullgraph.ops.neighbors.api.knn") > 0
