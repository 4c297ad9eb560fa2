"""`python -m specserve.bench.bench_overlap` end to end on a tiny model: both engines run, outputs are equal and
the overlap engine really overlapped steps."""

from specserve.bench.bench_overlap import main
from specserve.testing.tiny import make_eagle3_head_dir


def test_bench_overlap_smoke(tmp_path, llama_dir, capsys):
    head = make_eagle3_head_dir(str(tmp_path / "eagle3"), llama_dir, kind="random", seed=1)
    rows = main(["--model-path", llama_dir, "--draft-model-path", head, "--batch-size", "1,3", "--reps", "2",
                 "--max-new-tokens", "8", "--stop", "--logprobs", "--num-threads", "1"])
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["equal"] is True
        assert r["overlapped_steps"] > 0
        assert r["serial_tok_s"] > 0 and r["overlap_tok_s"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        wins, reps = map(int, r["wins"].split("/"))
        assert reps == 2 and 0 <= wins <= reps
    assert "overlap / serial" in capsys.readouterr().out
