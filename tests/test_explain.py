"""fullgraph.explain and `fullgraph explain`: graphs, breaks with reasons and lines, code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fullgraph
from fullgraph.cli import main


def _breaks_once(x):
    y = x.sin()
    print("a host call the compiler cannot trace")
    return y.cos()


@pytest.mark.slow
def test_a_graph_break_is_named_with_its_line():
    report = fullgraph.explain(_breaks_once, torch.rand(3))
    assert report.graphs == 2 and len(report.breaks) == 1
    assert "print" in report.breaks[0].reason
    assert report.breaks[0].where.endswith(f"test_explain.py:{_breaks_once.__code__.co_firstlineno + 2}")
    assert report.generated and all(Path(p).is_file() for p in report.generated)
    assert "graph breaks: 1" in str(report)


@pytest.mark.slow
def test_a_fullgraph_operator_compiles_as_one_graph():
    model = fullgraph.models.KNNProjector(k=3, hidden_dim=8)
    report = fullgraph.explain(model, torch.rand(20, 3), torch.randn(50, 3), generated_code=False)
    assert report.graphs == 1 and not report.breaks and report.ops_per_graph[0] > 0


def test_bad_callable():
    with pytest.raises(TypeError, match="fn: expected a callable"):
        fullgraph.explain(3)
    with pytest.raises(TypeError, match="calls: expected a sequence of argument tuples"):
        fullgraph.explain(torch.sin, torch.rand(3), calls=[torch.rand(3)])


def _scaled(x, factor):
    return x.cos() * factor


def test_recompiles_are_named_with_the_guard_that_failed():
    """A new dtype recompiles (the guard names it); the same signature again does not."""
    x = torch.rand(3)
    report = fullgraph.explain(_scaled, x, 2, calls=[(x + 1, 2), (x.double(), 2)], generated_code=False)
    assert len(report.recompiles) == 1, report.recompiles
    recompile = report.recompiles[0]
    assert recompile.call == 2 and "_scaled" in recompile.function
    assert len(recompile.guards) == 1 and "dtype mismatch" in recompile.guards[0]
    assert "recompiles: 1" in str(report) and "recompiled _scaled" in str(report)
    assert not fullgraph.explain(_scaled, x, 2, calls=[(x + 1, 2)], generated_code=False).recompiles


@pytest.mark.slow
def test_cli_explains_a_workload(capsys):
    assert main(["explain", "lltm", "--device", "cpu", "--no-code"]) == 0
    out = capsys.readouterr().out
    assert "lltm / document eager" in out and "graphs: 1, graph breaks: 0" in out


@pytest.mark.slow
def test_a_failing_code_generation_is_reported_not_raised(monkeypatch):
    """Inductor's C++ compiler missing (or crashing, as GCC can on large kernels): the report
    still has the graphs and says why there is no generated code."""
    from torch._inductor import config

    monkeypatch.setattr(config.cpp, "cxx", ("no-such-compiler",))
    monkeypatch.setenv("CXX", "no-such-compiler")
    report = fullgraph.explain(lambda x: (x.sin() * 2).sum(), torch.rand(64))
    assert report.graphs == 1 and not report.generated and report.generated_error
    assert "generated code: none, the compilation failed" in str(report)


def test_the_explain_command_lists_the_workloads_that_explain():
    import fullgraph_cli

    from fullgraph.bench import WORKLOADS

    declaring = set()
    for name, workload in WORKLOADS.items():
        try:
            cases = workload.build(workload.sizes["tiny" if "tiny" in workload.sizes else "seed"], torch.device("cpu"))
        except (ValueError, RuntimeError):  # needs CUDA or torchrun here: declares no explain either
            continue
        if any(case.explain is not None for case in cases):
            declaring.add(name)
    assert declaring == set(fullgraph_cli.EXPLAINABLE)
