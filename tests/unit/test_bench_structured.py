"""benchmarks/bench_structured.py end to end on two of its prompts: every configuration runs and prints its row."""

from bench_structured import main


def test_bench_structured_runs_every_configuration(capsys):
    algos = ("plain", "plain-masked", "plain-nojf", "eagle3", "eagle3-nojf", "eagle3-blind")
    main(["--backends", "llguidance", "--num-prompts", "2", "--batch", "2", "--rounds", "1",
          "--max-new-tokens", "12", "--num-threads", "1", "--algos", ",".join(algos)])
    lines = capsys.readouterr().out.splitlines()[2:]
    rows = [line.split() for line in lines if not line.startswith(("plain", "eagle3"))]
    assert [(r[0], r[1]) for r in rows] == [(b, a) for b in ("1", "2") for a in algos]
    for r in rows:
        assert float(r[4]) > 0  # constrained tok/s
        assert (r[3] == "-") == r[1].startswith("eagle3-")  # free baselines: plain's (for its variants too), eagle3's
        assert r[7].endswith("%") and 0 <= float(r[7][:-1]) < 100  # the grammar's share of the constrained run
        assert (r[9] == "-") == r[1].startswith("plain")  # accept lengths: EAGLE-3's rows
    checks = [line for line in lines if line.startswith(("plain", "eagle3"))]
    assert checks and checks[0].startswith("plain llguidance: ")  # check-first counts, plain's first
    assert not any(line.startswith("plain-masked") for line in checks)  # nothing drawn check-first there
