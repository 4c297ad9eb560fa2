"""The speculative bench script runs end to end (tiny settings) and reports the greedy ids unchanged."""

from __future__ import annotations

import bench_spec


def test_bench_spec_smoke(tmp_path):
    rows = bench_spec.main(["--reps", "1", "--decode-tokens", "6", "--batches", "2", "--only", "EAGLE,NGRAM",
                            "--threads", "2", "--work-dir", str(tmp_path / "m"), "--out", str(tmp_path / "r.json")])
    assert [r["algorithm"] for r in rows] == ["EAGLE", "NGRAM"]
    assert all(r["greedy_ids_equal"] and r["accept_length"] >= 1.0 and r["verify_ms"] > 0 for r in rows)
    assert (tmp_path / "r.json").exists()
