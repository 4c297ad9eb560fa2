"""The GPU benchmark script runs end to end on CPU with --shape tiny (how CI checks it), and its flag errors."""

from __future__ import annotations

import json

import pytest
import torch

import bench_gpu
from specserve.bench.report import read_jsonl
from specserve.models.cuda_graph import EMULATE_ENV


def test_bench_gpu_tiny_cpu_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    # five reps after two warm-ups: the fastest 1-token and 11-token runs of a tiny model are a few ms apart, so a
    # noisy neighbour could swap them with fewer (the benchmark then refuses to report a negative decode time)
    argv = ["--shape", "tiny", "--device", "cpu", "--context", "24", "--decode-tokens", "10", "--reps", "5",
            "--warmup", "2", "--verify-sizes", "1,4,16", "--accept-lens", "2,3.5", "--steps", "4",
            "--out-dir", str(out)]
    assert bench_gpu.main(argv) == 0
    rows = read_jsonl(str(out / "bench_gpu.jsonl"))
    by_part: dict[str, list[dict]] = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r)
    assert by_part["setup"][0]["command"] == "python benchmarks/bench_gpu.py " + " ".join(argv)
    (plain,) = by_part["decode"]
    cfg = json.loads((out / "models" / "tiny-target" / "config.json").read_text())
    emb = cfg["vocab_size"] * cfg["hidden_size"] * 2  # bf16 input embedding table, not read by a decode step
    assert plain["weight_bytes_read"] == plain["weight_bytes_all"] - emb
    assert plain["limit_tokens_per_s"] == pytest.approx(4.8e12 / plain["weight_bytes_read"])
    assert plain["tokens_per_s"] > 0 and plain["fraction_of_limit"] == pytest.approx(
        plain["tokens_per_s"] / plain["limit_tokens_per_s"])
    assert [r["num_tokens"] for r in by_part["verify"]] == [1, 4, 16]
    assert all(r["forward_ms"] > 0 and r["relative_to_decode"] > 0 for r in by_part["verify"])
    sim = by_part["simulated"]
    assert [r["simulated_accept_length"] for r in sim] == [2.0, 3.5]
    assert sim[0]["measured_accept_length"] == pytest.approx(2.0)  # 10 tokens in 5 steps of exactly 2
    assert 10 / 4 <= sim[1]["measured_accept_length"] <= 10 / 3  # steps of 3 or 4 tokens: 3 or 4 steps
    assert all(r["tokens_per_s"] > 0 and r["speedup"] > 0 for r in sim)
    assert (out / "verify_cost.png").stat().st_size > 0 and (out / "simulated_throughput.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "python benchmarks/bench_gpu.py --shape tiny" in printed and "| N draft tokens |" in printed


def test_bench_gpu_graph_and_eager_rows(tmp_path, monkeypatch, capsys):
    """With graphs in use (emulated on CPU) part (a) has a second row without them and the ratio of the two."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    out = tmp_path / "out"
    argv = ["--shape", "tiny", "--device", "cpu", "--context", "24", "--decode-tokens", "32", "--reps", "3",
            "--warmup", "1", "--skip", "verify,simulated", "--out-dir", str(out)]
    assert bench_gpu.main(argv) == 0
    graphed, eager = [r for r in read_jsonl(str(out / "bench_gpu.jsonl")) if r["part"] == "decode"]
    assert graphed["mode"] == "plain (CUDA graphs: emulate)" and eager["mode"] == "plain, no CUDA graphs"
    assert graphed["speedup_vs_eager"] == pytest.approx(graphed["tokens_per_s"] / eager["tokens_per_s"])
    assert eager["speedup_vs_eager"] == 1.0
    assert "| vs no graphs |" in capsys.readouterr().out


def test_bench_gpu_torch_compile_rows(tmp_path, monkeypatch):
    """--enable-torch-compile reaches every engine (graphed and eager rows, named so)."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    out = tmp_path / "out"
    # 32 tokens, 3 reps after 2 warm-ups: with 16 tokens and 2 reps a busy neighbour made the fastest 17-token run
    # no slower than the fastest 1-token run (the benchmark then refuses to report), in about one CI run of 30
    argv = ["--shape", "tiny", "--device", "cpu", "--context", "24", "--decode-tokens", "32", "--reps", "3",
            "--warmup", "2", "--skip", "verify,simulated", "--enable-torch-compile", "--out-dir", str(out)]
    assert bench_gpu.engine_kwargs(bench_gpu.parse_args(argv), "t")["enable_torch_compile"] is True
    assert bench_gpu.main(argv) == 0
    modes = [r["mode"] for r in read_jsonl(str(out / "bench_gpu.jsonl")) if r["part"] == "decode"]
    assert modes == ["plain (CUDA graphs: emulate, torch.compile)", "plain, no CUDA graphs, torch.compile"]


class _ScriptedEngine:
    """generate() returns at once; the benchmark's clock reads scripted durations instead (short, long, short, ...)."""

    def generate(self, input_ids, sampling_params):
        return {"meta_info": {}}


def _scripted_clock(monkeypatch, durations: list[float]) -> list[float]:
    left = list(durations)
    monkeypatch.setattr(bench_gpu, "timed", lambda fn, device: (fn(), left.pop(0))[1])
    return left


def test_decode_measure_takes_more_reps_when_noise_inverts_the_fastest_runs(monkeypatch):
    # three reps whose short runs were all slowed (15.6 ms against 13.5 ms long runs), then three undisturbed ones
    slowed, calm = [0.0156, 0.0135] * 3, [0.0020, 0.0134] * 3
    left = _scripted_clock(monkeypatch, slowed + calm)
    ns = bench_gpu.parse_args(["--shape", "tiny", "--device", "cpu", "--decode-tokens", "32", "--reps", "3",
                               "--warmup", "0"])
    row = bench_gpu.measure_decode(_ScriptedEngine(), [1, 2], ns, torch.device("cpu"), "plain")
    assert left == [] and len(row["times_s"]["one_token"]) == 6
    assert row["step_ms"] == pytest.approx((0.0134 - 0.0020) / 32 * 1e3)


def test_decode_measure_refuses_after_four_times_the_reps(monkeypatch):
    left = _scripted_clock(monkeypatch, [0.0156, 0.0135] * 12 + [0.001, 0.1])
    ns = bench_gpu.parse_args(["--shape", "tiny", "--device", "cpu", "--reps", "3", "--warmup", "0"])
    with pytest.raises(RuntimeError, match="over 12 reps"):
        bench_gpu.measure_decode(_ScriptedEngine(), [1, 2], ns, torch.device("cpu"), "plain")
    assert left == [0.001, 0.1]


@pytest.mark.parametrize("argv,flag", [(["--verify-sizes", "1,x"], "--verify-sizes"), (["--reps", "0"], "--reps"),
                                       (["--accept-lens", "0.5"], "--accept-lens"), (["--skip", "nope"], "--skip"),
                                       (["--shape", "70b"], "--shape")])
def test_bad_flag_exits_2_naming_it(argv, flag, capsys):
    assert bench_gpu.main(argv) == 2
    assert flag in capsys.readouterr().err


def test_cuda_asked_without_cuda_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_gpu.main(["--device", "cuda", "--out-dir", str(tmp_path / "o")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_decode_time_not_measurable_is_an_error():
    """When the runs with decode tokens are no slower than the one-token run, the difference means nothing:
    measure_decode says so instead of reporting a negative or infinite tokens/s."""
    import time
    from types import SimpleNamespace

    class SlowShortRuns:
        def generate(self, input_ids, sampling_params):
            if sampling_params["max_new_tokens"] == 1:
                time.sleep(0.02)
            return {"meta_info": {}}

    ns = SimpleNamespace(decode_tokens=4, warmup=0, reps=2)
    with pytest.raises(RuntimeError, match="--decode-tokens"):
        bench_gpu.measure_decode(SlowShortRuns(), [1, 2], ns, torch.device("cpu"), "plain")
