"""benchmarks/bench_upcast.py end to end on the demo family, on a CPU whose oneDNN packs no bf16 weight (simulated):
both settings of every algorithm run and print their row, the ratio and the probe's verdict."""

from bench_upcast import main
from specserve.platform.cpu import packing


def test_bench_upcast_compares_with_and_without_copies(capsys, monkeypatch):
    monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    main(["--num-prompts", "2", "--max-new-tokens", "6", "--rounds", "1", "--num-threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1]) for r in rows] == [("plain", "off"), ("plain", "auto"), ("eagle3", "off"), ("eagle3", "auto")]
    for r in rows:
        assert float(r[2]) > 0  # tok/s
        assert (r[3] == "-") == (r[0] == "plain")  # accept length: EAGLE-3's rows
        assert (r[4] == "-") == (r[1] == "off")  # the ratio: on the rows with copies
    verdicts = lines[6:]
    assert [v.split(":")[0] for v in verdicts] == ["plain", "eagle3"]
    assert all("LlamaForCausalLM from" in v for v in verdicts)  # the probe ran on the target
