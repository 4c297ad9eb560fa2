"""The benchmark commands' shared output helpers (specserve.bench.report), on hand-checked inputs."""

import math

import pytest

from specserve.bench.report import (
    BENCH_EXTRA,
    format_table,
    import_extra,
    missing_extra,
    percentiles,
    plot_bars,
    plot_lines,
    read_jsonl,
    write_jsonl,
)


def test_percentiles_interpolate_between_order_statistics():
    p = percentiles([4.0, 1.0, 3.0, 2.0, 5.0])  # sorted 1..5
    assert p["mean"] == 3.0 and p["p50"] == 3.0
    assert math.isclose(p["p90"], 4.6) and math.isclose(p["p99"], 4.96)
    assert math.isnan(percentiles([])["p50"])


def test_table_formats_floats_and_missing_cells():
    rows = [{"name": "plain", "tps": 100.0}, {"name": "eagle3", "tps": 215.456, "ratio": 2.15456}]
    table = format_table(rows, [("name", "config", None), ("tps", "tok/s", ".1f"), ("ratio", "speed-up", ".2f")])
    assert table.splitlines() == [
        "| config | tok/s | speed-up |",
        "|---|---:|---:|",
        "| plain | 100.0 | - |",
        "| eagle3 | 215.5 | 2.15 |",
    ]


def test_jsonl_round_trip_and_pngs(tmp_path):
    rows = [{"bs": 1, "tps": 10.5}, {"bs": 2, "tps": 19.0}]
    assert read_jsonl(write_jsonl(rows, str(tmp_path / "sub" / "r.jsonl"))) == rows
    for path in (plot_lines({"a": ([1, 2], [10.5, 19.0])}, str(tmp_path / "l.png"), title="t", xlabel="x",
                            ylabel="y", logx=True),
                 plot_bars(["a", "b"], [1.2, 0.9], str(tmp_path / "b.png"), title="t", ylabel="x", reference=1.0)):
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_missing_bench_extra_names_the_install_command():
    assert missing_extra("json") is None
    line = missing_extra("json", "no_such_module_abc")
    assert line.startswith("no_such_module_abc not installed") and line.endswith(BENCH_EXTRA)
    with pytest.raises(ImportError, match=r"specserve\[bench\]"):
        import_extra("no_such_module_abc")


def test_bench_command_without_the_extra_exits_2_before_running(monkeypatch, capsys):
    import importlib.util

    from specserve.bench import bench_compare

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(bench_compare, "run_bench", lambda args: pytest.fail("ran without the bench extra"))
    assert bench_compare.main(["--model-path", "demo"]) == 2
    assert "matplotlib not installed" in capsys.readouterr().err
