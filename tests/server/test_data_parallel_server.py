"""`specserve serve --dp-size 2` over HTTP: requests spread over both replicas, each pinned to its own CPUs, with
one process's greedy answers; the state reports both; a replica that dies stops the server (exit code 1)."""

from __future__ import annotations

import os
import signal

import pytest

from specserve import Engine
from specserve.utils import terminate_process
from tests.server.conftest import start_server
from tests.server.test_tensor_parallel_server import rank_processes

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(", "x = [", "# sort a list\n"]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="module")
def dp2(model, tmp_path_factory):
    s = start_server(model, str(tmp_path_factory.mktemp("dp-server") / "dp2.log"), "--dtype", "float32",
                     "--dp-size", "2", "--enable-metrics")
    yield s
    terminate_process(s.proc)


def cpus_allowed(pid: int) -> set[int]:
    with open(f"/proc/{pid}/status") as f:
        line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
    out = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_dp2_spreads_requests_over_both_replicas_with_one_process_answers(dp2, model):
    import openai

    client = openai.OpenAI(base_url=dp2.url + "/v1", api_key="None", max_retries=0)
    answers = [client.completions.create(model="any", prompt=p, max_tokens=10, temperature=0).choices[0].text
               for p in PROMPTS]
    with Engine(model_path=model, dtype="float32", num_threads=1) as engine:
        expected = [o["text"] for o in engine.generate(PROMPTS, [{"max_new_tokens": 10, "temperature": 0}] * 6)]
    assert answers == expected
    info = dp2.info()
    replicas = info["internal_states"]
    assert info["dp_size"] == 2 and [r["dp_rank"] for r in replicas] == [0, 1]
    # round robin: three requests each; the server's counts are the replicas' sums
    assert [r["generated_tokens"] for r in replicas] == [30, 30] and info["generated_tokens"] == 60
    assert info["max_running_requests"] == sum(r["max_running_requests"] for r in replicas)
    pids = [r["worker_pid"] for r in replicas]
    assert pids[0] != pids[1]
    if len(os.sched_getaffinity(0)) >= 2:  # each replica on its own share of the CPUs
        shares = [cpus_allowed(p) for p in pids]
        assert shares[0] and shares[1] and not shares[0] & shares[1]


def test_dp2_parallel_samples_of_one_request_stay_on_one_replica(dp2):
    import openai

    client = openai.OpenAI(base_url=dp2.url + "/v1", api_key="None", max_retries=0)
    before = [r["generated_tokens"] for r in dp2.info()["internal_states"]]
    done = client.completions.create(model="any", prompt=PROMPTS[0], max_tokens=5, temperature=0.8, n=3, seed=1)
    assert len(done.choices) == 3
    after = [r["generated_tokens"] for r in dp2.info()["internal_states"]]
    assert sorted(a - b for a, b in zip(after, before, strict=True)) == [0, 15]


def test_dp2_a_seeded_request_draws_the_same_tokens_on_either_replica(dp2):
    import openai

    client = openai.OpenAI(base_url=dp2.url + "/v1", api_key="None", max_retries=0)
    before = [r["generated_tokens"] for r in dp2.info()["internal_states"]]
    texts = [client.completions.create(model="any", prompt=PROMPTS[1], max_tokens=8, temperature=1.0,
                                       seed=7).choices[0].text for _ in range(2)]
    after = [r["generated_tokens"] for r in dp2.info()["internal_states"]]
    assert [a - b for a, b in zip(after, before, strict=True)] == [8, 8]  # one on each replica (round robin)
    assert texts[0] == texts[1]


def test_dp2_metrics_export_the_replicas_merged(dp2):
    import requests

    replicas = dp2.info()["internal_states"]
    body = requests.get(dp2.url + "/metrics", timeout=60).text
    gauges = {line.split()[0]: float(line.split()[1]) for line in body.splitlines() if line.startswith("specserve:")}
    assert gauges["specserve:generated_tokens"] == sum(r["generated_tokens"] for r in replicas)
    assert gauges["specserve:dp_size"] == 2


def test_dp2_flush_cache_reaches_every_replica(dp2):
    import requests

    assert requests.post(dp2.url + "/flush_cache", timeout=60).status_code == 200
    assert [r["radix_cached_tokens"] for r in dp2.info()["internal_states"]] == [0, 0]


def test_a_dead_replica_stops_the_server_with_a_clear_message(model, tmp_path_factory):
    s = start_server(model, str(tmp_path_factory.mktemp("dp-kill") / "dp2.log"), "--dp-size", "2",
                     "--load-balance-method", "shortest_queue")
    try:
        replicas = s.info()["internal_states"]
        os.kill(replicas[1]["worker_pid"], signal.SIGKILL)
        assert s.proc.wait(timeout=60) == 1
        assert "replica 1 of 2" in s.log() and "exited unexpectedly" in s.log()
    finally:
        terminate_process(s.proc)


def test_dp2_with_tp2_splits_each_replica_over_its_ranks(model, tmp_path_factory):
    """--dp-size 2 --tp 2: two replicas of two ranks each give one process's greedy answers; each replica's follower
    rank runs inside its replica's CPUs."""
    import openai

    s = start_server(model, str(tmp_path_factory.mktemp("dp-tp") / "dp2tp2.log"), "--dtype", "float32",
                     "--dp-size", "2", "--tp", "2")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="None", max_retries=0)
        answers = [client.completions.create(model="any", prompt=p, max_tokens=6, temperature=0).choices[0].text
                   for p in PROMPTS[:2]]
        with Engine(model_path=model, dtype="float32", num_threads=1) as engine:
            expected = [o["text"] for o in engine.generate(PROMPTS[:2], {"max_new_tokens": 6, "temperature": 0})]
        assert answers == expected
        replicas = s.info()["internal_states"]
        assert [r["tp_size"] for r in replicas] == [2, 2] and all(r["tp_all_reduces"] > 0 for r in replicas)
        used = []  # the CPUs of each replica's two ranks
        for r in replicas:
            followers = rank_processes(r["worker_pid"])
            assert len(followers) == 1
            used.append(cpus_allowed(r["worker_pid"]) | cpus_allowed(followers[0]))
        if len(os.sched_getaffinity(0)) >= 2:
            assert not used[0] & used[1]
    finally:
        terminate_process(s.proc)
