"""`python benchmarks/bench_overlap.py` end to end on a tiny model: both engines run, outputs are equal and
the overlap engine really overlapped steps."""

import os

import pytest

from bench_overlap import main
from specserve.speculative.simulate import simulated_acc_len
from specserve.test.tiny import make_eagle3_head_dir


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


def test_bench_overlap_random_head_and_simulated_acceptance(llama_dir, monkeypatch):
    monkeypatch.delenv("SPECSERVE_SIMULATE_ACC_LEN", raising=False)
    monkeypatch.delenv("SGLANG_SIMULATE_ACC_LEN", raising=False)
    rows = main(["--model-path", llama_dir, "--draft-model-path", "random", "--simulate-acc-len", "3",
                 "--batch-size", "2", "--reps", "1", "--max-new-tokens", "12", "--num-threads", "1"])
    # simulated acceptance: both engines draw the same accept lengths (seeded), so outputs stay equal; 12 tokens
    # at ~3 a step take far fewer steps than tokens
    assert rows[0]["equal"] is True and 0 < rows[0]["overlapped_steps"] < 12
    assert "SPECSERVE_SIMULATE_ACC_LEN" not in os.environ  # set only while the engines were built


def test_simulated_acc_len_restores_the_variable(monkeypatch):
    monkeypatch.setenv("SPECSERVE_SIMULATE_ACC_LEN", "2")
    with simulated_acc_len(3.5):
        assert os.environ["SPECSERVE_SIMULATE_ACC_LEN"] == "3.5"
    assert os.environ["SPECSERVE_SIMULATE_ACC_LEN"] == "2"
    with simulated_acc_len(None):
        assert os.environ["SPECSERVE_SIMULATE_ACC_LEN"] == "2"


def test_bench_overlap_rejects_an_impossible_simulated_length(capsys):
    with pytest.raises(SystemExit):
        main(["--simulate-acc-len", "9", "--steps", "3"])
    assert "--simulate-acc-len must be in [1, --steps + 1 = 4], got 9" in capsys.readouterr().err
