"""Smoke run of the soak benchmark (benchmarks/soak.py) for a few seconds on the tiny model: every kind of request
is sent and every check of its summary passes."""

import json

from soak import main


def test_soak_smoke(server_model, tmp_path):
    out = tmp_path / "soak.json"
    report = main(["--duration", "8", "--warmup", "2", "--concurrency", "4", "--max-tokens", "16",
                   "--greedy-tokens", "8", "--no-progress", "--out", str(out),
                   "--model-path", server_model, "--max-total-tokens", "16384", "--num-threads", "1"])
    assert json.loads(out.read_text())["checks"] == report["checks"]
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["passed"]}
    assert not failed, (failed, report["errors"])
    assert report["passed"] and report["server"]["exit_code"] == 0
    totals = report["totals"]
    assert totals["ok"] > 0 and totals["400"] > 0 and totals["error"] == totals["5xx"] == 0
