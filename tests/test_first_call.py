"""The first eager call of an operator imports no torch._dynamo (seconds on a small CPU), and
compiling afterwards still never traces into the kernels."""

from __future__ import annotations

import subprocess
import sys

import pytest

CODE = """
import sys, time
import torch, fullgraph
q, r, f = torch.rand(50, 3), torch.rand(400, 3), torch.rand(400, 4)
if sys.argv[1] == "compile first":
    import torch._dynamo
start = time.perf_counter()
fullgraph.knn(q, r, 8)
first = time.perf_counter() - start
fullgraph.radius(q, r, 0.2, 8)
fullgraph.knn_aggregate(q, r, f, 4)
fullgraph.fps(r, 0.1)
fullgraph.knn_graph(r, 4)
assert sys.argv[1] == "compile first" or "torch._dynamo" not in sys.modules, "an eager call imported it"
compiled = torch.compile(lambda q, r: fullgraph.knn(q, r, 8)[0].sum(), fullgraph=True)
assert torch.allclose(compiled(q, r), fullgraph.knn(q, r, 8)[0].sum())
import torch._dynamo.testing
counter = torch._dynamo.testing.CompileCounter()
@torch.compile(backend=counter)
def broken(q, r):
    d, i = fullgraph.knn(q, r, 4)
    torch._dynamo.graph_break()
    return fullgraph.fps(r, 0.5, random_start=False), d.sum()
broken(q, r)
print(counter.frame_count, counter.op_count)
"""


@pytest.mark.slow
def test_eager_calls_import_no_dynamo_and_compiling_still_skips_the_kernels():
    counts = []
    for order in ("eager first", "compile first"):
        done = subprocess.run([sys.executable, "-c", CODE, order], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        counts.append(done.stdout.split())
    assert counts[0] == counts[1]  # the same graphs: Dynamo traced into no kernel either way
