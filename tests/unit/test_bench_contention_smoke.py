"""The contention benchmark's logic without engines: condition parsing, neighbour processes, the summary's ratios."""

from __future__ import annotations

import pytest

from bench_contention import Condition, neighbours, parse_args, parse_condition, render, summarize


def test_parse_condition():
    assert parse_condition("quiet") == Condition(None) and parse_condition("quiet").label == "quiet"
    assert parse_condition("python") == Condition("python", 1)
    assert parse_condition("torch-mt:2").label == "2 x torch-mt"
    for bad in ("perl", "python:0", "python:x"):
        with pytest.raises(ValueError):
            parse_condition(bad)


def test_bad_condition_exits_2():
    with pytest.raises(SystemExit) as exc:
        parse_args(["--conditions", "quiet,ruby"])
    assert exc.value.code == 2


def test_neighbours_run_for_the_body_only():
    with neighbours(Condition("python", 2), settle_s=0.0) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.poll() is not None for p in procs)
    with neighbours(Condition(None), settle_s=0.0) as procs:
        assert procs == []


def _sample(index, cond, rep, engine, tok_s, ids=((1, 2),), **extra):
    return {"index": index, "condition": cond, "rep": rep, "engine": engine, "tokens": tok_s, "seconds": 1.0,
            "ids": [list(i) for i in ids], "load": 0.5, **extra}


def test_summary_ratios():
    ours = {"cpu_threads": 2, "cpu_thread_switches": 0}
    samples = [
        _sample(0, "quiet", -1, "specserve", 150, **ours),  # warm-up: shown as the first run, not counted
        _sample(0, "quiet", -1, "transformers", 90),
        _sample(0, "quiet", 0, "specserve", 160, **ours), _sample(0, "quiet", 0, "transformers", 100),
        _sample(0, "quiet", 1, "transformers", 80), _sample(0, "quiet", 1, "specserve", 200, **ours),
        _sample(1, "1 x python", -1, "specserve", 60, **ours),
        _sample(1, "1 x python", 0, "specserve", 150, cpu_threads=1, cpu_thread_switches=1),
        _sample(1, "1 x python", 0, "transformers", 30),
        _sample(1, "1 x python", 1, "specserve", 170, ids=((1, 3),), cpu_threads=1, cpu_thread_switches=1),
        _sample(1, "1 x python", 1, "transformers", 50),
    ]
    quiet, busy = summarize(samples)
    assert quiet["specserve"] == {"median": 180, "min": 160, "max": 200}
    assert quiet["ours_over_baseline"]["median"] == pytest.approx((1.6 + 2.5) / 2)
    assert quiet["busy_over_quiet"] == {"specserve": 1.0, "transformers": 1.0} and quiet["ids_equal_quiet"]
    assert busy["specserve_first_run"] == 60 and busy["cpu_threads"] == 1 and busy["cpu_thread_switches"] == 1
    assert busy["busy_over_quiet"]["specserve"] == pytest.approx(160 / 180)
    assert busy["busy_over_quiet"]["transformers"] == pytest.approx(40 / 90)
    assert busy["ours_over_baseline"] == {"median": pytest.approx(4.2), "min": pytest.approx(3.4), "max": 5.0}
    assert busy["ids_equal_quiet"] is False  # rep 1 decoded other ids
    table = render([quiet, busy])
    assert "1 x python" in table and "0.89" in table and "NO" in table
