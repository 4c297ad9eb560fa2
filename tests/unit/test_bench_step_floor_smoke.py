"""benchmarks/bench_step_floor.py end to end on the demo family: plain decoding and two EAGLE-3 trees in one process,
each tree's step split into its verify forward, drafting and the rest, the operators' share timed where specserve's
CPU operators run, outputs equal to plain decoding's (sampled, seeded alike), and bad trees named."""

import pytest
from torch._ops import OpOverload

from bench_step_floor import main, parse_trees
from specserve.platform.cpu import native


def test_parse_trees():
    assert parse_trees("3,2,4; 8,3,12;") == [(3, 2, 4), (8, 3, 12)]
    for bad in ("3,2", "a,b,c", ";"):
        with pytest.raises(SystemExit, match="--trees"):
            parse_trees(bad)


def table_rows(out: str) -> dict[str, list[str]]:
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ") and "tree" not in line]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def test_bench_step_floor_times_two_trees_against_plain(capsys):
    op_call = OpOverload.__call__
    main(["--model-path", "demo", "--trees", "2,2,3;3,4,6", "--dtype", "bfloat16", "--num-prompts", "2",
          "--max-new-tokens", "16", "--rounds", "2", "--num-threads", "1", "--temperature", "0.7"])
    out = capsys.readouterr().out
    assert OpOverload.__call__ is op_call  # the operators' timing is taken off again
    assert sum(line.startswith("round ") for line in out.splitlines()) == 2
    rows = table_rows(out)
    assert set(rows) == {"2,2,3", "3,4,6"}
    timed_ops = native.native_ops()
    for accept, step, verify, draft, rest, over, ceiling, equal in rows.values():
        assert float(accept) > 1.0  # drafts were accepted
        step_ms, step_ops = float(step.split(" ")[0]), float(step.split("(")[1].split(",")[0])
        (verify_ms, verify_ops), (draft_ms, draft_ops), (rest_ms, rest_ops) = (
            (float(c.split(" ")[0]), float(c.split("(")[1].rstrip(")"))) for c in (verify, draft, rest))
        assert step_ms > verify_ms > 0 and draft_ms > 0 and rest_ms > 0
        assert verify_ms + draft_ms + rest_ms == pytest.approx(step_ms, abs=0.02)
        assert step_ops == pytest.approx(verify_ops + draft_ops + rest_ops, abs=0.02)
        assert float(over.split(" ")[0]) > 0 and len(over.split("(")[1].split(",")) == 2
        assert equal == "2/2"  # seeded alike: the same tokens as plain decoding
        if timed_ops:  # the verify forward's decoder layers are specserve's operators in bf16 on such a build
            assert 0 < verify_ops < verify_ms and 0 < step_ops < step_ms
            assert float(ceiling.split(" ")[0]) > float(over.split(" ")[0])
        else:
            assert ceiling == "-" and step_ops == 0
