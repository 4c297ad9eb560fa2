"""End-to-end smoke run of the core benchmark at tiny sizes: report shape only, no timing thresholds."""

import json

from bench_core import main

TINY = [
    "--reps", "1", "--threads", "2", "--prompt-len", "8", "--decode-tokens", "8",
    "--batch-size", "3", "--batch-waves", "2", "--batch-prompt-min", "4", "--batch-prompt-max", "12",
    "--batch-new-min", "2", "--batch-new-max", "6", "--batch-models", "tiny",
    "--max-pos", "128", "--large-hidden", "64", "--large-intermediate", "128", "--large-layers", "1",
    "--large-heads", "4", "--large-kv-heads", "2", "--large-vocab", "1024", "--large-dtype", "float32",
    "--bw-gib", "0.01", "--bw-reps", "2",
]
ROW_KEYS = {"name", "model", "kind", "dtype", "workload", "specserve", "transformers", "specserve_tokens_per_s",
            "transformers_tokens_per_s", "ratio", "target", "meets_target", "greedy_ids"}


def test_bench_core_smoke(tmp_path):
    out = tmp_path / "report.json"
    main([*TINY, "--work-dir", str(tmp_path / "models"), "--out", str(out)])
    report = json.loads(out.read_text())
    assert {"machine", "targets", "rows", "memory_bandwidth"} <= report.keys()
    assert report["memory_bandwidth"]["best_bytes_per_s"] > 0
    rows = {r["name"]: r for r in report["rows"]}
    assert set(rows) == {"tiny_decode_b1", "tiny_batch3", "tiny_batch3_stream6", "large_decode_b1"}
    for r in rows.values():
        assert ROW_KEYS <= r.keys()
        assert r["specserve_tokens_per_s"] > 0 and r["transformers_tokens_per_s"] > 0
        assert r["specserve"]["tokens"] == r["transformers"]["tokens"] == r["workload"]["useful_tokens"]
        assert isinstance(r["greedy_ids"]["all_equal"], bool)
    assert rows["tiny_batch3"]["workload"]["batch_size"] == 3
    # the stream: 2 waves of 3 requests, served 3 at a time; its first wave is the one-wave row's
    stream = rows["tiny_batch3_stream6"]
    assert rows["tiny_batch3"]["kind"] == "batch_one_wave" and stream["kind"] == "batch_stream"
    assert stream["workload"]["batch_size"] == 3 and stream["workload"]["requests"] == 6
    assert stream["workload"]["new_tokens"][:3] == rows["tiny_batch3"]["workload"]["new_tokens"]
    assert stream["greedy_ids"]["rows"] == 6 and stream["greedy_ids"]["all_equal"]  # fp32: same ids as transformers
    large = rows["large_decode_b1"]
    assert large["weight_bytes"]["all_params"] > large["weight_bytes"]["non_embedding"] > 0
    assert large["bandwidth_fraction"]["specserve"] > 0


def test_engine_options_reach_specserve(monkeypatch):
    """--torch-compile and --mixed-chunk turn on the engine options of the same name (specserve side only)."""
    import bench_core
    import specserve

    seen = {}
    monkeypatch.setattr(specserve, "Engine", lambda **kw: seen.update(kw))
    wl = bench_core.Workload("w", [[1, 2]], [3], batch_size=1)
    for argv, want in (([], False), (["--torch-compile", "--mixed-chunk"], True)):
        bench_core.specserve_engine("model-dir", "float32", bench_core.parse_args(argv), [wl])
        assert seen["enable_torch_compile"] is want and seen["enable_mixed_chunk"] is want
