"""benchmarks/bench_tp.py end to end on a tiny model: the TP=2 run reports its collectives, and its outputs are the
one-process run's."""

import ast

from bench_tp import main


def test_bench_tp_reports_the_collectives(capsys, model_factory):
    path = model_factory("llama")
    common = ["--model", path, "--rounds", "1", "--max-new-tokens", "6", "--batch", "2", "--print-ids"]
    out = {}
    for tp in ("1", "2"):
        main([*common, "--tp-size", tp])
        out[tp] = capsys.readouterr().out.splitlines()
    ids = {tp: ast.literal_eval(lines[-1].removeprefix("ids ")) for tp, lines in out.items()}
    assert ids["1"] == ids["2"] and len(ids["1"]) == 4  # float32 tiny model: the same greedy tokens
    per_forward = out["2"][2]
    reduces = float(per_forward.split(":")[1].split()[0])
    assert reduces >= 2 * 2  # two per layer (2 layers), and the embedding's
    share = float(per_forward.rsplit(" ", 1)[1])
    assert 0 < share < 1
    assert not any(line.startswith("per forward") for line in out["1"])
