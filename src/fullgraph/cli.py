"""The ``fullgraph`` command line: ``fullgraph bench WORKLOAD``. Its arguments are parsed by
``fullgraph_cli`` (outside the package, so that ``--help`` needs no torch); the commands
run here."""

from __future__ import annotations

import os
import sys
import time

import torch
from fullgraph_cli import usage as _usage


def _default_size(workload: str, gpu: bool) -> str:
    """seed on CUDA (a workload without one: its first size); small on CPUs where the workload
    has it, else as on CUDA."""
    from .bench import WORKLOADS

    sizes = WORKLOADS[workload].sizes
    if not gpu and "small" in sizes:
        return "small"
    return "seed" if "seed" in sizes else next(iter(sizes))


def _join_torchrun() -> torch.device | None:
    """Under torchrun (WORLD_SIZE set): join its process group (NCCL with a GPU per rank, else
    gloo on the CPU) and return this rank's device (None without torchrun)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    import torch.distributed as dist

    from .distributed import process_group_backend

    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "RANK") if name not in os.environ]
    if missing:
        _usage(f"WORLD_SIZE is set but {', '.join(missing)} not: launch with torchrun "
               "(torchrun --nproc-per-node N -m fullgraph.cli bench ...) or unset WORLD_SIZE")
    backend = process_group_backend()
    if not dist.is_initialized():
        dist.init_process_group(backend)
    if backend != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        _usage(f"--device {name}: expected cpu or cuda[:N]")
    if device.type not in ("cpu", "cuda"):
        _usage(f"--device {name}: benchmarks run on cpu or cuda[:N], got {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        _usage(f"--device {name}: CUDA is not available on this machine")
    return device


def _progress_log():
    """Off a terminal (CI, a log file) the spinner is silent: say each step on stderr as it
    happens, with the seconds since the start, so a run cut short still shows where it was."""
    if sys.stderr.isatty():
        return lambda line: None
    start = time.perf_counter()
    return lambda line: print(f"[{time.perf_counter() - start:7.1f} s] {line}", file=sys.stderr, flush=True)


def _words(text: str) -> tuple[str, ...]:
    """--variants "a, b" -> ("a", "b")."""
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _bench(args) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from . import bench
    from .bench import report

    ranked = _join_torchrun()
    rank = torch.distributed.get_rank() if ranked is not None else 0
    device = _device(args.device) if args.device is not None or ranked is None else ranked
    gpu = device.type == "cuda"
    size = args.size or _default_size(args.workload, gpu)
    warmup = args.warmup if args.warmup is not None else (5 if gpu else 2)
    runs = args.runs if args.runs is not None else (30 if gpu else 10)
    if warmup < 0 or runs < 1:
        _usage(f"--warmup must be >= 0 and --runs >= 1, got --warmup {warmup} --runs {runs}")
    if args.threads is not None:  # checked with the other arguments (fullgraph_cli)
        torch.set_num_threads(args.threads)
    # Under torchrun every rank runs the variants; rank 0 reports.
    console = Console(width=None if sys.stdout.isatty() else 132, quiet=rank != 0)
    log = _progress_log() if rank == 0 else (lambda line: None)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"{args.workload} ({size}) on {device}", total=None)

        def on_step(step):
            progress.update(task, description=f"{args.workload}: {step}")
            log(f"{step} ...")

        finished = []

        def on_row(row):
            log(report.row_line(row))
            finished.append(row)
            if args.json and rank == 0:  # the rows so far, so that a run cut short keeps them
                report.write_json(finished, args.json)

        try:
            rows = bench.run_workload(args.workload, size, device, warmup, runs, explain=args.explain,
                                      on_step=on_step, on_row=on_row, variants=_words(args.variants))
        except ValueError as error:  # a workload that cannot run here says why
            _usage(f"{args.workload}: {error}")
    if not rows:
        raise SystemExit(f"{args.workload}: no variant can run here (its libraries are missing)")
    console.print(report.table(rows))
    if args.json and rank == 0:
        report.write_json(rows, args.json)
        console.print(f"wrote {args.json}")
    if args.plot and rank == 0:
        report.plot(rows, args.plot)
        console.print(f"wrote {args.plot}")
    return 1 if all("error" in r for r in rows) else 0


def _explain(args) -> int:
    from . import bench
    from .explain import explain

    device = _device(args.device)
    workload = bench.WORKLOADS[args.workload]
    try:
        cases = [c for c in workload.build(workload.sizes[args.size], device)
                 if c.explain is not None]
    except ValueError as error:
        _usage(f"{args.workload}: {error}")
    if not cases:
        _usage(f"{args.workload}: no variant declares what to explain")
    for case in cases:
        fn, call_args = case.explain
        if not args.no_code:
            print(f"fullgraph explain: {args.workload} / {case.variant}: compiling with Inductor for its generated "
                  "code (minutes on a CPU for the larger models; --no-code skips it)", file=sys.stderr, flush=True)
        with torch.no_grad():
            print(f"{args.workload} / {case.variant}\n{explain(fn, *call_args, generated_code=not args.no_code)}\n")
    return 0


def _profile(args) -> int:
    from .bench.profile import profile_workload

    device = _device(args.device)
    size = args.size or _default_size(args.workload, device.type == "cuda")
    if args.rows < 1:
        _usage(f"--rows must be >= 1, got {args.rows}")
    try:
        for variant, phase, table in profile_workload(args.workload, size, device, _words(args.variants),
                                                      rows=args.rows):
            print(f"{args.workload} ({size}) / {variant} / {phase}\n{table}\n", flush=True)
    except ValueError as error:  # a workload that cannot run here says why
        _usage(f"{args.workload}: {error}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``fullgraph ...``: parse and check the arguments (``fullgraph_cli``), then run."""
    import fullgraph_cli

    return fullgraph_cli.main(argv)


def run(args) -> int:
    """Run parsed ``fullgraph`` arguments."""
    if args.command == "bench":
        return _bench(args)
    if args.command == "explain":
        return _explain(args)
    if args.command == "profile":
        return _profile(args)
    if args.command == "doctor":
        from .doctor import report

        print(report())
        return 0
    if args.command == "report":
        from .bench import report

        plot = args.plot  # its path checked with the other arguments (fullgraph_cli)
        files = [file for path in args.files for file in (report.result_files(path) if path.is_dir() else [path])]
        try:
            tables = [report.read_json(path) for path in files]  # every file checked before printing
        except report.ReportError as error:
            _usage(f"report: {error}")
        if args.summary:
            print(report.summary(tables))
            return 0
        scaling = report.scaling(tables)  # several rank counts of one torchrun workload
        if plot is not None and scaling is None and len(tables) > 1:
            _usage("report --plot: expected one file, or runs of one torchrun workload at several rank counts, "
                   f"got {len(tables)} files of different runs")
        print("\n\n".join([report.markdown(rows) for rows in tables] + ([scaling] if scaling else [])))
        if plot is not None:
            if scaling:
                report.scaling_plot(tables, plot)
            else:
                report.plot(tables[0], plot)
            print(f"wrote {plot}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
