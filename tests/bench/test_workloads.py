"""Every workload `fullgraph --help` lists runs at its smallest size on this machine, or
answers with a usage error naming what it needs, and every workload `fullgraph explain` lists
explains with its defaults (not in the default run: pytest -m workloads)."""

from __future__ import annotations

import json

import pytest
import torch

import fullgraph_cli

pytestmark = pytest.mark.workloads

SMALLEST = {"neighbor-ops": "small", "knn-sharded": "tiny"}
NEEDS = {"extern-pool": ("cuda", "run it with --device cuda"), "knn-sharded": ("torchrun", "launch it with torchrun")}


@pytest.mark.parametrize("workload", sorted(fullgraph_cli.WORKLOADS))
def test_every_workload_runs_at_its_smallest_size(workload, tmp_path, capsys):
    sizes = fullgraph_cli.WORKLOADS[workload]
    size = SMALLEST.get(workload, "tiny" if "tiny" in sizes else sizes[-1])
    rows = tmp_path / "rows.json"
    try:
        code = fullgraph_cli.main(["bench", workload, "--size", size, "--runs", "1", "--warmup", "0", "--json",
                                   str(rows)])
    except SystemExit as exit:  # usage errors leave through the parser
        code = exit.code
    need = NEEDS.get(workload)
    if need is not None and not (need[0] == "cuda" and torch.cuda.is_available()):
        assert code == 2 and need[1] in capsys.readouterr().err
        return
    assert code == 0
    assert {row["workload"] for row in json.loads(rows.read_text())} == {workload}


@pytest.mark.parametrize("workload", fullgraph_cli.EXPLAINABLE)
def test_every_workload_explain_lists_explains_with_its_defaults(workload, capsys):
    assert fullgraph_cli.main(["explain", workload]) == 0
    out = capsys.readouterr().out
    assert f"{workload} / " in out and "graphs: " in out
