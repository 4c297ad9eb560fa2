"""benchmarks/bench_structured.py end to end on two of its prompts: every configuration runs and prints its row."""

from bench_structured import main


def test_bench_structured_runs_every_configuration(capsys):
    main(["--backends", "llguidance", "--num-prompts", "2", "--batch", "2", "--rounds", "1",
          "--max-new-tokens", "12", "--num-threads", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [(b, a) for b in ("1", "2")
                                            for a in ("plain", "eagle3", "eagle3-nojf", "eagle3-blind")]
    for r in rows:
        assert float(r[4]) > 0  # constrained tok/s
        assert (r[3] == "-") == (r[1] in ("eagle3-nojf", "eagle3-blind"))  # free baselines: plain and eagle3
        assert (r[8] == "-") == (r[1] == "plain")  # accept lengths: EAGLE-3's rows
