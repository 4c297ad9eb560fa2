"""benchmarks/bench_compile.py end to end on a tiny model: eager against compiled, and with --background the
compiled engine's graphs built while it serves before anything is timed."""

from __future__ import annotations

import bench_compile


def test_background_graphs_are_built_before_the_timed_rounds(llama_dir, fresh_dynamo, capsys):
    rows = bench_compile.main(["--model-path", llama_dir, "--configs", "plain", "--num-prompts", "2",
                               "--max-new-tokens", "4", "--num-threads", "1", "--background"])
    row = rows[0]
    assert row["equal"] == "2/2"  # float32: the compiled outputs equal the eager ones
    assert row["compile_graphs"] > 0 and row["building_tok_s"] > 0
    assert 0 < row["ready_s"] <= row["built_s"]
    assert "tok/s while building" in capsys.readouterr().out
