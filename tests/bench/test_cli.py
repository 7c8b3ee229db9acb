"""`fullgraph bench` end to end at the tiny size: every variant timed, JSON, plot, report."""

from __future__ import annotations

import json

import pytest

from fullgraph.cli import main


@pytest.mark.slow
def test_bench_writes_rows_table_and_plot(tmp_path, capsys):
    out_json, out_png = tmp_path / "rows.json", tmp_path / "plot.png"
    code = main(["bench", "radius-projector", "--size", "tiny", "--device", "cpu", "--warmup", "1", "--runs", "3",
                 "--json", str(out_json), "--plot", str(out_png)])
    assert code == 0
    rows = json.loads(out_json.read_text())
    variants = {r["variant"] for r in rows}
    assert variants == {"document eager", "document compiled", "fullgraph eager", "fullgraph compiled"}
    assert {r["phase"] for r in rows} == {"forward", "train"}
    for row in rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["p10_ms"] <= row["median_ms"] <= row["p90_ms"]
        assert row["first_call_s"] > 0 and row["speedup_vs_eager"] > 0
        assert row["device"] and row["torch"] and row["params"] == {"grid": 5, "cloud": 500, "radius": 0.5}
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    printed = capsys.readouterr().out
    assert "fullgraph compiled" in printed and "x eager" in printed
    assert main(["report", str(out_json)]) == 0
    assert "| fullgraph eager | forward |" in capsys.readouterr().out


def test_bad_arguments():
    with pytest.raises(SystemExit):
        main(["bench", "no-such-workload"])
    with pytest.raises(SystemExit, match="--runs"):
        main(["bench", "knn-projector", "--device", "cpu", "--runs", "0"])
    with pytest.raises(SystemExit, match="extern-pool: .* run it with --device cuda"):
        main(["bench", "extern-pool", "--device", "cpu"])


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
