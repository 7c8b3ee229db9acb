"""See what the compiler makes of a function: graphs, graph breaks with their reasons and
source lines, operators per graph, recompiles with the guard that failed, and where the
generated code was written.

    report = fullgraph.explain(model, query, ref, calls=[(query2, ref2)])
    print(report)            # or `fullgraph explain knn-projector` for a workload's variants

Uses the compiler's own facilities: ``torch._dynamo.explain`` for graphs and breaks, the
guard failures dynamo records (``torch._dynamo.utils.guard_failures``) for recompiles, and
Inductor's code cache for the generated modules of one real compilation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch


@dataclass
class Break:
    reason: str  # the compiler's reason, first line
    where: str  # "file:line" of the user code that broke the graph


@dataclass
class Recompile:
    function: str  # "name (file:line)" of the function compiled again
    call: int  # which call triggered it: 1 = the first tuple of ``calls`` (0 is ``args``)
    guards: list[str]  # the guards that failed, one per cached graph tried ("frame/entry: guard")


@dataclass
class Explanation:
    graphs: int
    breaks: list[Break]
    ops_per_graph: list[int]  # operator, method and module calls in each graph
    generated: list[str] = field(default_factory=list)  # files Inductor wrote for this function
    generated_error: str | None = None  # why there is no generated code (the compilation failed)
    recompiles: list[Recompile] = field(default_factory=list)  # over the calls given

    def __str__(self) -> str:
        lines = [f"graphs: {self.graphs}, graph breaks: {len(self.breaks)}, "
                 f"operators per graph: {self.ops_per_graph}, recompiles: {len(self.recompiles)}"]
        lines += [f"  break at {b.where}: {b.reason}" for b in self.breaks]
        lines += [f"  recompiled {r.function} at call {r.call}: {'; '.join(r.guards)}" for r in self.recompiles]
        lines += [f"  generated code: {path}" for path in self.generated]
        if self.generated_error:
            lines.append(f"  generated code: none, the compilation failed ({self.generated_error})")
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


def _guard(text: str) -> str:
    """A failed guard as dynamo words it, without the source comment it appends."""
    return re.split(r"\s{2,}#", text.splitlines()[0])[0].strip()


def _recompiles(fn, calls, kwargs) -> list[Recompile]:
    """Call ``fn`` compiled (dynamo only) with each argument tuple of ``calls``; a Recompile
    for each call that made dynamo compile a function again, with the guards that failed."""
    from torch._dynamo.utils import guard_failures

    torch._dynamo.reset()
    guard_failures.clear()
    compiled = torch.compile(fn, backend="eager")
    found = []
    for index, call in enumerate(calls):
        seen = {code: len(reasons) for code, reasons in guard_failures.items()}
        compiled(*call, **kwargs)
        for code, reasons in list(guard_failures.items()):
            new = reasons[seen.get(code, 0):]
            if new:
                found.append(Recompile(f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})", index,
                                       [_guard(reason) for reason in new]))
    return found


def explain(fn, *args, calls=(), generated_code: bool = True, **kwargs) -> Explanation:
    """How torch.compile splits ``fn(*args, **kwargs)``: graphs, breaks (reason and source
    line), operators per graph, the recompiles that the further argument tuples ``calls``
    trigger after ``args`` (each with the guard that failed: a new dtype, a size that became
    dynamic, a new value of a specialized argument) and, unless ``generated_code=False``, the
    files of the code Inductor generates for it (one real compilation and call).

    Raises TypeError when ``fn`` is not callable or ``calls`` is not a sequence of tuples.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable (a function or a module), got {type(fn).__name__}")
    if isinstance(calls, (str, bytes)) or not all(isinstance(call, tuple) for call in calls):
        raise TypeError("calls: expected a sequence of argument tuples, e.g. calls=[(x2,), (x3,)], got "
                        f"{type(calls).__name__}")
    torch._dynamo.reset()
    out = torch._dynamo.explain(fn)(*args, **kwargs)
    breaks = [Break(_reason(reason.reason), _where(reason.user_stack)) for reason in out.break_reasons]
    counts = [sum(node.op in ("call_function", "call_method", "call_module") for node in graph.graph.nodes)
              for graph in out.graphs]
    report = Explanation(out.graph_count, breaks, counts)
    if calls:
        report.recompiles = _recompiles(fn, [args, *calls], kwargs)
    if generated_code:
        torch._dynamo.reset()
        try:
            report.generated = _generated(fn, args, kwargs)
        except Exception as error:  # noqa: BLE001 - the C++ or CUDA compiler failing is part of the report
            first = (str(error).strip().splitlines() or [""])[0][:200]
            report.generated_error = f"{type(error).__name__}: {first}"
    return report
