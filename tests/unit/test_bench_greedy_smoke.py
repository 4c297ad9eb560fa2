"""Smoke run of the greedy-pick benchmark at tiny sizes: report shape only, no timing thresholds."""

from bench_greedy import main


def test_bench_greedy_smoke():
    rows = main(["--vocabs", "64", "--batches", "1,3", "--dtypes", "float32,bfloat16", "--work", "2000"])
    assert [(r["vocab"], r["dtype"]) for r in rows] == [(64, "float32"), (64, "bfloat16")]
    for r in rows:
        assert [c["batch"] for c in r["batches"]] == [1, 3]
        assert all(c[k] > 0 for c in r["batches"] for k in ("argmax", "max", "greedy_ids"))
