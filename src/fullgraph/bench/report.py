"""Tables, JSON and plots drawn from benchmark rows."""

from __future__ import annotations

import json
from pathlib import Path


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


# Memory measured by some workloads' checks, graph counts, and the wait for kernels compiling in
# the background after a first call (``timing.warm_up_seconds``), shown as extra columns when present.
EXTRA_COLUMNS = {"outside_torch_pool_bytes": "outside pool MiB", "library_pool_bytes": "library pool MiB",
                 "graphs": "graphs", "graph_breaks": "breaks", "warm_up_s": "warm-up s"}


def _extras(rows: list[dict]) -> list[str]:
    return [key for key in EXTRA_COLUMNS if any(key in r for r in rows)]


def _extra(row: dict, key: str) -> str:
    """An extra column's cell: bytes as MiB, seconds to two places, counts as they are."""
    if key.endswith("_bytes"):
        return _fmt(None if row.get(key) is None else row[key] / 2**20, "{:.0f}")
    if key.endswith("_s"):
        return _fmt(row.get(key), "{:.2f}")
    return _fmt(row.get(key), "{}")


def _threads(first: dict) -> str:
    """", N threads" for rows timed on a CPU, else nothing."""
    return f", {first['threads']} threads" if first.get("threads") else ""


def _title(first: dict) -> str:
    ranks = f" x {first['ranks']} ranks" if first.get("ranks") else ""
    return f"{first['workload']} ({first['size']}) on {first['device']}{ranks}{_threads(first)}, torch {first['torch']}"


def _spread(row: dict) -> str:
    """p90 / p10, marked "!" when the row is flagged noisy."""
    ratio = row["p90_ms"] / row["p10_ms"] if row["p10_ms"] > 0 else float("inf")
    return f"{ratio:.2f}x" + ("!" if row.get("noisy") else "")


def row_line(row: dict) -> str:
    """One finished row as a line of text (the progress log off a terminal)."""
    head = f"{row['variant']} / {row['phase']}"
    if "error" in row:
        return f"{head}: failed: {row['error']}"
    return f"{head}: {row['median_ms']:.3f} ms (spread {_spread(row)}, first call {row['first_call_s']:.2f} s)"


def table(rows: list[dict]):
    """A rich Table, one line per variant and phase, that stays whole in 80 columns:
    numbers never wrap or get cut; long variant names wrap onto their own lines."""
    from rich import box
    from rich.table import Table

    first = rows[0]
    noisy = any(r.get("noisy") for r in rows)
    caption = (f"sizes {first['params']}; spread: p90 / p10 of the timed runs; x base: speed-up over "
               f"{first.get('baseline') or 'the first variant'}; MiB: peak memory; 1st s: first call (compiling)")
    if noisy:
        caption += "; ! = over 2x: the machine was busy, the median may mislead (run again)"
    failures = [f"failed ({i}): {r['variant']} / {r['phase']}: {r['error']}"
                for i, r in enumerate((r for r in rows if "error" in r), 1)]
    caption = "\n".join([caption, *failures])
    out = Table(title=_title(first), caption=caption, box=box.SIMPLE_HEAD, pad_edge=False)
    extras = _extras(rows)
    out.add_column("variant", ratio=1, overflow="fold", min_width=12)
    out.add_column("phase", no_wrap=True)
    for column in ["median ms", "spread", "x base", "MiB", "1st s"] + [EXTRA_COLUMNS[key] for key in extras]:
        out.add_column(column, justify="right", no_wrap=True)
    failed = 0
    for r in rows:
        if "error" in r:
            failed += 1
            out.add_row(r["variant"], r["phase"], f"[red]failed ({failed})[/red]", *[""] * (4 + len(extras)))
            continue
        peak = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 2**20
        out.add_row(r["variant"], r["phase"], f"{r['median_ms']:.3f}", _spread(r), _fmt(r["speedup_vs_eager"], "{:.1f}"),
                    _fmt(peak, "{:.0f}"), f"{r['first_call_s']:.2f}", *[_extra(r, key) for key in extras])
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
        for key, value in row.items():
            expected = _FIELD_TYPES.get(key)
            if expected is not None and (isinstance(value, bool) or not isinstance(value, expected[0])):
                raise ReportError(f"{path}: row {i}: {key} is {type(value).__name__} {value!r:.40}, expected "
                                  f"{expected[1]}")
    return rows


_TEXT, _NUMBER, _OPTIONAL = ((str,), "a string"), ((int, float), "a number"), ((int, float, type(None)), "a number or null")
# The types of the fields the tables and plots read (others are shown as they are).
_FIELD_TYPES = {**{key: _TEXT for key in ("workload", "size", "variant", "phase", "device", "torch", "commit")},
                "triton": ((str, type(None)), "a string or null"), "params": ((dict,), "an object"),
                **{key: _NUMBER for key in ("median_ms", "p10_ms", "p90_ms")},
                **{key: _OPTIONAL for key in ("speedup_vs_eager", "peak_memory_bytes", "first_call_s")}}


def sweep_ratios(rows: list[dict], baseline: str = "cdist + topk", ours: str = "fullgraph auto"
                 ) -> dict[str, dict[str, float]]:
    """{cell: {mode: baseline median / ours}} of rows whose variants read "CELL: IMPL, MODE"
    (``fullgraph bench knn-sweep``), and {"MODE vs IMPL": IMPL's median / ours} for every other
    implementation (the peers); > 1: ours is faster."""
    times: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        head, sep, rest = r["variant"].partition(": ")
        impl, sep2, mode = rest.rpartition(", ")
        if sep and sep2 and "error" not in r and r["phase"] == "forward":
            times.setdefault((head, mode), {})[impl] = r["median_ms"]
    ratios: dict[str, dict[str, float]] = {}
    for (cell, mode), by_impl in times.items():
        if baseline not in by_impl or ours not in by_impl:
            continue
        for impl, median in by_impl.items():
            if impl != ours:
                ratios.setdefault(cell, {})[mode if impl == baseline else f"{mode} vs {impl}"] = median / by_impl[ours]
    return ratios


def _heat_map(rows: list[dict], path: Path, plt) -> None:
    """Cells (rows) by modes (columns, and a column a peer), coloured by cdist + topk's (the
    peer's) time over fullgraph's on a log scale centred on 1, each ratio written in its square."""
    from matplotlib.colors import LogNorm

    ratios = sweep_ratios(rows)
    cells = list(ratios)
    modes = list(dict.fromkeys(mode for by_mode in ratios.values() for mode in by_mode))
    grid = [[ratios[c].get(m, float("nan")) for m in modes] for c in cells]
    fig, ax = plt.subplots(figsize=(5.5 + 1.3 * len(modes), 0.28 * len(cells) + 1.8))
    image = ax.imshow(grid, cmap="RdYlGn", norm=LogNorm(vmin=0.1, vmax=10), aspect="auto")
    for i, line in enumerate(grid):
        for j, value in enumerate(line):
            if value == value:
                ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(modes)), modes, fontsize=8)
    ax.set_yticks(range(len(cells)), cells, fontsize=7)
    fig.colorbar(image, ax=ax, label="cdist + topk (or the peer) / fullgraph (time)")
    ax.set_title(_title(rows[0]).replace(" on ", "\non ", 1), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot(rows: list[dict], path: Path) -> None:
    """Horizontal bars of the median time per variant, forward and train, log scale, with
    p10-p90 whiskers and the median written beside each bar; for a sweep (rows of
    ``sweep_ratios``), the heat map of its ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if sweep_ratios(rows):
        return _heat_map(rows, Path(path), plt)

    ok = [r for r in rows if "error" not in r]
    variants = list(dict.fromkeys(r["variant"] for r in ok))
    phases = list(dict.fromkeys(r["phase"] for r in ok))
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(variants) * len(phases) + 1.8))
    height = 0.8 / max(1, len(phases))
    for p, phase in enumerate(phases):
        by_variant = {r["variant"]: r for r in ok if r["phase"] == phase}
        shown = [v for v in variants if v in by_variant]
        ys = [variants.index(v) + p * height for v in shown]
        medians = [by_variant[v]["median_ms"] for v in shown]
        whiskers = [[m - by_variant[v]["p10_ms"] for v, m in zip(shown, medians)],
                    [by_variant[v]["p90_ms"] - m for v, m in zip(shown, medians)]]
        ax.barh(ys, medians, height=height, label=phase, xerr=whiskers, capsize=2)
        for y, median in zip(ys, medians):
            ax.annotate(f"{median:.3g} ms", (median, y), xytext=(4, 0), textcoords="offset points", va="center",
                        fontsize=7)
    ax.set_yticks([v + 0.4 - height / 2 for v in range(len(variants))], variants, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("median time per call (ms, log scale); whiskers: 10th-90th percentile")
    ax.set_title(f"{_title(rows[0])}\nsizes {rows[0]['params']}", fontsize=9)
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
        f"**{first['workload']}** ({first['size']}: {first['params']}) on {first['device']}"
        f"{_threads(first)}, "
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
                     f"| {_fmt(peak, '{:.0f}')} | {r['first_call_s']:.2f} |" + "".join(f" {_extra(r, key)} |" for key in extras))
    return "\n".join(lines)


def _scaling_runs(tables: list[list[dict]]):
    """(rank counts ascending, {count: {(variant, phase): median ms}}) of one workload and
    size run at several rank counts (torchrun), or None when the tables are not such a set."""
    runs = {}
    for rows in tables:
        first = rows[0]
        if first.get("ranks") is None:
            return None
        runs[first["ranks"]] = {(r["variant"], r["phase"]): r.get("median_ms") for r in rows}
    if len(runs) < 2 or len({(rows[0]["workload"], rows[0]["size"]) for rows in tables}) != 1:
        return None
    return sorted(runs), runs


def _weak(tables: list[list[dict]]) -> bool:
    """Whether the sizes are per rank (weak scaling: the ideal time stays the same)."""
    return bool(tables[0][0]["params"].get("per_rank"))


def scaling(tables: list[list[dict]]) -> str | None:
    """A Markdown table of one workload and size run with several rank counts (torchrun):
    per variant and phase, the median at each count and against the fewest ranks the
    speed-up and efficiency (speed-up / rank ratio), or for sizes per rank (weak scaling)
    the time ratio and efficiency (its inverse). None when the tables are not such a set."""
    found = _scaling_runs(tables)
    if found is None:
        return None
    counts, runs = found
    base, weak = counts[0], _weak(tables)
    against = f"{base} rank{'s' if base > 1 else ''}"
    lines = [f"**{'weak ' if weak else ''}scaling** of {tables[0][0]['workload']} ({tables[0][0]['size']}), medians "
             f"in ms by rank count; {'time ratio' if weak else 'speed-up'} and efficiency against {against}"
             + (" (sizes per rank: ideally the same time)" if weak else ""),
             "",
             "| variant | phase | " + " | ".join(f"{n} rank{'s' if n > 1 else ''}" for n in counts)
             + f" | {'time ratio' if weak else 'speed-up'} | efficiency |",
             "| --- | --- |" + " ---: |" * (len(counts) + 2)]
    for key, first_ms in runs[base].items():
        times = [runs[n].get(key) for n in counts]
        last = times[-1]
        speedup = first_ms / last if first_ms and last else None
        if weak:
            ratio, efficiency = (None if speedup is None else 1 / speedup), speedup
        else:
            ratio, efficiency = speedup, None if speedup is None else speedup / (counts[-1] / base)
        lines.append(f"| {key[0]} | {key[1]} | " + " | ".join(_fmt(t, "{:.2f}") for t in times)
                     + f" | {_fmt(ratio, '{:.2f}x')} | {_fmt(efficiency, '{:.0%}')} |")
    return "\n".join(lines)


def scaling_plot(tables: list[list[dict]], path: Path) -> None:
    """Speed-up over the fewest ranks against the rank count, a line per variant and phase,
    with the ideal (linear) line; for runs that ``scaling`` accepts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts, runs = _scaling_runs(tables)
    base, weak = counts[0], _weak(tables)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(counts, [1.0 if weak else n / base for n in counts], "k--", linewidth=1, label="ideal")
    for key, first_ms in runs[base].items():
        points = [(n, first_ms / runs[n][key]) for n in counts if first_ms and runs[n].get(key)]
        if points:
            ax.plot(*zip(*points), marker="o", label=f"{key[0]} / {key[1]}")
    ax.set_xticks(counts)
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel(f"{'efficiency (time of' if weak else 'speed-up over'} {base} rank{'s' if base > 1 else ''}"
                  + (" / time)" if weak else ""))
    first = tables[0][0]
    ax.set_title(f"{first['workload']} ({first['size']}: {first['params']}) on {first['device']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Variants that run fullgraph's operators; every other variant is what a user would write
# without fullgraph (the tutorial's code, plain PyTorch, compiled or graphed) or a peer library.
OURS = ("fullgraph", "extension", "graphed loop")
# The size a workload is summarized at: its own, else the seed's.
SUMMARY_SIZE = {"neighbor-ops": "feature"}


def _ours(row: dict) -> bool:
    return any(word in row["variant"] for word in OURS)


def _case(row: dict) -> str:
    """The case a row belongs to: the workload, and the part of its variant before ": " (neighbor-ops
    names several shapes in one file)."""
    head, _, rest = row["variant"].partition(": ")
    if row["variant"].startswith("DDIM"):
        head, rest = row["variant"].partition(", ")[0], True
    return f"{row['workload']} {head}" if rest else row["workload"]


def _ms(value: float) -> str:
    """Milliseconds in three significant digits, thousands in full (3,770 rather than 3.77e+03)."""
    return f"{value:,.0f}" if value >= 1000 else f"{value:.3g}"


def _short(variant: str) -> str:
    return variant.rpartition(": ")[2].removeprefix("DDIM 10 steps, ")


def summary(tables: list[list[dict]]) -> str:
    """One Markdown table over result files: per workload and phase at its summary size, the
    fastest variant without fullgraph against the fastest with it (medians, ms)."""
    lines = ["| workload | phase | fastest without fullgraph | ms | fastest with fullgraph | ms | speed-up |",
             "| --- | --- | --- | ---: | --- | ---: | ---: |"]
    devices = set()
    for rows in sorted(tables, key=lambda rows: rows[0]["workload"]):
        timed = [r for r in rows if "error" not in r]
        size = SUMMARY_SIZE.get(rows[0]["workload"], "seed")
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in timed:
            if r["size"] == size:
                groups.setdefault((_case(r), r["phase"]), []).append(r)
        for (case, phase), group in groups.items():
            theirs = [r for r in group if not _ours(r)]
            ours = [r for r in group if _ours(r)]
            if not theirs or not ours:
                continue
            best_theirs = min(theirs, key=lambda r: r["median_ms"])
            best_ours = min(ours, key=lambda r: r["median_ms"])
            devices.add(best_ours["device"])
            lines.append(f"| {case} ({size}) | {phase} | {_short(best_theirs['variant'])} | "
                         f"{_ms(best_theirs['median_ms'])} | {_short(best_ours['variant'])} | "
                         f"{_ms(best_ours['median_ms'])} | {best_theirs['median_ms'] / best_ours['median_ms']:,.1f}x |")
    return f"Medians on {', '.join(sorted(devices))}, from `benchmarks/results/`:\n\n" + "\n".join(lines)


def result_files(folder: Path) -> list[Path]:
    """The result files of one device's folder, by name."""
    return sorted(Path(folder).glob("*.json"))
