"""bench-serving: pure helpers on hand-checked inputs, then end to end against a real server on a tiny model."""

import math
import os
import subprocess
import sys

import pytest

import specserve
from specserve.bench.bench_serving import (
    Prompt,
    RequestRecord,
    accept_length_between,
    arrival_times,
    chunk_timing,
    for_api,
    main,
    read_dataset_file,
    summarize,
)
from specserve.bench.report import read_jsonl
from specserve.utils import free_port, terminate_process, wait_for_server

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(specserve.__file__)))


# ---------------------------------------------------------------------------------------------- pure helpers
def test_chunk_timing_hand_checked():
    # sent at 10.0 s; chunks with text at 10.1, 10.3, 10.4; stream over at 10.5; 5 tokens in all
    t = chunk_timing(10.0, [10.1, 10.3, 10.4], 10.5, output_tokens=5)
    assert t["ttft_ms"] == pytest.approx(100) and t["e2e_ms"] == pytest.approx(500)
    assert t["itl_ms"] == pytest.approx([200, 100])
    assert t["tpot_ms"] == pytest.approx((500 - 100) / 4)
    one = chunk_timing(0.0, [0.2], 0.3, output_tokens=1)
    assert one["tpot_ms"] is None and one["itl_ms"] == []
    assert chunk_timing(0.0, [], 0.3, output_tokens=0)["ttft_ms"] is None


def test_arrival_times():
    assert arrival_times(3, math.inf, 0) == [0.0, 0.0, 0.0]
    a = arrival_times(2000, 4.0, seed=1)
    assert a == arrival_times(2000, 4.0, seed=1) and a != arrival_times(2000, 4.0, seed=2)
    assert all(x < y for x, y in zip(a, a[1:], strict=False)) and a[0] > 0
    assert a[-1] / len(a) == pytest.approx(0.25, rel=0.1)  # mean gap 1/rate


def test_accept_length_between():
    # 10 verify steps at 2.0 before, 30 at 2.5 after: the 20 new steps made 75 - 20 = 55 tokens
    assert accept_length_between({"avg_spec_accept_length": 2.0, "spec_verify_ct": 10},
                                 {"avg_spec_accept_length": 2.5, "spec_verify_ct": 30}) == pytest.approx(2.75)
    assert accept_length_between({}, {"avg_spec_accept_length": 1.5}) == 1.5  # only the cumulative figure
    assert accept_length_between({}, {"generated_tokens": 5}) is None  # no speculation reported


def test_summarize_hand_checked():
    recs = [RequestRecord(0, ok=True, prompt_tokens=4, output_tokens=6, chunks=3, ttft_ms=100, e2e_ms=600,
                          tpot_ms=100, itl_ms=[200, 300]),
            RequestRecord(1, ok=True, prompt_tokens=2, output_tokens=2, chunks=1, ttft_ms=300, e2e_ms=400,
                          tpot_ms=100, itl_ms=[]),
            RequestRecord(2, error="boom", e2e_ms=5)]
    s = summarize(recs, duration_s=2.0)
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (2, 1, 8, 6)
    assert s["output_throughput"] == 4.0 and s["total_token_throughput"] == 7.0 and s["request_throughput"] == 1.0
    assert s["tokens_per_chunk"] == 2.0
    assert s["mean_ttft_ms"] == 200 and s["p50_itl_ms"] == 250 and s["mean_e2e_ms"] == 500  # failed one left out
    assert summarize([RequestRecord(0, error="x")], 1.0)["p50_ttft_ms"] is None


def test_dataset_file_and_api(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"prompt": "a b"}\n\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    ps = read_dataset_file(str(f))
    assert ps == [Prompt(text="a b"), Prompt(messages=[{"role": "user", "content": "hi"}])]
    assert for_api(ps, "chat")[0] == Prompt(messages=[{"role": "user", "content": "a b"}])
    with pytest.raises(ValueError, match="--api chat"):
        for_api(ps, "completions")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": 3}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_dataset_file(str(bad))


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def server_url(llama_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("bench-serving") / "server.log", "w")  # noqa: SIM115
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "specserve.launch_server", "--model-path", llama_dir, "--port",
                             str(port), "--num-threads", "1", "--max-total-tokens", "2048"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, timeout=300, process=proc)
        yield url
    finally:
        terminate_process(proc)


def _generated(url: str) -> int:
    import requests

    return requests.get(url + "/get_server_info", timeout=60).json()["generated_tokens"]


COMMON = ["--dataset", "random", "--random-input-len", "40", "--max-new-tokens", "8", "--ignore-eos",
          "--disable-tqdm"]


def test_bench_serving_end_to_end(server_url, tmp_path, capsys):
    out = tmp_path / "out"
    gen0 = _generated(server_url)
    assert main(["--base-url", server_url, *COMMON, "--num-prompts", "6", "--max-concurrency", "1,3",
                 "--warmup-requests", "1", "--out-dir", str(out)]) == 0
    gen1 = _generated(server_url)
    rows = read_jsonl(str(out / "summary.jsonl"))
    assert [r["max_concurrency"] for r in rows] == [1, 3] and all(r["request_rate"] == "inf" for r in rows)
    assert all(r["completed"] == 6 and r["failed"] == 0 and r["total_output_tokens"] == 48 for r in rows)
    assert all(r["output_throughput"] > 0 and r["p50_tpot_ms"] > 0 and r["accept_length"] is None for r in rows)
    recs = read_jsonl(str(out / "requests.jsonl"))
    assert len(recs) == 12 and sorted(r["index"] for r in recs if r["run"] == 1) == list(range(6))
    for r in recs:
        assert r["ok"] and r["tokens_counted"] == "usage" and r["output_tokens"] == 8
        assert 0 < r["ttft_ms"] <= r["e2e_ms"] and len(r["itl_ms"]) == r["chunks"] - 1
    # the client's token counts add up to what the server says it generated (warm-up: 1 x 8 tokens)
    assert gen1 - gen0 == sum(r["output_tokens"] for r in recs) + 8
    assert (out / "throughput.png").stat().st_size > 0 and (out / "latency.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "| concurrency |" in printed and str(out / "summary.jsonl") in printed


def test_bench_serving_chat_and_failures(server_url, tmp_path):
    assert main(["--base-url", server_url + "/v1", *COMMON, "--api", "chat", "--num-prompts", "2",
                 "--max-concurrency", "2", "--request-rate", "50", "--warmup-requests", "0",
                 "--out-dir", str(tmp_path / "chat")]) == 0
    (row,) = read_jsonl(str(tmp_path / "chat" / "summary.jsonl"))
    assert row["completed"] == 2 and row["total_output_tokens"] == 16 and row["request_rate"] == 50.0
    # requests the server refuses (more new tokens than the context holds): every one fails (400), counted, the
    # run still completes
    assert main(["--base-url", server_url, *COMMON, "--max-new-tokens", "100000", "--num-prompts", "2",
                 "--max-concurrency", "1", "--warmup-requests", "0", "--out-dir", str(tmp_path / "bad")]) == 0
    (row,) = read_jsonl(str(tmp_path / "bad" / "summary.jsonl"))
    assert row["completed"] == 0 and row["failed"] == 2 and row["p50_ttft_ms"] is None
    recs = read_jsonl(str(tmp_path / "bad" / "requests.jsonl"))
    assert all("max_completion_tokens is too large" in r["error"] for r in recs)


@pytest.mark.parametrize("flag,value", [("--max-concurrency", "0,2"), ("--request-rate", "-1"),
                                        ("--api", "grpc"), ("--num-prompts", "x")])
def test_bad_flag_exits_2(flag, value, capsys):
    assert main([flag, value]) == 2
    assert flag in capsys.readouterr().err


def test_no_server_exits_1(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--base-url", url, "--dataset", "random", "--num-prompts", "1", "--out-dir", "unused"]) == 1
    assert "--base-url" in capsys.readouterr().err
