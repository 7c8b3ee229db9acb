"""See what the compiler makes of a function: graphs, graph breaks with their reasons and
source lines, operators per graph, and where the generated code was written.

    report = fullgraph.explain(model, query, ref)
    print(report)            # or `fullgraph explain knn-projector` for a workload's variants

Uses the compiler's own facilities: ``torch._dynamo.explain`` for graphs and breaks, and
Inductor's code cache for the generated modules of one real compilation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Break:
    reason: str  # the compiler's reason, first line
    where: str  # "file:line" of the user code that broke the graph


@dataclass
class Explanation:
    graphs: int
    breaks: list[Break]
    ops_per_graph: list[int]  # operator, method and module calls in each graph
    generated: list[str] = field(default_factory=list)  # files Inductor wrote for this function

    def __str__(self) -> str:
        lines = [f"graphs: {self.graphs}, graph breaks: {len(self.breaks)}, "
                 f"operators per graph: {self.ops_per_graph}"]
        lines += [f"  break at {b.where}: {b.reason}" for b in self.breaks]
        lines += [f"  generated code: {path}" for path in self.generated]
        return "\n".join(lines)


def _reason(text: str) -> str:
    """The compiler's reason and its explanation line, without the debug context."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " - ".join(lines[:2])


def _where(stack) -> str:
    frame = stack[-1] if stack else None
    return f"{frame.filename}:{frame.lineno}" if frame is not None else "?"


def _generated(fn, args, kwargs) -> list[str]:
    """Compile ``fn`` with Inductor (breaks allowed), call it once, return the new code files."""
    from torch._inductor.codecache import PyCodeCache

    before = {id(module) for module in PyCodeCache.modules}
    torch.compile(fn)(*args, **kwargs)
    return [getattr(m, "__file__", "?") for m in PyCodeCache.modules if id(m) not in before]


def explain(fn, *args, generated_code: bool = True, **kwargs) -> Explanation:
    """How torch.compile splits ``fn(*args, **kwargs)``: graphs, breaks (reason and source
    line), operators per graph and, unless ``generated_code=False``, the files of the code
    Inductor generates for it (one real compilation and call).

    Raises TypeError when ``fn`` is not callable.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable (a function or a module), got {type(fn).__name__}")
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = [Break(_reason(reason.reason), _where(reason.user_stack)) for reason in out.break_reasons]
    calls = [sum(node.op in ("call_function", "call_method", "call_module") for node in graph.graph.nodes)
             for graph in out.graphs]
    report = Explanation(out.graph_count, breaks, calls)
    if generated_code:
        torch._dynamo.reset()
        report.generated = _generated(fn, args, kwargs)
    return report
