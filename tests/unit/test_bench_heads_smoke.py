"""benchmarks/bench_heads.py end to end on the demo family: plain decoding and two EAGLE-3 trees in one process, their
ratios and accept lengths printed, outputs equal to plain decoding's (float32), and bad configs named."""

import pytest

from bench_heads import main, parse_configs


def test_parse_configs():
    assert parse_configs("a=demo-eagle3:3,2,4; b=/x/y:z:4,4,6;") == {"a": ("demo-eagle3", (3, 2, 4)),
                                                                     "b": ("/x/y:z", (4, 4, 6))}
    for bad in ("plain=demo-eagle3:3,2,4", "a=3,2,4", "=demo-eagle3:3,2,4", "a=demo-eagle3:3,2", "a=demo-eagle3:x"):
        with pytest.raises(SystemExit, match="--configs"):
            parse_configs(bad)


def test_bench_heads_runs_two_trees_against_plain(capsys):
    main(["--model-path", "demo", "--configs", "small=demo-eagle3:2,2,3;wide=demo-eagle3:3,4,8", "--dtype",
          "float32", "--num-prompts", "2", "--max-new-tokens", "12", "--rounds", "2", "--num-threads", "1",
          "--always-speculate"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert sum(line.startswith("round ") for line in lines) == 2
    rows = {line.split(" ")[0]: line for line in lines[-2:]}
    assert set(rows) == {"small", "wide"}
    for row in rows.values():
        rounds = [float(x) for x in row.split("(rounds ")[1].split(")")[0].split(", ")]
        assert len(rounds) == 2 and all(x > 0 for x in rounds)
        assert float(row.split("accept length ")[1].split(",")[0]) > 1.0  # drafts were accepted
        assert row.endswith("outputs equal to plain 2/2")
