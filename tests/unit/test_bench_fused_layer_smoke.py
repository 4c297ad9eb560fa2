"""benchmarks/bench_fused_layer.py end to end on the demo family, where the operator runs: the per-call rows, then plain
and EAGLE-3 engines with their layers fused and not, alternating, with the ratio of every round."""

import pytest

from bench_fused_layer import main
from specserve.platform.cpu import fused_layer
from tests.model.test_fused_layer import kernel_linears, needs_op


@needs_op
def test_bench_fused_layer_compares_fused_and_module_layers(capsys, monkeypatch):
    kernel_linears(monkeypatch)
    main(["--model-path", "demo", "--speculative", "--rounds", "2", "--num-prompts", "1", "--max-new-tokens", "8",
          "--calls", "2", "--num-threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["decode", "verify", "16"]
    for line in lines[1:4]:
        assert all(float(v) > 0 for v in line.split()[-3:])  # us a call each way, and their ratio
    plain, spec = lines[5], lines[7]
    assert lines[4].startswith("demo, plain") and lines[6].startswith("demo, EAGLE-3")
    assert "13 fused layers" in lines[6]  # the demo's 12 and the head's
    for line in (plain, spec):
        rounds = line.split("rounds: ")[1].split(")")[0].split(", ")
        assert len(rounds) == 2 and all(float(r) > 0 for r in rounds)
    assert "accept length fused" in spec and "modules" in spec.split("accept length")[1]


def test_bench_fused_layer_stops_where_the_operator_is_missing(monkeypatch):
    monkeypatch.setattr(fused_layer, "available", lambda: False)
    with pytest.raises(SystemExit, match="fused layer"):
        main([])
