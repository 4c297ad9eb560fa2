"""benchmarks/bench_tp.py end to end on a tiny model: both engines run, their outputs agree, and the TP=2 row
reports its collectives."""

from bench_tp import main


def test_bench_tp_reports_the_collectives(capsys, model_factory):
    main(["--model", model_factory("llama"), "--rounds", "1", "--max-new-tokens", "6", "--batch", "2"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "plain"), ("2", "plain")]
    tp2 = rows[1]
    assert tp2[4] == "True"  # the same greedy tokens as one process (float32 tiny model)
    assert float(tp2[6]) >= 2 * 2  # all-reduces per forward: two per layer (2 layers) and the embedding's
    assert 0 < float(tp2[10]) < 1  # the collectives' share of the wall time
