"""Smoke run of the n-gram cache benchmark at tiny sizes: report shape only, no timing thresholds."""

import json

from bench_ngram_cache import SCENARIOS, main


def test_bench_ngram_cache_smoke(tmp_path):
    out = tmp_path / "ngram.json"
    report = main(["--capacity", "3000", "--prompt-len", "128", "--batch", "2", "--steps", "3", "--reps", "1",
                   "--vocab", "500", "--memory-nodes", "2000", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["bytes_per_node"] > 0
    assert [r["match_type"] for r in report["results"]] == ["BFS", "PROB"]
    for r in report["results"]:
        assert r["nodes"] <= 3000 and r["insert_prompt_us"] > 0
        for name in SCENARIOS:
            assert r[name]["insert_step_us"] > 0 and r[name]["match_us"] > 0
            assert 0 <= r[name]["mean_draft_nodes"] <= 11
