"""benchmarks/bench_replicas.py end to end on a tiny model: one server, --dp-size 2 and two servers behind
sglang-router each serve the workload, and each gets its row."""

from bench_replicas import main


def test_bench_replicas_runs_every_setup(capsys, model_factory):
    main(["--model", model_factory("llama"), "--num-prompts", "4", "--max-new-tokens", "4", "--concurrency", "2",
          "--rounds", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["one", "dp2", "router"]
    for r in rows:
        assert float(r[1]) > 0  # output tokens/s
    assert float(rows[0][2]) == 1.0  # the baseline against itself
