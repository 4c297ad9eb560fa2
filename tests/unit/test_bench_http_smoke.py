"""Smoke run of the HTTP benchmark at tiny sizes (starts one server): report shape only, no timing thresholds."""

import json

from bench_http import main


def test_bench_http_smoke(tmp_path):
    out = tmp_path / "report.json"
    main(["--model", "tiny", "--threads", "1", "--batch-size", "3", "--prompt-min", "4", "--prompt-max", "9",
          "--new-tokens", "5", "--rounds", "1", "--single-requests", "2", "--work-dir", str(tmp_path / "models"),
          "--out", str(out)])
    report = json.loads(out.read_text())
    t = report["throughput"]
    assert t["engine_tokens_per_s"] > 0 and t["http_tokens_per_s"] > 0 and len(t["ratios"]) == 1
    assert report["workload"]["useful_tokens"] == 15
    single, batch = report["latency"]["1 stream"], report["latency"]["3 streams"]
    assert single["ttft"]["n"] == 2 and batch["ttft"]["n"] == 3
    assert batch["itl"]["n"] == 3 * 4  # every token after the first of each stream
    assert 0 < batch["ttft"]["p50_ms"] <= batch["ttft"]["p99_ms"]
