"""`fullgraph bench` end to end at the tiny size: every variant timed, JSON, plot, report."""

from __future__ import annotations

import json

import pytest
import torch

import fullgraph
from fullgraph.cli import main


@pytest.mark.slow
def test_bench_writes_rows_table_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    # --variants: only those named, and the baseline the ratios need (one compile instead of two)
    code = main(["bench", "radius-projector", "--size", "tiny", "--device", "cpu", "--warmup", "1", "--runs", "3",
                 "--variants", "FULLGRAPH, nothing-matches-this", "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())
    variants = {r["variant"] for r in rows}
    assert variants == {"document eager", "fullgraph eager", "fullgraph compiled"}
    assert {r["phase"] for r in rows} == {"forward", "train"}
    for row in rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["first_call_s"] > 0 and row["speedup_vs_eager"] > 0
        assert row["device"] and row["torch"] and row["params"] == {"grid": 5, "cloud": 500, "radius": 0.5}
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    captured = capsys.readouterr()
    printed = captured.out
    assert "fullgraph compiled" in printed and "x base" in printed and "threads" in printed
    # Off a terminal every step and finished row is logged on stderr as it happens.
    assert "] fullgraph compiled / train ..." in captured.err
    assert "] fullgraph compiled / train: " in captured.err and " ms (spread " in captured.err
    assert all(row["threads"] == torch.get_num_threads() and row["baseline"] == "document eager" for row in rows)
    assert main(["report", str(out_json)]) == 0
    assert "| fullgraph eager | forward |" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_explain_counts_graphs_and_breaks(tmp_path, capsys):
    out_json = tmp_path / "rows.json"
    assert main(["bench", "radius-projector", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--runs", "1",
                 "--variants", "eager", "--explain", "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    explained = [r for r in rows if "graphs" in r]
    assert explained and all(r["phase"] == "forward" and r["variant"].endswith("eager") for r in explained)
    assert all(r["graphs"] >= 1 and r["graph_breaks"] >= 0 for r in explained)
    assert "breaks" in capsys.readouterr().out


def _usage_error(argv, capsys) -> str:
    """The one line a usage error prints; exit status 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return err.splitlines()[-1]


def test_bad_arguments(capsys, tmp_path):
    _usage_error(["bench", "no-such-workload"], capsys)
    assert "--runs >= 1" in _usage_error(["bench", "knn-projector", "--device", "cpu", "--runs", "0"], capsys)
    assert "--threads must be >= 1, got 0" in _usage_error(["bench", "lltm", "--device", "cpu", "--threads", "0"],
                                                            capsys)
    assert "extern-pool: " in _usage_error(["bench", "extern-pool", "--device", "cpu"], capsys)
    assert "benchmarks run on cpu or cuda" in _usage_error(["bench", "knn-projector", "--device", "meta"], capsys)
    assert "expected cpu or cuda" in _usage_error(["bench", "knn-projector", "--device", "gpu0"], capsys)
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert "cannot write there" in _usage_error(
        ["bench", "knn-projector", "--device", "cpu", "--json", str(blocked / "rows.json")], capsys)
    assert "is a folder" in _usage_error(["bench", "knn-projector", "--device", "cpu", "--plot", str(tmp_path)], capsys)
    assert "expected an image file name ending in .png" in _usage_error(
        ["bench", "knn-projector", "--device", "cpu", "--plot", str(tmp_path / "out.txt")], capsys)
    assert "does not exist (create it first)" in _usage_error(
        ["bench", "knn-projector", "--device", "cpu", "--json", str(tmp_path / "no" / "such" / "rows.json")], capsys)
    assert "--variants: no variant contains 'zzzz'" in _usage_error(
        ["bench", "knn-projector", "--device", "cpu", "--variants", "zzzz", "--json", str(tmp_path / "v.json")], capsys)
    assert not (tmp_path / "v.json").exists()  # refused before any row was timed


def test_a_world_size_without_torchrun_is_a_usage_error(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK"):
        monkeypatch.delenv(name, raising=False)
    line = _usage_error(["bench", "knn-projector", "--device", "cpu"], capsys)
    assert "MASTER_ADDR, MASTER_PORT, RANK not: launch with torchrun" in line


def test_report_names_the_bad_file(tmp_path, capsys):
    good = tmp_path / "good.json"
    row = {key: "x" for key in ("workload", "size", "variant", "phase", "device", "torch", "triton", "commit")}
    row["params"] = {}
    good.write_text(json.dumps([{**row, "error": "RuntimeError: boom"}]))
    timed = {**row, "median_ms": "fast", "speedup_vs_eager": 1.0, "peak_memory_bytes": 0, "first_call_s": 0.1}
    cases = {
        "missing.json": (None, "no such file"),
        "empty.json": ("", "the file is empty"),
        "broken.json": ("[{", "not JSON"),
        "object.json": ('{"a": 1}', "expected a non-empty list of benchmark rows"),
        "rows.json": ('[{"variant": "v"}]', "row 0 lacks workload"),
        "types.json": (json.dumps([timed]), "row 0: median_ms is str 'fast', expected a number"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        line = _usage_error(["report", str(good), str(path)], capsys)
        assert str(path) in line and message in line
    assert main(["report", str(good)]) == 0
    assert "failed: RuntimeError: boom" in capsys.readouterr().out
    line = _usage_error(["report", str(good), str(good), "--plot", str(tmp_path / "p.png")], capsys)
    assert "report --plot: expected one file, or runs of one torchrun workload at several rank counts" in line



@pytest.mark.parametrize("per_rank", [False, True])
def test_report_of_several_rank_counts_is_a_scaling_table(tmp_path, capsys, per_rank):
    """Strong scaling (total sizes): speed-up and speed-up / rank ratio; weak (sizes per rank):
    the time ratio and its inverse, the efficiency."""
    paths = []
    for ranks, ms in ((1, 100.0), (2, 125.0 if per_rank else 55.0)):
        row = {"workload": "knn-sharded", "size": "weak" if per_rank else "seed", "ranks": ranks,
               "params": {"points": 10, "per_rank": per_rank}, "variant": "distributed.knn, uniform",
               "phase": "forward", "median_ms": ms, "device": "cpu", "torch": torch.__version__, "triton": None,
               "commit": "0", "speedup_vs_eager": 1.0, "peak_memory_bytes": 0, "first_call_s": 0.1}
        paths.append(tmp_path / f"rows-{ranks}.json")
        paths[-1].write_text(json.dumps([row]))
    assert main(["report", *map(str, paths)]) == 0
    printed = capsys.readouterr().out
    if per_rank:
        assert "**weak scaling**" in printed and "| 100.00 | 125.00 | 1.25x | 80% |" in printed
    else:
        assert "**scaling**" in printed and "| 100.00 | 55.00 | 1.82x | 91% |" in printed

@pytest.mark.slow
def test_bench_kmeans_times_every_variant(tmp_path):
    out_json = tmp_path / "rows.json"
    assert main(["bench", "kmeans", "--size", "tiny", "--device", "cpu", "--warmup", "1", "--runs", "2",
                 "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert {(r["variant"], r["phase"]) for r in rows} >= {
        ("document eager", "forward"), ("document eager", "train"), ("document compiled", "forward"),
        ("fullgraph compiled", "forward"), ("fullgraph compiled", "train"),
    }
    for row in rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0


def test_version(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.startswith("fullgraph ")


def test_help_and_version_need_no_torch():
    """fullgraph --help answers at once: the entry point imports neither torch nor the package
    (nor does --version where the package is installed; from a source tree on the path it
    reads the package's own __version__)."""
    import subprocess
    import sys
    from importlib import metadata

    try:
        metadata.version("fullgraph")
        asked = "['--help'], ['bench', '--help'], ['--version']"
    except metadata.PackageNotFoundError:
        asked = "['--help'], ['bench', '--help']"
    code = ("import sys, fullgraph_cli\n"
            f"for argv in ({asked}):\n"
            "    try:\n"
            "        fullgraph_cli.main(argv)\n"
            "    except SystemExit as exit:\n"
            "        assert exit.code == 0, exit.code\n"
            "assert 'torch' not in sys.modules and 'fullgraph' not in sys.modules, 'imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "knn-projector" in out.stdout and ("fullgraph 0." in out.stdout or "--version" not in asked)


def test_the_entry_points_catalogue_is_the_registry():
    import fullgraph_cli
    from fullgraph.bench import WORKLOADS

    assert fullgraph_cli.WORKLOADS == {name: tuple(w.sizes) for name, w in WORKLOADS.items()}
    assert fullgraph_cli._version() == fullgraph.__version__


def test_importing_the_package_loads_no_compiler():
    """`import fullgraph` registers the operators but leaves torch.compile's machinery
    (torch._dynamo, seconds to import) to the first compiled call."""
    import subprocess
    import sys

    code = "import sys, fullgraph\nassert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.slow
def test_bench_variants_naming_none_is_refused_with_the_names(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "radius-projector", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--runs", "1",
              "--variants", "no-such-variant"])
    err = capsys.readouterr().err
    assert "--variants: no variant contains 'no-such-variant'" in err and "'fullgraph compiled'" in err


def test_bench_diffusion_policy_compares_fullgraph_on_a_cpu(tmp_path):
    out_json = tmp_path / "rows.json"
    assert main(["bench", "diffusion-policy", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--runs", "1",
                 "--variants", "eager", "--json", str(out_json)]) == 0
    # eager variants: the U-Net's CPU compile (~1.5 min here) is tested in tests/models/test_unet1d.py
    rows = json.loads(out_json.read_text())
    assert {r["variant"] for r in rows} == {"document eager", "DDIM 3 steps, eager"}
    for row in rows:
        assert "error" not in row, row
        assert row.get("max_abs_diff_vs_eager", row.get("max_abs_diff_vs_eager_ddim")) < 1e-3


def test_bench_kmeans_fit_and_threads(tmp_path):
    out_json = tmp_path / "rows.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "kmeans-fit", "--size", "tiny", "--device", "cpu", "--runs", "2", "--threads", "1",
                     "--json", str(out_json)]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads(out_json.read_text())
    assert {r["variant"] for r in rows} == {"scikit-learn KMeans.fit", "fullgraph KMeans.fit, compiled NumPy steps"}
    assert all(r["threads"] == 1 and r["iterations"] >= 1 and r["inertia"] > 0 for r in rows)
    # the same data from the same centroids: the same fit, to rounding
    inertias = [r["inertia"] for r in rows]
    assert abs(inertias[0] - inertias[1]) <= 1e-3 * inertias[0]


@pytest.mark.slow
def test_bench_json_holds_the_rows_so_far_after_each_row(tmp_path, monkeypatch):
    """A run cut short (a device time limit) keeps the rows finished before it stopped."""
    from fullgraph.bench import report

    out_json, seen = tmp_path / "rows.json", []
    write = report.write_json
    monkeypatch.setattr(report, "write_json", lambda rows, path: (seen.append(len(rows)), write(rows, path)))
    assert main(["bench", "lltm", "--size", "tiny", "--device", "cpu", "--warmup", "0", "--runs", "1",
                 "--json", str(out_json)]) == 0
    rows = json.loads(out_json.read_text())
    assert seen[:len(rows)] == list(range(1, len(rows) + 1)) and seen[-1] == len(rows)


@pytest.mark.parametrize("name", ["knn-graph", "radius-graph"])
def test_graph_builder_workloads_agree_with_their_plain_variant(name):
    from fullgraph.bench import WORKLOADS

    cases = {case.variant: case for case in WORKLOADS[name].build({"points": 3000, "plain": True},
                                                                         torch.device("cpu"))}
    fields = cases[f"fullgraph.{name.replace('-', '_')}"].check()
    assert fields["same_edges_as_plain"] and fields["edges"] > 2 * fields["sampled_points"]


def test_profile_prints_each_variant_s_kernels(capsys):
    """`fullgraph profile`: one profiled call of each selected variant, by self time."""
    assert main(["profile", "lltm", "--size", "small", "--device", "cpu", "--variants", "document eager",
                 "--rows", "5"]) == 0
    out = capsys.readouterr().out
    assert "lltm (small) / document eager / forward" in out and "lltm (small) / document eager / train" in out
    assert "Self CPU" in out and "aten::" in out


def test_profile_refuses_bad_rows(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["profile", "lltm", "--device", "cpu", "--rows", "0"])
    assert stop.value.code == 2 and "--rows must be >= 1, got 0" in capsys.readouterr().err


def test_report_summary_draws_one_table_from_a_folder(tmp_path, capsys):
    rows = [dict(workload="w", size="seed", params={}, variant=variant, phase="forward", device="GPU", torch="2",
                 triton="3", commit="abc", median_ms=ms, speedup_vs_eager=1.0, peak_memory_bytes=None,
                 first_call_s=0.1, p10_ms=ms, p90_ms=ms)
            for variant, ms in (("plain eager", 4.0), ("plain compiled", 2.0), ("fullgraph compiled", 0.5))]
    (tmp_path / "w.json").write_text(json.dumps(rows))
    assert main(["report", "--summary", str(tmp_path)]) == 0
    assert "| w (seed) | forward | plain compiled | 2 | fullgraph compiled | 0.5 | 4.0x |" in capsys.readouterr().out


def test_doctor_reports_native_parts_libraries_and_auto_without_building(capsys):
    assert main(["doctor"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "native parts:" in out and "CPU neighbour extension: " in out and "LLTM" in out
    assert "optional libraries: " in out and '"auto" on cpu:' in out and "knn, float32, D = 64: dense" in out
    assert "fullgraph: building" not in captured.err


def test_usage_errors_answer_without_torch(tmp_path):
    """A size the workload lacks and unwritable outputs are refused before torch is imported."""
    import subprocess
    import sys

    code = ("import sys, fullgraph_cli\n"
            "try:\n"
            f"    fullgraph_cli.main(sys.argv[1:])\n"
            "except SystemExit as stop:\n"
            "    assert 'torch' not in sys.modules, 'torch was imported'\n"
            "    raise\n")
    for argv, message in [(["bench", "lltm", "--size", "feature"], "--size feature: lltm has sizes seed"),
                          (["bench", "lltm", "--json", str(tmp_path / "no" / "x.json")], "does not exist"),
                          (["bench", "lltm", "--plot", str(tmp_path / "x.txt")], "expected an image file name")]:
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and message in out.stderr and "torch was imported" not in out.stderr, out.stderr


def test_a_sweep_s_rows_give_its_ratios_and_heat_map(tmp_path):
    """Rows named "CELL: IMPL, MODE" (knn-sweep) give cdist + topk's time over fullgraph's per
    cell and mode, and --plot draws them as a heat map."""
    from fullgraph.bench import report

    base = {"workload": "knn-sweep", "size": "tiny", "params": {}, "phase": "forward", "device": "cpu",
            "torch": torch.__version__, "triton": None, "commit": "x", "p10_ms": 1.0, "p90_ms": 1.0}
    times = {("B=1 4x8 D=3 k=2 float32", "as called"): (2.0, 1.0), ("B=1 4x8 D=3 k=2 float32", "compiled"): (1.0, 4.0),
             ("B=2 4x8 D=9 k=2 float32", "as called"): (3.0, 1.5)}
    rows = [{**base, "variant": f"{cell}: {impl}, {mode}", "median_ms": ms}
            for (cell, mode), pair in times.items() for impl, ms in zip(("cdist + topk", "fullgraph auto"), pair)]
    rows.append({**base, "variant": "B=2 4x8 D=9 k=2 float32: fullgraph auto, compiled", "error": "E: failed"})
    rows.append({**base, "variant": "B=1 4x8 D=3 k=2 float32: faiss exact, as called", "median_ms": 0.5})
    assert report.sweep_ratios(rows) == {
        "B=1 4x8 D=3 k=2 float32": {"as called": 2.0, "compiled": 0.25, "as called vs faiss exact": 0.5},
        "B=2 4x8 D=9 k=2 float32": {"as called": 2.0}}
    report.plot(rows, tmp_path / "heat.png")
    assert (tmp_path / "heat.png").read_bytes()[:4] == b"\x89PNG"
    assert report.sweep_ratios([{**base, "variant": "document eager", "median_ms": 1.0}]) == {}


def test_the_sweep_s_exact_peer_finds_the_references_lists(generator):
    """The sweep's CPU peer, FAISS's exact index a batch item at a time: the reference's indices
    and, within float32's rounding of its expansion, its distances (random clouds: no ties)."""
    pytest.importorskip("faiss")
    from fullgraph.bench.workloads.knn_sweep import exact_peer

    assert exact_peer(torch.device("cpu"), "bfloat16") is None and exact_peer(torch.device("cuda"), "float32") is None
    query, ref = torch.randn(3, 50, 24, generator=generator), torch.randn(3, 400, 24, generator=generator)
    dists, idx = exact_peer(torch.device("cpu"), "float32")(query, ref, 7)
    want_dists, want_idx = fullgraph.knn(query, ref, 7, backend="torch")
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(dists, want_dists, rtol=1e-4, atol=1e-4)


def test_each_sweep_cell_keeps_its_own_peer():
    """A float32 cell's FAISS variant runs FAISS on its own clouds even when a later cell of the
    grid (half precision) has no peer."""
    pytest.importorskip("faiss")
    from fullgraph.bench.workloads import WORKLOADS

    params = {"cells": [[1, 8, 40, 6, 3, "float32"], [1, 8, 40, 6, 3, "bfloat16"]]}
    cases = [c for c in WORKLOADS["knn-sweep"].build(params, torch.device("cpu")) if "faiss" in c.variant]
    assert len(cases) == 1 and cases[0].forward()[1].shape == (1, 8, 3)
