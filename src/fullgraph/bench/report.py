"""Tables, JSON and plots drawn from benchmark rows."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


# Memory measured by some workloads' checks, shown as extra columns (MiB) when present.
EXTRA_COLUMNS = {"outside_torch_pool_bytes": "outside pool MiB", "library_pool_bytes": "library pool MiB"}


def _extras(rows: list[dict]) -> list[str]:
    return [key for key in EXTRA_COLUMNS if any(key in r for r in rows)]


def _mib(row: dict, key: str) -> str:
    return _fmt(None if row.get(key) is None else row[key] / 2**20, "{:.0f}")


def table(rows: list[dict]):
    """A rich Table: one line per variant and phase."""
    from rich.table import Table

    first = rows[0]
    title = f"{first['workload']} ({first['size']}: {first['params']}) on {first['device']}, torch {first['torch']}"
    out = Table(title=title)
    extras = _extras(rows)
    columns = ["variant", "phase", "median ms", "p10-p90 ms", "x eager", "peak MiB", "first call s"]
    for column in columns + [EXTRA_COLUMNS[key] for key in extras]:
        out.add_column(column, justify="left" if column in ("variant", "phase") else "right")
    for r in rows:
        if "error" in r:
            out.add_row(r["variant"], r["phase"], f"[red]failed: {r['error']}[/red]", *[""] * (4 + len(extras)))
            continue
        peak = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20
        out.add_row(r["variant"], r["phase"], f"{r['median_ms']:.3f}", f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}",
                    _fmt(r["speedup_vs_eager"], "{:.1f}"), _fmt(peak, "{:.1f}"), f"{r['first_call_s']:.2f}",
                    *[_mib(r, key) for key in extras])
    return out


def write_json(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1) + "\n")


# What every row carries (the rest depends on whether the variant ran).
ROW_KEYS = ("workload", "size", "params", "variant", "phase", "device", "torch", "triton", "commit")
TIMED_KEYS = ("median_ms", "speedup_vs_eager", "peak_memory_bytes", "first_call_s")


class ReportError(ValueError):
    """A file that is not what ``fullgraph bench --json`` writes (the message says how)."""


def read_json(path: Path) -> list[dict]:
    """The rows of a ``fullgraph bench --json`` file; ReportError naming the file and the problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
        raise ReportError(f"{path}: cannot be read ({type(error).__name__})") from None
    if not text.strip():
        raise ReportError(f"{path}: the file is empty")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise ReportError(f"{path}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ReportError(f"{path}: expected a non-empty list of benchmark rows (what fullgraph bench --json "
                          f"writes), got {type(rows).__name__}")
    for i, row in enumerate(rows):
        missing = [key for key in ROW_KEYS + (() if "error" in row else TIMED_KEYS) if key not in row]
        if missing:
            raise ReportError(f"{path}: row {i} lacks {', '.join(missing)}: not a fullgraph bench row")
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """Horizontal bars of the median time per variant, forward and train, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    phases = list(dict.fromkeys(r["phase"] for r in ok))
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(variants) * len(phases) + 1.5))
    height = 0.8 / len(phases)
    for p, phase in enumerate(phases):
        times = {r["variant"]: r["median_ms"] for r in ok if r["phase"] == phase}
        ys = [v + p * height for v in range(len(variants))]
        ax.barh(ys, [times.get(v, 0) for v in variants], height=height, label=phase)
    ax.set_yticks([v + 0.4 - height / 2 for v in range(len(variants))], variants)
    ax.set_xscale("log")
    ax.set_xlabel("median time per call (ms, log scale)")
    ax.set_title(f"{rows[0]['workload']} on {rows[0]['device']}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: list[dict]) -> str:
    """A Markdown table of the rows, for the README."""
    first = rows[0]
    extras = _extras(rows)
    lines = [
        f"**{first['workload']}** ({first['size']}: {first['params']}) on {first['device']}, "
        f"torch {first['torch']}, triton {first['triton']}, commit {first['commit']}",
        "",
        "| variant | phase | median ms | x eager | peak MiB | first call s |"
        + "".join(f" {EXTRA_COLUMNS[key]} |" for key in extras),
        "| --- | --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(extras),
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['phase']} | failed: {r['error'][:70]} | | | |" + " |" * len(extras))
            continue
        peak = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20
        lines.append(f"| {r['variant']} | {r['phase']} | {r['median_ms']:.2f} | {_fmt(r['speedup_vs_eager'], '{:.2f}')} "
                     f"| {_fmt(peak, '{:.0f}')} | {r['first_call_s']:.2f} |" + "".join(f" {_mib(r, key)} |" for key in extras))
    return "\n".join(lines)
