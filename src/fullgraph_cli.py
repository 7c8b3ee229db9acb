"""The ``fullgraph`` command line: ``fullgraph bench WORKLOAD``.

This entry point lives outside the ``fullgraph`` package so that ``fullgraph --help`` and
``--version`` answer at once: importing the package registers its operators, which needs
torch (seconds). The commands themselves run in ``fullgraph.cli``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from importlib import metadata
from pathlib import Path

# The workloads of ``fullgraph bench`` and their sizes, as ``fullgraph.bench.WORKLOADS``
# registers them (tests/bench/test_cli.py keeps the two equal).
WORKLOADS = {
    "diffusion-policy": ("seed", "batch8", "small", "tiny"),
    "edgeconv": ("seed", "small", "tiny"),
    "extern-pool": ("seed", "small", "tiny"),
    "fps": ("seed", "large", "small", "tiny"),
    "kmeans": ("seed", "small", "tiny"),
    "knn-graph": ("seed", "small", "tiny"),
    "kmeans-fit": ("seed", "small", "wide", "tiny"),
    "knn-projector": ("seed", "small", "tiny"),
    "knn-sweep": ("quick", "wide", "batched", "small", "peers", "lists", "tiny", "full"),
    "knn-sharded": ("seed", "weak", "weak-h100", "medium", "small", "tiny"),
    "lltm": ("seed", "small", "tiny", "batch256", "batch2048"),
    "neighbor-ops": ("seed", "large", "feature", "feature-small", "small", "crossover"),
    "pointnet2": ("seed", "small", "tiny"),
    "pyg-dgcnn": ("seed", "small", "tiny"),
    "pyg-pointnet2": ("seed", "small", "tiny"),
    "radius-graph": ("seed", "small", "tiny"),
    "radius-projector": ("seed", "small", "tiny"),
}

# The workloads whose variants declare a call to explain (the same test keeps this list true).
EXPLAINABLE = ("edgeconv", "knn-projector", "lltm", "pointnet2", "radius-projector")


def _version() -> str:
    try:
        return metadata.version("fullgraph")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        from fullgraph import __version__

        return __version__


class _Version(argparse.Action):
    """--version, looked up only when asked for."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"fullgraph {_version()}")
        parser.exit()


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``fullgraph`` (needs neither torch nor the package)."""
    out = argparse.ArgumentParser(prog="fullgraph", description="fullgraph's benchmarks and tools: time every "
                                  "variant of a workload side by side, explain its graphs, report saved runs")
    out.add_argument("--version", action=_Version)
    commands = out.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="time a workload in every variant, side by side")
    bench.add_argument("workload", choices=sorted(WORKLOADS), help="which workload (README: Benchmarks)")
    sizes = sorted({size for names in WORKLOADS.values() for size in names})
    bench.add_argument("--size", choices=sizes, default=None,
                       help="problem size: seed (the tutorial's own size; a workload without one: its first) is "
                            "the default on CUDA, small on CPU (as on CUDA where a workload has no small); tiny is "
                            "a smoke test")
    bench.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    bench.add_argument("--threads", type=int, default=None,
                       help="CPU threads for the run (torch.set_num_threads; default: torch's own)")
    bench.add_argument("--warmup", type=int, default=None, help="untimed calls before timing (default 5 GPU, 2 CPU)")
    bench.add_argument("--runs", type=int, default=None,
                       help="timed samples; the median is reported (default 30 GPU, 10 CPU)")
    bench.add_argument("--variants", default="", metavar="WORDS",
                       help="comma-separated words: run only the variants whose names contain one (and the baseline)")
    bench.add_argument("--json", type=Path, default=None, help="write the rows as JSON to this path")
    bench.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart to this path")
    bench.add_argument("--explain", action="store_true",
                       help="also count the graphs and graph breaks torch.compile makes of each eager variant "
                            "(columns graphs, breaks; `fullgraph explain` shows the reasons)")
    explain = commands.add_parser("explain", help="how torch.compile splits a workload's eager variants: graphs, "
                                                  "graph breaks with reasons and source lines, generated code")
    explain.add_argument("workload", choices=EXPLAINABLE,
                         help="which workload (those whose variants are models torch.compile can explain)")
    explain.add_argument("--size", choices=sizes, default="tiny", help="problem size (default tiny)")
    explain.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    explain.add_argument("--no-code", action="store_true", help="skip the Inductor compilation that locates "
                                                                 "the generated code")
    commands.add_parser("doctor", help="which native parts are built, buildable or missing here, the optional "
                                       "libraries installed, and what \"auto\" takes because of it")
    prof = commands.add_parser("profile", help="where one call of each variant of a workload spends its time "
                                               "(torch.profiler: kernels and operators by self time)")
    prof.add_argument("workload", choices=sorted(WORKLOADS), help="which workload (see bench)")
    prof.add_argument("--size", choices=sizes, default=None, help="problem size (default: as bench)")
    prof.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    prof.add_argument("--variants", default="", metavar="WORDS",
                      help="comma-separated words: profile only the variants whose names contain one")
    prof.add_argument("--rows", type=int, default=12, help="rows of each table (default 12)")
    show = commands.add_parser("report", help="print saved benchmark JSON as Markdown tables")
    show.add_argument("files", type=Path, nargs="+", help="JSON files written by `fullgraph bench --json` "
                                                             "(a folder: its *.json files)")
    show.add_argument("--summary", action="store_true",
                      help="one table: per workload and phase, the fastest variant without fullgraph against the "
                           "fastest with it (the README's results table)")
    show.add_argument("--plot", type=Path, default=None,
                      help="write a PNG: the speed-up by rank count for runs of one torchrun workload at several "
                           "rank counts, else the bar chart of one file")
    return out


def usage(message: str):
    """A usage error: one line on stderr, exit status 2, before any work starts."""
    print(f"fullgraph: {message}", file=sys.stderr)
    raise SystemExit(2)


PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def output_path(path: Path | None, flag: str) -> None:
    """Refuse an output path that cannot be written, before the run."""
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        usage(f"{flag} {path}: is a folder, expected a file path")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        usage(f"{flag} {path}: cannot write there ({existing} is not a writable folder)")
    if existing != folder:
        usage(f"{flag} {path}: the folder {folder} does not exist (create it first)")
    if flag.endswith("--plot"):
        if path.suffix.lower() not in PLOT_FORMATS:
            usage(f"{flag} {path}: expected an image file name ending in {', '.join(PLOT_FORMATS)}")
        if importlib.util.find_spec("matplotlib") is None:
            usage(f"{flag}: plots need matplotlib (pip install matplotlib, or \"fullgraph[bench]\")")


def _check_early(args) -> None:
    """The usage errors found without torch (seconds to import): a size the workload lacks,
    output paths, counts out of range."""
    size = getattr(args, "size", None)
    if size is not None and getattr(args, "workload", None) in WORKLOADS and size not in WORKLOADS[args.workload]:
        usage(f"--size {size}: {args.workload} has sizes {', '.join(WORKLOADS[args.workload])}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        usage(f"--threads must be >= 1, got {args.threads}")
    output_path(getattr(args, "json", None), "--json")
    output_path(getattr(args, "plot", None), "--plot")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _check_early(args)
    from fullgraph.cli import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
