"""Smoke run of the draft bookkeeping benchmark at tiny sizes: report shape only, no timing thresholds."""

from bench_draft_bookkeeping import main


def test_bench_draft_bookkeeping_smoke():
    rows = main(["--batches", "1,2", "--trees", "3,2,4;2,1,3", "--rounds", "1", "--calls", "3"])
    assert [(r["batch"], r["tree"]) for r in rows] == [(1, (3, 2, 4)), (1, (2, 1, 3)), (2, (3, 2, 4)),
                                                        (2, (2, 1, 3))]
    assert all(len(r["rounds"]) == 1 and min(r["rounds"][0]) > 0 and r["ratio"] > 0 for r in rows)
