"""benchmarks/bench_avx2.py end to end on the demo family, on a CPU whose oneDNN packs no bf16 weight (simulated):
every setting of every algorithm runs and prints its row, the ratio over PyTorch's kernel and which kernels ran."""

import pytest

from bench_avx2 import main
from specserve.platform.cpu import avx2_gemm, packing


def test_bench_avx2_compares_the_kernels(capsys, monkeypatch):
    monkeypatch.setattr(packing, "_pack", lambda *a, **k: None)
    main(["--num-prompts", "2", "--max-new-tokens", "6", "--rounds", "1", "--num-threads", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:8]]
    assert [(r[0], r[1]) for r in rows] == [(algo, s) for algo in ("plain", "eagle3")
                                          for s in ("pytorch", "avx2", "upcast")]
    for r in rows:
        assert float(r[2]) > 0  # tok/s
        assert (r[3] == "-") == (r[0] == "plain")  # accept length: EAGLE-3's rows
        assert (r[4] == "-") == (r[1] == "pytorch")  # the ratio: on the other settings' rows
    infos = dict(line.split(": ", 1) for line in lines[8:])
    assert sorted(infos) == ["eagle3 avx2", "eagle3 upcast", "plain avx2", "plain upcast"]
    assert "LlamaForCausalLM copies from" in infos["plain upcast"]  # the probe ran on the target
    assert infos["plain upcast"].startswith("0 on the AVX2 kernel")
    on_kernel = int(infos["plain avx2"].split()[0])
    assert (on_kernel > 0) == (avx2_gemm.kernel() is not None)  # every linear of the kernel's shapes, where it runs


def test_bench_avx2_names_a_bad_setting():
    with pytest.raises(SystemExit):
        main(["--settings", "avx2,pytorch"])
